"""Attention received by each KV block, for the KV retention policies that rank blocks by it (H2O, SnapKV).

The fused attention kernels return outputs, not weights, so the weights of the scored query rows are computed
again here, in float32, from the layer's queries and the cached keys: for request i with scored rows R (the last
rows of its query chunk), score[b] = sum over layers, query heads, rows r in R, keys k in block b of
softmax_k(q_r . k * scale) under the causal mask (H2O, Zhang et al. 2023, arXiv:2306.14048: accumulated attention;
SnapKV, Li et al. 2024, arXiv:2404.14469: the observation window's attention). The cost is that of attention
itself for the scored rows (a decode row: one more pass over the request's keys per layer; H2O's prefill: every
ROW_STRIDE-th row of the causal score matrix, in chunks of `ROW_CHUNK` rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.attention.backend import gather_kv
from loom.attention.metadata import AttentionMetadata

ROW_CHUNK = 256  # query rows scored at once (bounds the [rows, heads, keys] float32 buffer)
# H2O over a prompt chunk scores every ROW_STRIDE-th query row (ending at the last): the accumulated attention of
# the whole chunk estimated from a uniform sample of its rows, at 1 / ROW_STRIDE of the full score matrix's cost
ROW_STRIDE = 8


@dataclass(slots=True)
class _Scored:
    request_id: str
    req_index: int  # row of the request in the step's AttentionMetadata
    num_rows: int  # its last num_rows query rows are scored; -1 = every ROW_STRIDE-th row, ending at the last
    reduce: str  # over query heads and layers: "sum" (accumulated attention) or "max" (the head that wants it most)


@dataclass(slots=True)
class KVScoreCollector:
    """Accumulates, over the layers of one step, the attention each scored request's KV blocks receive."""

    requests: list[_Scored] = field(default_factory=list)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)  # request_id -> [num_table_blocks] float32

    def add(self, request_id: str, req_index: int, num_rows: int, reduce: str = "sum") -> None:
        """Score the last `num_rows` (>= 1) query rows of request `req_index` of the step; -1 = a sample of all
        its rows, every ROW_STRIDE-th one ending at the last (H2O's accumulated attention, estimated). reduce: how
        the per-head block scores combine over query heads and layers, "sum" or "max" (SnapKV selects per head: a
        block one head attends to strongly counts as much as that head's attention, not diluted by the others).

        Raises:
            ValueError: an unknown reduce.
        """
        if reduce not in ("sum", "max"):
            raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
        self.requests.append(_Scored(request_id, req_index, num_rows, reduce))

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                scale: float) -> None:
        """Add one layer's attention weights (called after the layer wrote this step's K/V).

        Args:
            query: [num_tokens, num_heads, head_dim] the layer's queries (rotary applied).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, row] the layer's cache.
            attn_metadata: the step.
            scale: the layer's softmax scale.
        """
        bs = attn_metadata.block_size
        starts = attn_metadata.query_start_loc_cpu
        num_heads = query.shape[1]
        for item in self.requests:
            i = item.req_index
            seq_len = attn_metadata.seq_lens_cpu[i]
            begin, end = starts[i], starts[i + 1]
            if item.num_rows < 0:
                rows = list(range(end - 1, begin - 1, -ROW_STRIDE))[::-1]
            else:
                rows = list(range(max(begin, end - item.num_rows), end))
            key, _ = gather_kv(kv_cache, attn_metadata.block_tables[i], seq_len, bs, torch.float32)
            num_kv_heads = key.shape[1]
            group = num_heads // num_kv_heads
            keys_t = key.float().permute(1, 2, 0)  # [H_kv, d, seq_len]
            k_pos = torch.arange(seq_len, device=query.device)
            total = torch.zeros(num_heads, seq_len, dtype=torch.float32, device=query.device)
            for c in range(0, len(rows), ROW_CHUNK):
                chunk = torch.tensor(rows[c : c + ROW_CHUNK], dtype=torch.int64, device=query.device)
                r = chunk.numel()
                # [r, H, d] -> [H_kv, r * G, d]: a KV head's group of query heads as rows of one matmul
                q = query.index_select(0, chunk).float().view(r, num_kv_heads, group, -1).transpose(0, 1).reshape(
                    num_kv_heads, r * group, -1)
                logits = torch.bmm(q, keys_t).mul_(scale).view(num_kv_heads, r, group, seq_len)
                q_pos = chunk - end + seq_len  # the row at flattened index t sits at position seq_len - (end - t)
                future = k_pos[None, :] > q_pos[:, None]  # [r, seq_len]
                if bool(future.any()):
                    logits.masked_fill_(future[None, :, None, :], float("-inf"))
                total += torch.softmax(logits, dim=-1).sum(1).view(num_heads, seq_len)  # [H, seq_len], head-major
            num_blocks = -(-seq_len // bs)
            per_head = torch.nn.functional.pad(total, (0, num_blocks * bs - seq_len)).view(
                num_heads, num_blocks, bs).sum(2)  # [H, num_blocks]
            acc = self.scores.get(item.request_id)
            if item.reduce == "max":
                per_block = per_head.amax(0)
                self.scores[item.request_id] = per_block if acc is None else torch.maximum(acc, per_block)
            else:
                per_block = per_head.sum(0)
                self.scores[item.request_id] = per_block if acc is None else acc + per_block

    def result(self) -> dict[str, list[float]]:
        """request_id -> attention received by each entry of its block table, summed over the layers seen."""
        return {rid: s.tolist() for rid, s in self.scores.items()}


__all__ = ["KVScoreCollector", "ROW_CHUNK", "ROW_STRIDE"]
