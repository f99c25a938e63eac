"""The packed-weight kernels in plain torch: the portable fallback (a CPU without a compiler, ARM, CUDA) and
the reference loom's C kernels (loom/kernels/quant.py, csrc/qgemm.c) are tested against.

Same four methods and the same definitions as the C code (qgemm.c's header): activation quantization
with the same rounding (torch.round is round-half-even, as the C code's conversion under the default
rounding mode), so codes and scales are equal bit for bit; `gemm_q8` as one float32 matmul of the
dequantized activations (xq * xs) by the dequantized symmetric part of the weight (scales * codes), plus
the mins' term from the activation group sums exactly as the C code defines them; `gemm_f` as
layout.dequantize then F.linear in float32 (float activations: the C kernels' int16 activation codes,
whose reference is `quantize_activations16`, differ from it by at most their rounding, 2^-16 of a block's
max|x|); `dequantize` is layout.dequantize. Runs on the device of its
inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.kernels.quant import QuantizedActivations, check_activations
from loom.quant.layout import Q4_LAYOUTS, PackedWeight, dequantize, unpack_codes

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float16 too: CUDA models may run in it


def group_sums(xa: QuantizedActivations, group_size: int) -> torch.Tensor:
    """gs [M, K // group_size] float32: the activation sum each weight group's min multiplies (qgemm.c, item
    2): xsum for groups of 32, the float sum of the group's xsum blocks for larger groups, and for groups
    of 16 (half a block) the sum of the dequantized activations xs * sum(xq) of the half."""
    m, k = xa.xq.shape
    if group_size == 32:
        return xa.xsum
    if group_size == 16:
        halves = xa.xq.view(m, k // 16, 16).to(torch.int32).sum(-1).float()
        return xa.xs.repeat_interleave(2, dim=1) * halves
    return xa.xsum.view(m, k // group_size, group_size // 32).sum(-1)


class TorchQuantKernels:
    """loom's packed-weight kernels in torch (any device); `isa` is "torch"."""

    isa = "torch"

    def quantize_activations(self, x: torch.Tensor, per_token: bool = False) -> QuantizedActivations:
        """x [M, K] (K % 32 == 0) -> int8 codes per block of 32: s = max|x| / 127 (per_token: over the
        row), q = round(x / s) clamped to [-127, 127], q = 0 where s == 0; xsum the block sums of x.

        Raises:
            ValueError: x not a 2-D floating tensor with K % 32 == 0.
        """
        m, k, blocks = _blocks_of_32(x)
        amax = blocks.abs().amax(-1) if k else blocks.new_zeros(m, 0)
        if per_token and k:
            amax = amax.amax(-1, keepdim=True).expand(m, k // 32)
        xs = (amax / 127).contiguous()
        s = xs.unsqueeze(-1)
        q = torch.where(s > 0, torch.round(blocks / s).clamp(-127, 127), 0.0)
        return QuantizedActivations(q.to(torch.int8).reshape(m, k), xs, blocks.sum(-1))

    def gemm_q8_per_channel(self, xa: QuantizedActivations, w: PackedWeight, bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """((float(x_q W_q^T) * s_w) * s_x) (+ bias) for a q8g weight with group_size = K and no mins, xa's scale per
        row xa.xs[:, 0]: the integer sums in float64 (exact: |sum| < 2^31 < 2^53), then the float32 epilogue of
        methods._int8_gemm.

        Raises:
            ValueError: a weight with groups or mins.
        """
        m, k = check_activations(xa)
        if w.layout != "q8g" or w.group_size != k or w.mins is not None:
            raise ValueError("gemm_q8_per_channel needs a q8g weight with one scale per row (group_size = K), no mins")
        dots = (xa.xq.double() @ w.qweight.double().t()).float()
        y = dots.mul_(w.scales.float().t()).mul_(xa.xs[:, :1])
        if bias is not None:
            y.add_(bias)
        return y.to(out_dtype)

    def rotate_input(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """loom.quant.hadamard.rotate_input (the reference of the C kernels' rotate_input)."""
        from loom.quant.hadamard import rotate_input

        return rotate_input(x, block)

    def quantize_activations16(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The C gemm_f's int16 activation codes (qgemm.c, item 3), bit for bit: x [M, K] -> codes int16
        [M, K] = round(x / s) clamped to [-32767, 32767] (0 where s == 0), s = max|x| / 32767 per block of 32
        (float32 [M, K/32]; NaN for a block holding a NaN), and the sums of the dequantized halves
        s * sum(codes) float32 [M, K/16].

        Raises:
            ValueError: x not a 2-D floating tensor with K % 32 == 0.
        """
        m, k, blocks = _blocks_of_32(x)
        s = blocks.abs().amax(-1) / 32767 if k else blocks.new_zeros(m, 0)
        q = torch.where(s.unsqueeze(-1) > 0, torch.round(blocks / s.unsqueeze(-1)).clamp(-32767, 32767), 0.0)
        halves = q.view(m, k // 16, 16).sum(-1) * s.repeat_interleave(2, dim=1)
        return q.to(torch.int16).reshape(m, k), s.contiguous(), halves

    def gemm_q8(self, xa: QuantizedActivations, w: PackedWeight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y [M, N] = xa W^T (+ bias) in float32, cast to `out_dtype`.

        Raises:
            ValueError: mismatched shapes or wrong dtypes.
        """
        m, k = check_activations(xa)
        n = _check(w, k, bias, out_dtype)
        xd = (xa.xq.float().view(m, k // 32, 32) * xa.xs.unsqueeze(-1)).view(m, k)
        g = w.group_size
        wd = (unpack_codes(w).float().view(n, k // g, g) * w.scales.float().unsqueeze(-1)).view(n, k)
        y = xd @ wd.T
        if w.mins is not None and w.layout in Q4_LAYOUTS:  # per block: each of a group's blocks with its min
            y = y + xa.xsum @ w.mins.float().repeat_interleave(g // 32, dim=1).T
        elif w.mins is not None:
            y = y + group_sums(xa, g) @ w.mins.float().T
        if bias is not None:
            y = y + bias
        return y.to(out_dtype)

    def gemm_f(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y [M, N] = x dequantize(w)^T (+ bias) in float32, cast to `out_dtype`.

        Raises:
            ValueError: mismatched shapes or wrong dtypes.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
            raise ValueError("x must be a 2-D float32 / bfloat16 / float16 tensor [M, K]")
        _check(w, x.shape[1], bias, out_dtype)
        return F.linear(x.float(), dequantize(w, torch.float32), bias).to(out_dtype)

    def dequantize(self, w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype`: layout.dequantize."""
        if not isinstance(w, PackedWeight):
            raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dequantize(w, dtype)

    def dequantize_rows(self, w: PackedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of W: [len(ids), K] in `dtype` (an embedding lookup): layout.dequantize of w.rows(ids).

        Raises:
            ValueError: an id outside [0, N) (the C kernels' error), or what `dequantize` raises.
        """
        n = w.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ValueError(f"ids must lie in [0, {n}): got {ids.min().item()}..{ids.max().item()}")
        return self.dequantize(w.rows(ids), dtype)


def _blocks_of_32(x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """x [M, K] -> (M, K, x as float32 blocks [M, K/32, 32]); ValueError unless x is a 2-D float tensor with
    K % 32 == 0."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError("x must be a 2-D float32 / bfloat16 / float16 tensor [M, K]")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    return m, k, x.float().reshape(m, k // 32, 32)


def _check(w: PackedWeight, k: int, bias: torch.Tensor | None, out_dtype: torch.dtype) -> int:
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
    n, wk = w.shape
    if wk != k:
        raise ValueError(f"activations have K={k} but the weight is [{n}, {wk}]")
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias must be float32 [{n}] or None")
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return n
