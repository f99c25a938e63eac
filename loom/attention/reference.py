"""Reference paged attention in plain torch: one request at a time, correctness over speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.attention.backend import gather_kv, write_kv_cache
from loom.attention.metadata import AttentionMetadata


def causal_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean mask [query_len, seq_len], True = may attend, for queries that are the last
    query_len positions of a seq_len context (bottom-right aligned causal mask).

    With a sliding window w a query at position p sees keys at positions p - w + 1 .. p (Mistral,
    arXiv:2310.06825). Returns None when every query sees every key (a single decode token, no window).
    """
    if query_len == 1 and (sliding_window is None or sliding_window >= seq_len):
        return None
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    return allowed


def attend_per_request(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention in plain torch, one request at a time: writes this step's K/V into kv_cache, gathers each
    request's context and attends with SDPA; with `softcap`, the scores are soft-capped before the softmax,
    s -> cap * tanh(s / cap) (Gemma 2, arXiv:2408.00118; the fused kernels have no cap), softmax in float32.
    GQA/MQA (arXiv:2305.13245): query head h reads KV head h // (num_heads // num_kv_heads).

    Shapes: query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim]; returns
    [num_tokens, num_heads, head_dim], query's dtype.
    """
    write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
    output = torch.empty_like(query)
    group = query.shape[1] // kv_cache.shape[-2]  # kv_cache [2, blocks, block_size, H_kv, row]
    starts = attn_metadata.query_start_loc_cpu
    for i in range(attn_metadata.num_reqs):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        seq_len = attn_metadata.seq_lens_cpu[i]
        k, v = gather_kv(kv_cache, attn_metadata.block_tables[i], seq_len, attn_metadata.block_size, query.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q = query[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        k = k.transpose(0, 1).to(query.dtype)  # [num_heads, seq_len, head_dim]
        v = v.transpose(0, 1).to(query.dtype)
        mask = causal_mask(end - start, seq_len, sliding_window, query.device)
        if softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            scores = torch.tanh(torch.matmul(q, k.transpose(1, 2)) * scale / softcap) * softcap
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), v)
        output[start:end] = out.transpose(0, 1)
    return output


class TorchReferenceBackend:
    """Paged attention with torch's scaled_dot_product_attention, one request per call (attend_per_request)."""

    name: str = "torch_reference"

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
        """See AttentionBackend.forward. Shapes: query [num_tokens, num_heads, head_dim],
        key/value [num_tokens, num_kv_heads, head_dim]; returns [num_tokens, num_heads, head_dim]."""
        return attend_per_request(query, key, value, kv_cache, attn_metadata, scale, sliding_window)
