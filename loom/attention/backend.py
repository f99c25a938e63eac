"""AttentionBackend Protocol, the shared K/V cache write, and the backend registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from loom.attention.metadata import AttentionMetadata


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
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] of this layer (updated in place).
            attn_metadata: positions of the tokens in the cache.
            scale: softmax scale, usually head_dim ** -0.5.
            sliding_window: tokens each query may look back (query included); None = unlimited.

        Returns:
            [num_tokens, num_heads, head_dim], dtype of query.
        """
        ...


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value rows into the paged cache at slot_mapping, skipping PAD_SLOT_ID (-1) slots.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset, or -1.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, H_kv, d]
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
        return
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, key[valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[valid].to(kv_cache.dtype))


def _make_torch_reference() -> AttentionBackend:
    from loom.attention.reference import TorchReferenceBackend

    return TorchReferenceBackend()


# Read-only registry: backend name -> factory. New backends add an entry here.
ATTENTION_BACKENDS: Mapping[str, Callable[[], AttentionBackend]] = MappingProxyType(
    {"torch_reference": _make_torch_reference}
)


def get_attention_backend(name: str = "torch_reference") -> AttentionBackend:
    """Instantiate the attention backend registered under `name`.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    factory = ATTENTION_BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"attention backend {name!r} is unknown; registered: {sorted(ATTENTION_BACKENDS)}")
    return factory()
