"""GPTQ and round-to-nearest (RTN) weight quantization onto the integer grid of the GPTQ checkpoint format.

GPTQ: Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", 2022 (arXiv:2210.17323). For a linear layer y = W x with calibration inputs X
[K, n], it minimises ||W X - Q X||^2 one input column at a time: column j is rounded, and its error, divided
by [H^-1]_jj, is spread over the columns not yet rounded through row j of the upper Cholesky factor of H^-1
(H = 2 X X^T / n, dampened by `percdamp` times its mean diagonal). Updates are applied lazily in blocks of
`block_size` columns (the paper's section 3, step 2); with `act_order` the columns are visited in order of
decreasing diag(H) ("desc_act"), and group parameters are taken over that order, so g_idx is a permutation
of the trivial map. With `static_groups` (AutoGPTQ's option of that name) each group's parameters are fixed
first, from the weights before any update, over the groups of consecutive input columns: the columns are still
visited by decreasing diag(H), but g_idx stays the trivial map, so the checkpoint keeps the plain grouped
layout that the packed kernels and loom's C decode step run (no input permutation at run time).

The grid (one per group of `group_size` input columns and output row; AutoGPTQ's, which loaders expect):
    asymmetric: scale = (max - min) / maxq, zero = round(-min / scale), with min <= 0 <= max
    symmetric:  scale = 2 max|w| / maxq,   zero = (maxq + 1) / 2
    code q = clamp(round(w / scale) + zero, 0, maxq);  w' = scale * (q - zero);  maxq = 2^bits - 1
Checkpoint format v1 (checkpoint_format "gptq") stores zero - 1, so an asymmetric zero of 0 cannot be stored;
such a group takes zero = 1 and scale = max / (maxq - 1) instead (the same range, one code less).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass(slots=True)
class GPTQWeight:
    """A linear weight [N, K] on the GPTQ grid, in the checkpoint's orientation."""

    codes: torch.Tensor  # int32 [N, K], 0..2^bits - 1, input columns in the original order
    scales: torch.Tensor  # float16 [num_groups, N]
    zeros: torch.Tensor  # int32 [num_groups, N], the zero point itself (not the v1 "zero - 1")
    g_idx: torch.Tensor  # int32 [K]: the group of each input column
    bits: int  # 4 or 8

    def dequantize(self) -> torch.Tensor:
        """W' [N, K] float32 = scale[g_idx[k], n] * (codes[n, k] - zero[g_idx[k], n])."""
        g = self.g_idx.long()
        s = self.scales.float()[g].T  # [N, K]
        z = self.zeros.float()[g].T
        return s * (self.codes.float() - z)


