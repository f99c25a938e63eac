"""Round-to-nearest (RTN) quantizers from a dense float matrix into loom's layouts (loom/quant/layout.py).

The simplest weight quantizer (the baseline in GPTQ, Frantar et al. 2022, and AWQ, Lin et al. 2023): each
group's codes are round((w - min) / scale) or round(w / scale), with the scale (and min) of the group's own
range. Used by the w4a16 / w8a16 / w8a8 methods when the checkpoint is dense.
"""

from __future__ import annotations

import torch

from loom.quant.layout import PackedWeight, pack_q4g


def quantize_q4g32(weight: torch.Tensor) -> PackedWeight:
    """weight [N, K] (K % 32 == 0) -> asymmetric 4-bit groups of 32: scale = (max - min) / 15 and min as
    float16, codes = round((w - min) / scale) clamped to 0..15 (the Q4_1 scheme).

    Raises:
        ValueError: K not a multiple of 32.
    """
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"4-bit groups of 32 need input_size % 32 == 0, got {k}")
    w = weight.detach().float().reshape(n, k // 32, 32)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = ((hi - lo) / 15).half()
    mins = lo.half()
    s = scales.float().unsqueeze(-1)
    codes = torch.where(s > 0, ((w - mins.float().unsqueeze(-1)) / s.clamp_min(1e-30)).round(), torch.zeros_like(w))
    return pack_q4g(codes.clamp_(0, 15).reshape(n, k), scales, mins)


def quantize_q8(weight: torch.Tensor, group_size: int) -> PackedWeight:
    """weight [N, K] -> symmetric int8 groups: scale = max|w| / 127 as float16, codes = round(w / scale)
    clamped to -127..127 (Q8_0's scheme); group_size = K gives one scale per output channel.

    Raises:
        ValueError: group_size is not 16 or a multiple of 32 dividing K.
    """
    n, k = weight.shape
    if k % group_size or (group_size != 16 and group_size % 32):
        raise ValueError(f"int8 groups of {group_size} need input_size % {group_size} == 0 and group 16 or "
                         f"a multiple of 32; input_size is {k}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scales = (w.abs().amax(dim=2) / 127).half()
    s = scales.float().unsqueeze(-1)
    codes = torch.where(s > 0, (w / s.clamp_min(1e-30)).round(), torch.zeros_like(w)).clamp_(-127, 127)
    return PackedWeight("q8g", codes.to(torch.int8).reshape(n, k).contiguous(), scales.contiguous(), None,
                        group_size)


def quantize_q8_asym(weight: torch.Tensor, group_size: int = 32) -> PackedWeight:
    """weight [N, K] -> int8 groups with a scale and an offset per group, W = scale * code + min', each group on
    whichever of two grids reconstructs it with the smaller squared error:

    - asymmetric: scale = (max - min) / 255, u = round((w - min) / scale) in 0..255 stored as the code u - 128,
      min' = min + 128 * scale: all 256 codes span the group's own range;
    - symmetric: scale = max|w| / 127, code = round(w / scale) in -127..127, min' = 0 (Q8_0's grid). A group
      that already lies on a Q8_0 grid (a GGUF Q8_0 tensor, e.g. SmolLM2's tied embedding) is reproduced
      exactly, where the asymmetric grid would move every weight by up to half its step.

    Choosing the grid per group by reconstruction error is the simplest form of the scale search that llama.cpp's
    quantizers (make_qx_quants) and AWQ's clipping search do. scale and min' are float16.

    Raises:
        ValueError: as quantize_q8.
    """
    n, k = weight.shape
    if k % group_size or (group_size != 16 and group_size % 32):
        raise ValueError(f"int8 groups of {group_size} need input_size % {group_size} == 0 and group 16 or "
                         f"a multiple of 32; input_size is {k}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    a_scales = ((hi - lo) / 255).half()
    a_mins = (lo + 128 * a_scales.float()).half()
    s_scales = (w.abs().amax(dim=2) / 127).half()
    s_mins = torch.zeros_like(s_scales)

    def codes_and_error(scales: torch.Tensor, mins: torch.Tensor, lo_code: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, m = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)
        codes = torch.where(s > 0, ((w - m) / s.clamp_min(1e-30)).round(), torch.zeros_like(w))
        codes = codes.clamp_(lo_code, 127)
        return codes, (codes * s + m - w).square().sum(dim=2)

    a_codes, a_err = codes_and_error(a_scales, a_mins, -128)
    s_codes, s_err = codes_and_error(s_scales, s_mins, -127)
    use_sym = s_err <= a_err
    codes = torch.where(use_sym.unsqueeze(-1), s_codes, a_codes)
    scales = torch.where(use_sym, s_scales, a_scales)
    mins = torch.where(use_sym, s_mins, a_mins)
    return PackedWeight("q8g", codes.to(torch.int8).reshape(n, k).contiguous(), scales.contiguous(),
                        mins.contiguous(), group_size)


def quantize_fp8_e4m3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [N, 1]) with scale = max|w| / 448 per output
    channel (448 = the largest e4m3 value; OCP FP8 spec), so W ~= fp8 * scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (w / scale).to(torch.float8_e4m3fn), scale
