"""AWQ: activation-aware weight quantization (Lin, Tang, Tang, Yang, Dang, Gan, Han, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", 2023, arXiv:2306.00978), the pieces that act on matrices.

The paper's observation: the few input channels with large activations matter most, and scaling such a channel
up before rounding (w_j * s_j, with x_j / s_j folded into the op that produces x) shrinks its relative rounding
error. Per group of linear layers that read the same input x [T, K] it searches

    s = mean_t |x_tj| ** alpha,  normalised by sqrt(max(s) * min(s)),   alpha in {0, 1/20, ..., 19/20}

for the alpha whose block output with the weights quantized, f(x; Q(W s) / s), is closest (mean squared error)
to the float block output f(x; W) on calibration activations (section 3.2). alpha = 0 gives s = 1, plain
round to nearest, so the search never chooses worse than RTN on its own data. The reference implementation's
later default ("duo scaling", AutoAWQ and llm-compressor) divides by the weights' own per-channel magnitude too,

    s = mean_t |x_tj| ** alpha / (mean_n |w_nj| / max_{group} |w| ) ** (1 - alpha),

and llm-compressor's "both" searches the two grids and keeps the better; `scaling` chooses among the three.
Optionally (section 3.2's "weight clipping", as the reference implementation does) the range of each weight
group is then shrunk to the max |w| * (1 - i/20), i < 10, whose per-group output error is smallest.

The grid (asymmetric, "zero_point": true, one per group of `group_size` input columns and output row):
    scale = (max - min) / 15 (rounded to float16, the value the checkpoint stores),
    zero = clamp(-round(min / scale), 0, 15),  code = clamp(round(w / scale) + zero, 0, 15),
    w' = scale * (code - zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from loom.quant.gptq import GPTQWeight

BITS = 4
MAXQ = 2**BITS - 1
GRID_POINTS = 20  # alphas i / 20, i = 0..19 (the reference implementation's grid)
CLIP_STEPS = 10  # shrink factors 1 - i / 20, i = 0..9 (max shrink 0.5)


def _check_group(k: int, group_size: int) -> None:
    if group_size < 1 or group_size > k:
        raise ValueError(f"group_size must be in 1..{k} (the input size), got {group_size}")


def _grid(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, G, 1] of grouped weights wg [N, G, gs]: the module docstring's grid."""
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-5) / MAXQ).half().float()
    zero = (-(lo / scale).round()).clamp(0, MAXQ)
    return scale, zero


def _split(k: int, group_size: int) -> list[tuple[slice, int]]:
    """(columns, group size) of the full groups and of a last, shorter group when group_size does not divide k
    (as GPTQ's grid: SmolLM2's 576 inputs are four groups of 128 and one of 64)."""
    main = k - k % group_size
    parts = [(slice(0, main), group_size)] if main else []
    return parts + ([(slice(main, k), k - main)] if main < k else [])


def _codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes float32 [N, K], scale [N, G], zero [N, G]) of w [N, K] on the grid, G = ceil(K / group_size)."""
    n, k = w.shape
    _check_group(k, group_size)
    codes, scales, zeros = [], [], []
    for cols, size in _split(k, group_size):
        wg = w[:, cols].float().reshape(n, -1, size)
        scale, zero = _grid(wg)
        codes.append(((wg / scale).round() + zero).clamp(0, MAXQ).reshape(n, -1))
        scales.append(scale.squeeze(-1))
        zeros.append(zero.squeeze(-1))
    return torch.cat(codes, dim=1), torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def _expand(t: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """Per-group values [N, G] -> per column [N, K]."""
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W' [N, K] float32: w [N, K] quantized on AWQ's 4-bit asymmetric grid and dequantized.

    Raises:
        ValueError: group_size outside 1..K.
    """
    n, k = w.shape
    _check_group(k, group_size)
    out = torch.empty(n, k, dtype=torch.float32)
    for cols, size in _split(k, group_size):
        wg = w[:, cols].float().reshape(n, -1, size)
        scale, zero = _grid(wg)
        # in place on a fresh tensor: this runs 20 times per layer in the search
        q = wg.div(scale).round_().add_(zero).clamp_(0, MAXQ).sub_(zero).mul_(scale)
        out[:, cols] = q.reshape(n, -1)
    return out


def awq_quantize(w: torch.Tensor, group_size: int) -> GPTQWeight:
    """w [N, K] on AWQ's grid as codes, float16 scales and integer zeros per group (the same values as
    fake_quantize), in the GPTQWeight form the checkpoint writers share; g_idx = k // group_size.

    Raises:
        ValueError: group_size outside 1..K.
    """
    k = w.shape[1]
    codes, scale, zero = _codes(w, group_size)
    g_idx = (torch.arange(k) // group_size).to(torch.int32)
    return GPTQWeight(codes.to(torch.int32), scale.T.half().contiguous(), zero.T.to(torch.int32).contiguous(),
                      g_idx, BITS)


SCALINGS = ("activation", "duo", "both")  # the scale formulas search_scales may try (module docstring)


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """float32 [K]: per input channel, the mean over every row of the group's linears (each [N_i, K]) of |w|
    divided by the largest |w| of its (row, quantization group): duo scaling's weight magnitude.

    Raises:
        ValueError: group_size outside 1..K.
    """
    w = torch.cat([x.float() for x in weights])
    n, k = w.shape
    _check_group(k, group_size)
    out = torch.empty(n, k, dtype=torch.float32)
    for cols, size in _split(k, group_size):
        wg = w[:, cols].abs().reshape(n, -1, size)
        out[:, cols] = (wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)).reshape(n, -1)
    return out.mean(dim=0)