def check_params(bits: int, group_size: int, input_size: int) -> None:
    """Raises ValueError for bits outside BITS or a group_size that is not -1 or a positive size."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size != -1 and group_size < 1:
        raise ValueError(f"group_size must be -1 (per channel) or positive, got {group_size}")
    if group_size != -1 and group_size > input_size:
        raise ValueError(f"group_size {group_size} exceeds the input size {input_size}")


def grid_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) of w [N, k] (float32): scale float32 [N] (already rounded to float16, so the
    codes are chosen against the scale the checkpoint stores), zero float32 [N] (integers). See the module
    docstring for the grid."""
    maxq = 2**bits - 1
    lo = w.amin(dim=1).clamp(max=0.0)
    hi = w.amax(dim=1).clamp(min=0.0)
    if sym:
        amax = torch.maximum(lo.abs(), hi)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
        zero = torch.where(scale > 0, (-lo / scale.clamp_min(1e-30)).round(), torch.ones_like(scale))
        low_zero = zero < 1  # v1 cannot store zero 0: one code less above, the same range
        scale = torch.where(low_zero, hi / (maxq - 1), scale)
        zero = zero.clamp(1, maxq)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, codes = zero
    return scale.half().float(), zero


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes float32 of w [N] or [N, k] for per-row scale / zero [N]."""
    s, z = (scale, zero) if w.dim() == 1 else (scale[:, None], zero[:, None])
    return (w / s).round().add_(z).clamp_(0, 2**bits - 1)


def _groups_of(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-k // group_size)


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> GPTQWeight:
    """Round to nearest, group by group: the GPTQ grid without error feedback (the baseline of Frantar et al.
    2022, section 4).

    Args:
        weight: [N, K] float.
        group_size: input columns per group, -1 = one group per row (per channel).

    Raises:
        ValueError: as check_params.
    """
    n, k = weight.shape
    check_params(bits, group_size, k)
    w = weight.detach().float()
    size = k if group_size == -1 else group_size
    codes = torch.empty(n, k, dtype=torch.int32)
    scales, zeros = [], []
    for g in range(_groups_of(k, group_size)):
        cols = slice(g * size, min(k, (g + 1) * size))
        scale, zero = grid_params(w[:, cols], bits, sym)
        codes[:, cols] = round_to_grid(w[:, cols], scale, zero, bits).to(torch.int32)
        scales.append(scale)
        zeros.append(zero)
    g_idx = (torch.arange(k) // size).to(torch.int32)
    return GPTQWeight(codes, torch.stack(scales).half(), torch.stack(zeros).to(torch.int32), g_idx, bits)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool, *,
                  act_order: bool = False, static_groups: bool = False, percdamp: float = 0.01,
                  block_size: int = 128) -> GPTQWeight:
    """GPTQ (Frantar et al. 2022, Algorithm 1) of one linear layer.

    Args:
        weight: [N, K] float (rows are independent: stacked projections that share an input, such as q/k/v,
            may be quantized as one matrix).
        hessian: [K, K] float32, 2 X X^T / n over the layer's calibration inputs X [K, n] (accumulate_hessian).
        group_size: input columns per group (in visiting order), -1 = per channel.
        act_order: visit columns by decreasing diag(H) ("desc_act"); g_idx then records each column's group.
        static_groups: each group's (scale, zero) from the unquantized weights of its consecutive columns, taken
            before the column loop; g_idx is then k // group_size whatever the visiting order.
        percdamp: lambda = percdamp * mean(diag(H)) is added to the diagonal before inversion.
        block_size: columns per lazy batch update.

    Raises:
        ValueError: as check_params; shapes that differ; a Hessian that stays singular after damping.
    """
    n, k = weight.shape
    check_params(bits, group_size, k)
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    if not 0 < percdamp < 1:
        raise ValueError(f"percdamp must be in (0, 1), got {percdamp}")
    w, h = _without_dead_inputs(weight, hessian)
    size = k if group_size == -1 else group_size
    static = None
    if static_groups and group_size != -1:  # per group, over consecutive columns, before any update
        static = [grid_params(w[:, g * size : (g + 1) * size], bits, sym) for g in range(_groups_of(k, group_size))]
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    group_of = (perm // size).tolist() if static is not None else None  # a visiting slot's static group
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_factor(h, percdamp)

    scales, zeros = [], []
    scale = zero = None  # the current group's grid
    if group_size == -1:
        scale, zero = grid_params(w, bits, sym)
        scales.append(scale)
        zeros.append(zero)

    def round_column(col: int, w1: torch.Tensor, i: int, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal scale, zero
        if static is not None:
            scale, zero = static[group_of[col]]
        elif group_size != -1 and col % group_size == 0:
            # the group's current (error-updated) weights: this block's rest, then columns not yet reached
            group = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :size]
            scale, zero = grid_params(group, bits, sym)
            scales.append(scale)
            zeros.append(zero)
        q = round_to_grid(w1[:, i], scale, zero, bits)
        return q, scale * (q - zero)

    codes = _lazy_batch_updates(w, hinv, block_size, round_column)

    inverse = torch.argsort(perm)
    if static is not None:
        scales, zeros = [s for s, _ in static], [z for _, z in static]
        g_idx = (torch.arange(k) // size).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // size)[inverse].to(torch.int32)  # group of original column c: its visit slot
    return GPTQWeight(codes[:, inverse].to(torch.int32), torch.stack(scales).half(),
                      torch.stack(zeros).to(torch.int32), g_idx, bits)


def _lazy_batch_updates(w: torch.Tensor, hinv: torch.Tensor, block_size: int,
                        round_column: Callable[[int, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
                        ) -> torch.Tensor:
    """GPTQ's column loop with lazy batch updates (Frantar et al. 2022, section 3, step 2), shared by both grids:
    w [N, K] (visiting order, updated in place), hinv the upper Cholesky factor of H^-1 [K, K].
    round_column(col, w1, i, i2) rounds column i of the current block w1 (= column col; the block ends at i2) and
    returns (codes [N], their values on the grid [N]). Returns the codes float32 [N, K] in visiting order."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.float32)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q, value = round_column(i1 + i, w1, i, i2)
            codes[:, i1 + i] = q
            err = (w1[:, i] - value) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes


