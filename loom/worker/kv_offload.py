"""The host KV tier's tensors and the block copies between it and the device cache.

Bookkeeping (which slot holds what) lives in loom/core/offload.py; this module only moves bytes. Host
blocks have the device blocks' exact layout and dtype, so quantized rows travel with their scales.
On a CUDA machine the host tensors are pinned so copies can overlap; on a CPU machine both tiers are
ordinary memory and the tier simply extends the cache.
"""

from __future__ import annotations

import torch

from loom.model.arch import ModelArchConfig
from loom.worker.kv_cache import kv_cache_bytes_per_token


def num_host_blocks_for_budget(arch: ModelArchConfig, kv_dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    """Whole KV blocks of block_size tokens (all layers, K and V, scales included) in budget_bytes; 0 for 0."""
    return budget_bytes // (kv_cache_bytes_per_token(arch, kv_dtype) * block_size)


class HostKVCache:
    """num_host_blocks blocks per layer in host memory, shaped like the device cache."""

    def __init__(self, device_caches: list[torch.Tensor], num_host_blocks: int) -> None:
        """Args:
        device_caches: per layer [2, num_blocks, block_size, num_kv_heads, row] (layout and dtype copied).
        num_host_blocks: host blocks per layer (>= 1).

        Raises:
            ValueError: num_host_blocks < 1.
        """
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        pin = device_caches[0].is_cuda
        self.num_host_blocks = num_host_blocks  # capacity in blocks
        self.host_caches: list[torch.Tensor] = [  # per layer [2, num_host_blocks, block_size, H_kv, row]
            torch.zeros((2, num_host_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in device_caches
        ]

    def offload(self, device_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host slots. pairs: (device block id, host slot)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device_caches[0].device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for device, host in zip(device_caches, self.host_caches, strict=True):
            _copy_blocks(device, src, host, dst)

    def restore(self, device_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks. pairs: (host slot, device block id)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=device_caches[0].device)
        for device, host in zip(device_caches, self.host_caches, strict=True):
            _copy_blocks(host, src, device, dst)


def _copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for caches [2, blocks, ...]; raw bytes, so any cache dtype works."""
    rows = src.view(torch.uint8)[:, src_ids].to(dst.device, non_blocking=True)
    dst.view(torch.uint8).index_copy_(1, dst_ids, rows)


__all__ = ["HostKVCache", "num_host_blocks_for_budget"]
