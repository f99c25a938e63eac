"""Quantized KV cache rows: int8 with group-wise asymmetric scales, fp8 (e4m3) with one scale per row.

Layout. A quantized layer cache is one tensor [2, num_blocks, block_size, num_kv_heads, row] whose dtype names
the format (torch.int8 or torch.float8_e4m3fn, both one byte per element). Each (token slot, KV head) row of K
or V is self-contained: the first head_dim bytes are the quantized values, the rest is that row's metadata.
Keeping the metadata inside the row means every block copy (prefix reuse, preemption swap, host offload)
carries it for free, and a block written over several steps needs no requantization: a row is final once
written.

int8: the row is split into groups of 32 consecutive values (the last group may be shorter when head_dim is not
a multiple of 32); each group stores its minimum `lo` and `scale = (max - lo) / 255` as float16, and the values
as codes u = round((x - lo) / scale) in [0, 255], kept as int8 (u - 128); x ~ u * scale + lo. Row: head_dim
bytes, then num_groups float16 scales, then num_groups float16 minimums (head_dim 64: 64 + 8 = 72 bytes, 0.56 of
bfloat16). Asymmetric min/max quantization in small groups of the KV cache follows FlexGen (arXiv:2303.06865,
section 5) and KIVI (arXiv:2402.02750, which groups K per channel; here groups run along head_dim so that a row
stays self-contained). Small groups confine a large-magnitude (outlier) channel of K to its own group, and the
zero point spends all 256 codes on [min, max] instead of [-absmax, absmax]. On SmolLM2-135M this cut the
teacher-forced top-1 flip rate against a bfloat16 cache from 1.63% (one float32 absmax scale per row) to 0.59%;
see benchmarks/NOTES.md, "KV cache quantization accuracy".

fp8 e4m3: one float32 scale per row, scale = max|x| / 448, values clamped to [-448, 448] and cast to
torch.float8_e4m3fn (OCP FP8 spec, arXiv:2209.05433); x ~ q * scale. Row: head_dim bytes + 4. A floating format
already adapts to each value's magnitude, and group scales measured no better for it.

float16 metadata range: |x| beyond 65504 saturates; a group whose range is below 2**-24 * 255 reconstructs
to its (float16-rounded) minimum. Unquantized caches (float32/bfloat16/float16) keep plain rows of head_dim
elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loom.config import SUPPORTED_KV_CACHE_DTYPES


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    """How one quantized dtype lays out and encodes a (token slot, KV head) row."""

    group_size: int | None  # values sharing one scale; None = the whole row is one group
    scale_dtype: torch.dtype  # dtype of the stored scale (and minimum, when asymmetric)
    asymmetric: bool  # True: per-group minimum + unsigned codes [0, 255]; False: symmetric absmax
    q_max: float  # symmetric formats: largest code magnitude (448 for e4m3); asymmetric: number of steps (255)

    @property
    def meta_bytes_per_group(self) -> int:
        """Bytes of metadata per group: the scale, plus the minimum when asymmetric."""
        itemsize = torch.empty((), dtype=self.scale_dtype).element_size()
        return itemsize * (2 if self.asymmetric else 1)

    def num_groups(self, head_dim: int) -> int:
        """Groups in a row of head_dim values (the last one shorter when group_size does not divide head_dim)."""
        return 1 if self.group_size is None else math.ceil(head_dim / self.group_size)

    def row_width(self, head_dim: int) -> int:
        """Bytes (= elements) of one stored row: the values, then all groups' metadata."""
        return head_dim + self.num_groups(head_dim) * self.meta_bytes_per_group

    def head_dim_of_row(self, row: int) -> int:
        """Inverse of row_width (row_width is strictly increasing in head_dim, so this is exact)."""
        meta = self.meta_bytes_per_group
        if self.group_size is None:
            return row - meta
        return row - math.ceil(row / (self.group_size + meta)) * meta