def _without_dead_inputs(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w float32 copy, h float64 copy) with the inputs calibration never saw (zero Hessian diagonal) given weight 0
    and a unit diagonal: any value there leaves the calibration outputs unchanged."""
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return w, h


def _inverse_factor(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The upper Cholesky factor of (h + percdamp * mean(diag h) * I)^-1, float32 [K, K] (h float64, modified).

    Raises:
        ValueError: the dampened Hessian is not positive definite.
    """
    h += percdamp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    try:
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except RuntimeError as exc:  # torch raises _LinAlgError, a RuntimeError
        raise ValueError(f"the dampened Hessian is not positive definite; raise percdamp ({exc})") from None


def gptq_int8_per_channel(weight: torch.Tensor, hessian: torch.Tensor, *, act_order: bool = True,
                          percdamp: float = 0.01, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al. 2022, Algorithm 1) onto W8A8's grid instead of AutoGPTQ's: symmetric int8 with one
    scale per output row, scale = max|w_row| / 127 rounded to float16 (taken before any update), codes
    round(w / scale) clamped to -127..127 (loom/quant/rtn.quantize_q8 with one group per row, and
    compressed-tensors' int8 "channel" strategy). The error of each rounded column is spread over the columns not
    yet rounded, as in gptq_quantize.

    Args:
        weight: [N, K] float.
        hessian: [K, K] float32, 2 X X^T / n over the layer's calibration inputs (accumulate_hessian).
        act_order: visit columns by decreasing diag(H).
        percdamp: lambda = percdamp * mean(diag(H)) is added to the diagonal before inversion.
        block_size: columns per lazy batch update.

    Returns:
        (codes int8 [N, K], scales float16 [N]); weight ~ codes * scales[:, None].

    Raises:
        ValueError: shapes that differ, percdamp outside (0, 1), or a Hessian that stays singular after damping.
    """
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    if not 0 < percdamp < 1:
        raise ValueError(f"percdamp must be in (0, 1), got {percdamp}")
    w, h = _without_dead_inputs(weight, hessian)
    scales = (weight.detach().float().abs().amax(dim=1) / 127).half()
    s = torch.where(scales.float() > 0, scales.float(), torch.ones(n))  # an all-zero row: codes 0 at any scale
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_factor(h, percdamp)

    def round_column(_col: int, w1: torch.Tensor, i: int, _i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (w1[:, i] / s).round_().clamp_(-127, 127)
        return q, q * s

    codes = _lazy_batch_updates(w, hinv, block_size, round_column)
    return codes[:, torch.argsort(perm)].to(torch.int8).contiguous(), scales


def accumulate_hessian(hessian: torch.Tensor | None, count: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running H = 2 X X^T / n over layer inputs: fold the rows of x [..., K] into (hessian [K, K] float32,
    count of rows so far) and return the new pair."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    rows = x.shape[0]
    if hessian is None:
        hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32)
    total = count + rows
    hessian.mul_(count / total).addmm_(x.T, x, alpha=2.0 / total)
    return hessian, total
