"""Moving KV blocks between the paged K/V tensors and KVPayload bytes (raw bytes: any cache dtype, scales included)."""

from __future__ import annotations

import torch

from loom.kv_transfer.base import KVLayout, KVPayload


def kv_layout(kv_caches: list[torch.Tensor], block_size: int, head_dim: int, model: str) -> KVLayout:
    """The layout of caches shaped [2, num_blocks, block_size, num_kv_heads, row] per layer."""
    first = kv_caches[0]
    return KVLayout(num_layers=len(kv_caches), num_kv_heads=int(first.shape[3]), head_dim=head_dim,
                    row_bytes=int(first.shape[4]) * first.element_size(), block_size=block_size,
                    kv_dtype=str(first.dtype), model=model)


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> bytearray:
    """The K and V of `block_ids` in every layer, as KVPayload bytes: layer-major
    [num_layers, 2, len(block_ids), block_size, num_kv_heads, row bytes], copied to host memory."""
    device = kv_caches[0].device
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    rows = torch.stack([c.view(torch.uint8).index_select(1, ids) for c in kv_caches]).cpu()
    out = bytearray(rows.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(rows.reshape(-1))
    return out


def write_blocks(kv_caches: list[torch.Tensor], payload: KVPayload, src_indices: list[int],
                 dst_block_ids: list[int]) -> None:
    """Copy the payload's blocks src_indices[i] into block dst_block_ids[i] of every layer.

    The payload's layout must have been checked against these caches (KVLayout.check_matches); the sizes are
    asserted again here.
    """
    if not src_indices:
        return
    first = kv_caches[0]
    shape = (len(kv_caches), 2, payload.num_blocks, *first.view(torch.uint8).shape[2:])
    data = torch.frombuffer(payload.data, dtype=torch.uint8)
    assert data.numel() == torch.Size(shape).numel(), "payload size does not match the KV cache layout"
    blocks = data.view(shape)
    src = torch.tensor(src_indices, dtype=torch.int64)
    dst = torch.tensor(dst_block_ids, dtype=torch.int64, device=first.device)
    for layer, cache in enumerate(kv_caches):
        cache.view(torch.uint8).index_copy_(1, dst, blocks[layer].index_select(1, src).to(first.device))


__all__ = ["kv_layout", "read_blocks", "write_blocks"]