# Values per int8 scale group. Measured (benchmarks/NOTES.md): 32 asymmetric flips 0.59% of teacher-forced
# top-1 tokens at 0.56x the bytes of bfloat16; 16 flips as many at 0.63x, 64 flips 1.17%.
INT8_GROUP_SIZE = 32
QUANT_FORMATS: dict[torch.dtype, KVQuantFormat] = {
    torch.int8: KVQuantFormat(group_size=INT8_GROUP_SIZE, scale_dtype=torch.float16, asymmetric=True, q_max=255.0),
    torch.float8_e4m3fn: KVQuantFormat(group_size=None, scale_dtype=torch.float32, asymmetric=False, q_max=448.0),
}
_NAMED: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
_MIN_SCALE = 2.0**-24  # smallest positive float16: a constant group still gets a finite, non-zero scale
_FP16_MAX = 65504.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, packed_cpu: bool = False) -> torch.dtype:
    """Storage dtype of the KV cache for --kv-cache-dtype `name`.

    "auto" is the model dtype, except float16 for a float32 model whose weights are packed on the CPU
    (`packed_cpu`: the GGUF default and loom's other packed methods), as llama.cpp stores its KV cache: half the
    bytes every decode step streams and every token holds, at no measured quality cost (the bundled Q4_1 model,
    8 x 512 held-out tokens: perplexity +0.00%, top-1 agreement with the dequantized float32 model 99.98%, as
    with a float32 cache; benchmarks/BENCHMARKS.md, 2026-12-02). The float32 oracle path (`--quantization
    none`) keeps a float32 cache.

    Raises:
        ValueError: unknown name (`kv_cache_dtype`).
    """
    if name == "auto":
        return torch.float16 if packed_cpu and model_dtype == torch.float32 else model_dtype
    if name not in _NAMED:
        raise ValueError(f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, got {name!r}")
    return _NAMED[name]


def is_quantized(kv_dtype: torch.dtype) -> bool:
    """True for the 1-byte formats whose rows carry their own scales."""
    return kv_dtype in QUANT_FORMATS


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements in the last dimension of a cache row: head_dim, plus the metadata bytes when quantized."""
    return QUANT_FORMATS[kv_dtype].row_width(head_dim) if is_quantized(kv_dtype) else head_dim


def kv_head_dim(kv_cache: torch.Tensor) -> int:
    """head_dim of a layer cache [2, num_blocks, block_size, num_kv_heads, row]."""
    row = kv_cache.shape[-1]
    return QUANT_FORMATS[kv_cache.dtype].head_dim_of_row(row) if is_quantized(kv_cache.dtype) else row


def kv_row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one (token, kv head) row of K or V, metadata included."""
    return kv_row_width(head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size()


def describe_kv_format(kv_dtype: torch.dtype) -> str:
    """Human description of the KV storage for the start-up log, e.g.
    "int8, asymmetric, float16 scale + min per 32 values"."""
    name = str(kv_dtype).removeprefix("torch.")
    fmt = QUANT_FORMATS.get(kv_dtype)
    if fmt is None:
        return name
    scale = str(fmt.scale_dtype).removeprefix("torch.")
    where = "per token slot and kv head" if fmt.group_size is None else f"per {fmt.group_size} values"
    if fmt.asymmetric:
        return f"{name}, asymmetric, {scale} scale + min {where}"
    return f"{name}, symmetric, {scale} scale {where}"


def quantize_rows(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Quantize rows in the format of kv_dtype (see the module docstring).

    Args:
        x: [..., head_dim] float tensor (any float dtype).
        kv_dtype: torch.int8 or torch.float8_e4m3fn.

    Returns:
        [..., kv_row_width(head_dim, kv_dtype)] tensor of kv_dtype: the values, then the metadata bytes.
    """
    fmt = QUANT_FORMATS[kv_dtype]
    head_dim = x.shape[-1]
    groups = _split_groups(x.float(), fmt)  # [..., num_groups, group]
    if fmt.asymmetric:
        lo = groups.amin(dim=-1, keepdim=True).clamp(-_FP16_MAX, _FP16_MAX).to(fmt.scale_dtype)
        span = groups.amax(dim=-1, keepdim=True) - lo.float()
        scale = (span / fmt.q_max).clamp(_MIN_SCALE, _FP16_MAX).to(fmt.scale_dtype)
        # Codes come from the stored (rounded) lo and scale, so reconstruction error stays within scale / 2.
        codes = ((groups - lo.float()) / scale.float()).round().clamp(0, fmt.q_max) - 128
        values = codes.to(torch.int8)
        meta = [scale, lo]
    else:
        scale = (groups.abs().amax(dim=-1, keepdim=True) / fmt.q_max).clamp_min(1e-12).to(fmt.scale_dtype)
        scaled = (groups / scale.float()).clamp(-fmt.q_max, fmt.q_max)
        values = scaled.round().to(torch.int8) if kv_dtype == torch.int8 else scaled.to(kv_dtype)
        meta = [scale]
    value_bytes = values.flatten(-2)[..., :head_dim].contiguous().view(torch.uint8)
    meta_bytes = [m.squeeze(-1).contiguous().view(torch.uint8) for m in meta]  # each [..., num_groups * itemsize]
    return torch.cat([value_bytes, *meta_bytes], dim=-1).view(kv_dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_rows: [..., row] of int8/float8_e4m3fn -> [..., head_dim] of out_dtype."""
    fmt = QUANT_FORMATS[rows.dtype]
    raw = rows.contiguous().view(torch.uint8)
    head_dim = fmt.head_dim_of_row(raw.shape[-1])
    num_groups = fmt.num_groups(head_dim)
    meta_size = num_groups * torch.empty((), dtype=fmt.scale_dtype).element_size()
    scale = raw[..., head_dim : head_dim + meta_size].contiguous().view(fmt.scale_dtype).float()  # [..., G]
    values = _split_groups(raw[..., :head_dim].view(rows.dtype).float(), fmt)  # [..., G, group]
    if fmt.asymmetric:
        lo = raw[..., head_dim + meta_size :].contiguous().view(fmt.scale_dtype).float()
        out = (values + 128) * scale[..., None] + lo[..., None]
    else:
        out = values * scale[..., None]
    return out.flatten(-2)[..., :head_dim].to(out_dtype)


def _split_groups(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """[..., head_dim] -> [..., num_groups, group]; a short last group is padded with copies of the row's
    last value, which leave that group's min/max (and so its scale) unchanged."""
    head_dim = x.shape[-1]
    group = head_dim if fmt.group_size is None else fmt.group_size
    pad = fmt.num_groups(head_dim) * group - head_dim
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.unflatten(-1, (-1, group))


__all__ = [
    "INT8_GROUP_SIZE",
    "KVQuantFormat",
    "QUANT_FORMATS",
    "dequantize_rows",
    "describe_kv_format",
    "is_quantized",
    "kv_head_dim",
    "kv_row_bytes",
    "kv_row_width",
    "quantize_rows",
    "resolve_kv_cache_dtype",
]
