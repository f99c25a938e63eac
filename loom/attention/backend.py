"""AttentionBackend Protocol, the shared K/V cache write and read (with KV quantization), and the backend registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from loom.attention.kv_quant import dequantize_rows, is_quantized, quantize_rows
from loom.attention.metadata import AttentionMetadata
from loom.attention.sparse import SparseAttentionConfig


class AttentionBackend(Protocol):
    """Paged attention over a flattened batch. One instance serves every layer."""

    name: str  # registry key

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write this step's K/V into kv_cache, then attend.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key, value: [num_tokens, num_kv_heads, head_dim] of this step's tokens.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, row] of this layer (updated in place); row is
                kv_row_width(head_dim, dtype) (head_dim plus scale bytes for int8/fp8): write with `write_kv_cache`, read with `gather_kv`.
            attn_metadata: positions of the tokens in the cache.
            scale: softmax scale, usually head_dim ** -0.5.
            sliding_window: tokens each query may look back (query included); None = unlimited.

        Returns:
            [num_tokens, num_heads, head_dim], dtype of query.
        """
        ...


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    has_pad_slots: bool | None = None,
) -> None:
    """Scatter key/value rows into the paged cache at slot_mapping, skipping PAD_SLOT_ID (-1) slots.

    Quantized caches (int8, float8_e4m3fn; see loom.attention.kv_quant) store each (token, kv head) row
    as its 1-byte values followed by its own scales (int8: float16 scale + minimum per 32 values; fp8: one
    float32 scale), so each row is final once written. Every backend writes K/V through this function.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, num_kv_heads, row] (row = kv_row_width(head_dim, dtype): head_dim,
            plus the scale bytes when quantized), updated in place.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset, or -1.
        has_pad_slots: whether slot_mapping holds a -1, when the caller knows (one check per step instead of
            one device sync per layer); None = check here.
    """
    num_kv_heads, row = kv_cache.shape[-2:]
    if has_pad_slots is None:
        has_pad_slots = not bool((slot_mapping >= 0).all())
    if has_pad_slots:
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    if is_quantized(kv_cache.dtype):
        # index_copy_ lacks float8 kernels on some devices: scatter the raw bytes instead.
        flat = kv_cache.view(torch.uint8).view(2, -1, num_kv_heads, row)
        flat[0].index_copy_(0, slot_mapping, quantize_rows(key, kv_cache.dtype).view(torch.uint8))
        flat[1].index_copy_(0, slot_mapping, quantize_rows(value, kv_cache.dtype).view(torch.uint8))
        return
    flat = kv_cache.view(2, -1, num_kv_heads, row)  # [2, num_blocks * block_size, H_kv, d]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one request's first seq_len K/V rows through its block table, dequantizing when needed.

    Every backend reads K/V through this function (or `dequantize_kv` on rows it indexed itself).

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, row] (see write_kv_cache).
        block_table: [max_num_blocks] int32 block ids of the request (only the first
            ceil(seq_len / block_size) are read).
        out_dtype: dtype of the result for quantized caches (default float32); plain caches are returned
            in their own dtype (callers cast).

    Returns:
        key, value: each [seq_len, num_kv_heads, head_dim].
    """
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    num_kv_heads, row = kv_cache.shape[-2:]
    key = kv_cache[0, blocks].reshape(-1, num_kv_heads, row)[:seq_len]
    value = kv_cache[1, blocks].reshape(-1, num_kv_heads, row)[:seq_len]
    return dequantize_kv(key, out_dtype), dequantize_kv(value, out_dtype)


def gather_kv_padded(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the K/V of several requests at once through their block tables, padded to the same length.

    One index_select over the block dimension for K and V together (no per-request loop); rows past a
    request's seq_len are whatever its padding blocks hold, so callers mask them.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, row] (see write_kv_cache).
        block_ids: [num_reqs, num_blocks_per_req] int64 block ids, padded with any valid id.
        out_dtype: dtype of the result for quantized caches (default float32); plain caches are returned
            in their own dtype (callers cast).

    Returns:
        key, value: each [num_reqs, num_blocks_per_req * block_size, num_kv_heads, head_dim].
    """
    num_reqs, blocks_per_req = block_ids.shape
    _, _, block_size, num_kv_heads, row = kv_cache.shape
    # index_select lacks float8 kernels on some devices: move the raw bytes of quantized caches.
    source = kv_cache.view(torch.uint8) if is_quantized(kv_cache.dtype) else kv_cache
    rows = source.index_select(1, block_ids.reshape(-1)).view(kv_cache.dtype)
    rows = rows.view(2, num_reqs, blocks_per_req * block_size, num_kv_heads, row)
    return dequantize_kv(rows[0], out_dtype), dequantize_kv(rows[1], out_dtype)


def dequantize_kv(rows: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cache rows [..., row] -> K or V [..., head_dim]: dequantized (to out_dtype, default float32) for
    int8/fp8 caches, returned unchanged otherwise."""
    if not is_quantized(rows.dtype):
        return rows
    return dequantize_rows(rows, out_dtype or torch.float32)


def _make_torch_reference(float32_kernels: bool = False, sparse: SparseAttentionConfig | None = None
                          ) -> AttentionBackend:
    from loom.attention.reference import TorchReferenceBackend

    del float32_kernels  # plain torch only
    if sparse is not None:
        raise ValueError("sparse attention (topk-blocks) runs on the cpu_paged attention backend, not torch_reference")
    return TorchReferenceBackend()


def _make_cpu_paged(float32_kernels: bool = False, sparse: SparseAttentionConfig | None = None) -> AttentionBackend:
    from loom.attention.cpu_paged import CpuPagedBackend

    return CpuPagedBackend(float32_kernels, sparse)


# Read-only registry: backend name -> factory(float32_kernels, sparse). New backends add an entry here; one that
# cannot serve block-sparse decode raises ValueError when given a SparseAttentionConfig.
ATTENTION_BACKENDS: Mapping[str, Callable[..., AttentionBackend]] = MappingProxyType(
    {"torch_reference": _make_torch_reference, "cpu_paged": _make_cpu_paged}
)


def default_attention_backend(device: torch.device) -> str:
    """Backend used when none is named: cpu_paged (batched decode, plain torch ops, so any device runs it)."""
    del device  # one default for now; a device-specific kernel would be chosen here
    return "cpu_paged"


def get_attention_backend(name: str = "torch_reference", float32_kernels: bool = False,
                          sparse: SparseAttentionConfig | None = None) -> AttentionBackend:
    """Instantiate the attention backend registered under `name`; `float32_kernels` lets it run loom's C
    kernels on float32 too (off on the oracle path, quantization "none"); `sparse` switches on block-sparse
    decode attention (loom/attention/sparse.py, Quest), None = dense.

    Raises:
        ValueError: unknown name (the message lists the registered ones), or a backend that cannot serve `sparse`.
    """
    factory = ATTENTION_BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"attention backend {name!r} is unknown; registered: {sorted(ATTENTION_BACKENDS)}")
    return factory(float32_kernels, sparse)