def activation_scales(x_mean_abs: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s [K] = mean|x| ** alpha (AWQ section 3.2), or with w_mean (weight_mean) mean|x| ** alpha /
    (w_mean ** (1 - alpha) + 1e-4) (duo scaling); clamped to >= 1e-4 and divided by sqrt(max(s) min(s))."""
    s = x_mean_abs.float().pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.float().pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


BlockFn = Callable[[list[torch.Tensor]], torch.Tensor]  # the block's weights -> its output on calibration inputs


class ScaleSearch(NamedTuple):
    """What search_scales chose."""

    scales: torch.Tensor  # s [K] float32
    alpha: float
    duo: bool  # whether s is the duo-scaling formula's
    errors: list[float]  # mean squared error of every candidate in search order ("both": activation grid first)


def search_scales(x_mean_abs: torch.Tensor, weights: list[torch.Tensor], block: BlockFn, group_size: int,
                  grid_points: int = GRID_POINTS, scaling: str = "activation") -> ScaleSearch:
    """AWQ's grid search for one group of linears that read the same input.

    Args:
        x_mean_abs: float32 [K], mean |x| per input channel over the calibration tokens.
        weights: the group's float weights, each [N_i, K].
        block: the block output (any shape) on the calibration inputs for a list of weights (same shapes).
        group_size: input columns per quantization group.
        grid_points: alphas i / grid_points, i = 0 .. grid_points - 1 (on the activation grid alpha 0 is RTN).
        scaling: "activation" (the paper's formula), "duo" (with the weights' magnitude) or "both" (each grid;
            the smaller error wins, so never worse than RTN on the search's own tokens).

    Raises:
        ValueError: an unknown scaling.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    reference = block(weights)
    w_mean = weight_mean(weights, group_size) if scaling != "activation" else None
    grids = {"activation": [None], "duo": [w_mean], "both": [None, w_mean]}[scaling]
    errors: list[float] = []
    best: tuple[float, torch.Tensor, float, bool] | None = None
    for wm in grids:
        for i in range(grid_points):
            alpha = i / grid_points
            s = activation_scales(x_mean_abs, alpha, wm)
            trial = [fake_quantize(w.float() * s, group_size) / s for w in weights]
            err = float((block(trial) - reference).float().square().mean())
            errors.append(err)
            if best is None or err < best[0]:
                best = (err, s, alpha, wm is not None)
    assert best is not None
    return ScaleSearch(best[1], best[2], best[3], errors)


def normalized_loss(block: BlockFn) -> BlockFn:
    """`block` with its output divided per output channel (last dimension) by the first call's RMS over the rest,
    for search_scales, whose first call is the float reference: each channel's error then counts relative to its
    own size, so that a few huge channels (the massive activations of Sun et al. 2024, arXiv:2402.17762, in the
    residual stream that o_proj and down_proj write) do not decide the search alone. A loom variant, not the
    paper's loss (plain mean squared error); benchmarks/BENCHMARKS.md measures both."""
    rms: list[torch.Tensor] = []

    def normalized(weights: list[torch.Tensor]) -> torch.Tensor:
        out = block(weights)
        if not rms:
            rms.append(out.reshape(-1, out.shape[-1]).square().mean(dim=0).sqrt().clamp(min=1e-6))
        return out / rms[0]
    return normalized


def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, steps: int = CLIP_STEPS,
                grid_points: int = GRID_POINTS) -> torch.Tensor:
    """AWQ's weight clipping: per (output row, group) the max |w| * (1 - i / grid_points), i < steps, whose
    group output x_g w_g^T on the calibration tokens x [T, K] is closest to the float one after rounding.

    Returns:
        float32 [N, ceil(K / group_size)] clip bounds (w is then clamped to [-bound, bound]).
    """
    n, k = w.shape
    _check_group(k, group_size)
    return torch.cat([_search_clip(w[:, cols].float(), x[:, cols].float(), size, steps, grid_points)
                      for cols, size in _split(k, group_size)], dim=1)


def _search_clip(w: torch.Tensor, x: torch.Tensor, size: int, steps: int, grid_points: int) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(n, k // size, size)  # [N, G, gs]
    xg = x.reshape(x.shape[0], k // size, size).transpose(0, 1)  # [G, T, gs]
    reference = torch.bmm(xg, wg.permute(1, 2, 0))  # [G, T, N]
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [N, G, 1]
    best_err = torch.full(org_max.shape[:2], float("inf"))
    best_max = org_max.squeeze(-1).clone()
    for i in range(steps):
        bound = org_max * (1 - i / grid_points)
        q = fake_quantize(torch.maximum(torch.minimum(wg, bound), -bound).reshape(n, k), size)
        out = torch.bmm(xg, q.reshape(n, k // size, size).permute(1, 2, 0))
        err = (out - reference).square().mean(dim=1).T  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, bound.squeeze(-1), best_max)
    return best_max


def apply_clip(w: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] with each group clamped to [-bound, bound] (bounds [N, ceil(K / group_size)])."""
    b = _expand(bounds.float(), w.shape[1], group_size)
    return torch.maximum(torch.minimum(w.float(), b), -b)
