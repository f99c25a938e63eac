"""The attention layer of a decoder: reshapes to heads and hands off to a paged attention backend."""

from __future__ import annotations

import torch
from torch import nn

from loom.attention.backend import AttentionBackend
from loom.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Stores this step's K/V in the layer's paged cache and attends over each request's context."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        sliding_window: int | None,
        scale: float | None = None,
        logit_softcapping: float | None = None,
    ) -> None:
        """scale: the softmax scale, None = head_dim ** -0.5; logit_softcapping: scores -> cap * tanh(s / cap)
        before the softmax (Gemma 2), run by loom.attention.reference.attend_per_request (the backends' fused
        kernels have no cap)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_softcapping = logit_softcapping
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
        kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] -> [num_tokens, num_heads * head_dim]."""
        def attend() -> torch.Tensor:
            if self.logit_softcapping is not None:
                from loom.attention.reference import attend_per_request

                return attend_per_request(query, key, value, kv_cache, attn_metadata, self.scale, self.sliding_window,
                                          self.logit_softcapping)
            return self.backend.forward(query, key, value, kv_cache, attn_metadata, self.scale, self.sliding_window)

        cp_step = attn_metadata.context_parallel
        # context parallel: the other ranks' K/V of this chunk reach the cache first (a ring), then the same attention
        out = attend() if cp_step is None else cp_step.attend(key, value, kv_cache, attend)
        if attn_metadata.kv_scores is not None:  # KV retention ranks blocks by the attention they receive
            attn_metadata.kv_scores.observe(query, kv_cache, attn_metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
