"""Quantized KV cache rows: int8 and fp8 (e4m3) values with one float32 scale per (token slot, KV head).

Layout. A quantized layer cache is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim + 4] whose
dtype names the format (torch.int8 or torch.float8_e4m3fn, both one byte per element): the first head_dim
elements of a row are the quantized values, the last 4 bytes are the row's float32 scale. Keeping the scale
inside the row means every block copy (prefix reuse, preemption swap, host offload) carries its scales for
free, and a block written over several steps needs no requantization: each (token, head) row is final once
written.

Scheme: symmetric absmax per row, scale = max|x| / q_max, q = x / scale (int8: rounded and clamped to
[-127, 127]; fp8 e4m3: clamped to [-448, 448] and cast to torch.float8_e4m3fn, OCP FP8 spec, arXiv:2209.05433),
x ~ q * scale. Unquantized caches (float32/bfloat16/float16) keep plain rows of head_dim elements.
"""

from __future__ import annotations

import torch

from loom.config import SUPPORTED_KV_CACHE_DTYPES

SCALE_BYTES = 4  # one float32 scale per (token slot, kv head), stored at the end of the row
QUANTIZED_KV_DTYPES: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # dtype -> q_max
_NAMED: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite, non-zero scale


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache for --kv-cache-dtype `name` ("auto" = the model dtype).

    Raises:
        ValueError: unknown name (`kv_cache_dtype`).
    """
    if name == "auto":
        return model_dtype
    if name not in _NAMED:
        raise ValueError(f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, got {name!r}")
    return _NAMED[name]


def is_quantized(kv_dtype: torch.dtype) -> bool:
    """True for the 1-byte formats whose rows carry a scale."""
    return kv_dtype in QUANTIZED_KV_DTYPES


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements in the last dimension of a cache row: head_dim, plus the 4 scale bytes when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(kv_dtype) else head_dim


def kv_head_dim(kv_cache: torch.Tensor) -> int:
    """head_dim of a layer cache [2, num_blocks, block_size, num_kv_heads, row] (quantized rows end in a scale)."""
    row = kv_cache.shape[-1]
    return row - SCALE_BYTES if is_quantized(kv_cache.dtype) else row


def kv_row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one (token, kv head) row of K or V, scale included."""
    return kv_row_width(head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size()


def quantize_rows(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Quantize rows with one absmax scale each.

    Args:
        x: [..., head_dim] float tensor (any float dtype).
        kv_dtype: torch.int8 or torch.float8_e4m3fn.

    Returns:
        [..., head_dim + 4] tensor of kv_dtype: the values, then the float32 scale's 4 bytes.
    """
    q_max = QUANTIZED_KV_DTYPES[kv_dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / q_max).clamp_min(_MIN_SCALE)  # [..., 1] float32
    scaled = (xf / scale).clamp(-q_max, q_max)
    values = scaled.round().to(torch.int8) if kv_dtype == torch.int8 else scaled.to(kv_dtype)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 4]
    return torch.cat([values.view(torch.uint8), scale_bytes], dim=-1).view(kv_dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_rows: [..., head_dim + 4] of int8/float8_e4m3fn -> [..., head_dim] of out_dtype."""
    raw = rows.contiguous().view(torch.uint8)
    head_dim = raw.shape[-1] - SCALE_BYTES
    values = raw[..., :head_dim].view(rows.dtype).float()
    scale = raw[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (values * scale).to(out_dtype)


__all__ = [
    "QUANTIZED_KV_DTYPES",
    "SCALE_BYTES",
    "dequantize_rows",
    "is_quantized",
    "kv_head_dim",
    "kv_row_bytes",
    "kv_row_width",
    "quantize_rows",
    "resolve_kv_cache_dtype",
]
