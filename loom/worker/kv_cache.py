"""Paged K/V tensors: their size per token, how many blocks fit a budget, and their allocation.

The cache dtype may differ from the model dtype (--kv-cache-dtype); int8 and fp8 rows carry their own scales
(int8: float16 scale + minimum per 32 values; fp8: one float32 scale per row), see loom.attention.kv_quant.
"""

from __future__ import annotations

import torch

from loom.attention.kv_quant import kv_row_bytes, kv_row_width
from loom.model.arch import ModelArchConfig
from loom.model.huge_pages import zeros_on_huge_pages


def kv_cache_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies over all layers: 2 * L * H_kv * row bytes, where a row is
    d_h * element size, plus the row's scale bytes for int8/fp8 caches (kv_quant.kv_row_bytes)."""
    return 2 * arch.num_layers * arch.num_kv_heads * kv_row_bytes(arch.head_dim, dtype)


def num_blocks_for_budget(arch: ModelArchConfig, dtype: torch.dtype, block_size: int, budget_bytes: int,
                          layers_per_block: int | None = None) -> int:
    """Whole KV blocks of block_size tokens that fit in budget_bytes; a block holds every layer's K/V, or
    `layers_per_block` layers' (a hybrid KV cache's page: one KV cache group's layers, loom/core/kv_groups.py).

    Raises:
        ValueError: block_size < 1, or the budget does not hold a single block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    bytes_per_block = kv_cache_bytes_per_token(arch, dtype) * block_size
    if layers_per_block is not None:
        bytes_per_block = bytes_per_block // arch.num_layers * layers_per_block
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_gb ({budget_bytes / (1 << 30):.3g} GiB) holds no KV block of block_size="
            f"{block_size} tokens ({bytes_per_block} bytes): raise kv_cache_memory_gb or lower block_size"
        )
    return num_blocks


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    layer_slots: list[int] | None = None, held: range | None = None,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer (on the CPU each in a 2 MB-aligned mapping advised MADV_HUGEPAGE, committed here:
    loom/model/huge_pages.py), [2, num_blocks, block_size, num_kv_heads, row]
    (index 0 = keys, 1 = values; row = kv_row_width(head_dim, dtype): head_dim, plus scale bytes for int8/fp8);
    slot s lives at [:, s // block_size, s % block_size]. With `layer_slots` (a hybrid KV cache: each layer's
    physical slot, loom/core/kv_groups.layer_slots) layers of the same slot share one tensor: each block id is
    a page that one KV cache group owns at a time. With `held` (a pipeline stage's layers) the other layers get an
    empty tensor.

    Raises:
        ValueError: num_blocks or block_size < 1.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = (2, num_blocks, block_size, arch.num_kv_heads, kv_row_width(arch.head_dim, dtype))

    def zeros() -> torch.Tensor:  # on the CPU on 2 MB pages where the OS has them (loom/model/huge_pages.py)
        if torch.device(device).type == "cpu":
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    if layer_slots is None:
        return [zeros() if held is None or i in held
                else torch.empty(0, dtype=dtype, device=device) for i in range(arch.num_layers)]
    physical = [zeros() for _ in range(max(layer_slots) + 1)]
    return [physical[slot] for slot in layer_slots]


def copy_kv_slots(kv_caches: list[torch.Tensor], src_slots: list[int], dst_slots: list[int]) -> None:
    """Copy the K and V rows of every layer from slots src_slots[i] to dst_slots[i] (slot = block id *
    block_size + offset; scale bytes of int8/fp8 rows travel with them). Sources must not be destinations."""
    if not src_slots:
        return
    assert len(src_slots) == len(dst_slots) and not set(src_slots) & set(dst_slots)
    device = kv_caches[0].device
    src = torch.tensor(src_slots, dtype=torch.int64, device=device)
    dst = torch.tensor(dst_slots, dtype=torch.int64, device=device)
    for cache in {id(c): c for c in kv_caches if c.numel()}.values():  # a hybrid cache's layers share tensors:
        # copy each once (a pipeline stage's other layers hold nothing)
        flat = cache.view(2, cache.shape[1] * cache.shape[2], *cache.shape[3:])
        flat[:, dst] = flat[:, src]
