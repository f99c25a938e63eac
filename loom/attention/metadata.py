"""AttentionMetadata: where each token of a flattened batch lives in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAD_SLOT_ID = -1  # slot_mapping value of a token whose K/V must not be written


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of a batch of requests whose tokens are concatenated without padding.

    Request i owns query tokens query_start_loc[i]:query_start_loc[i+1]; they are the last
    (query_start_loc[i+1] - query_start_loc[i]) positions of a context of seq_lens[i] tokens, whose
    K/V live in the blocks block_tables[i, :ceil(seq_lens[i] / block_size)].
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset; PAD_SLOT_ID = skip
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length of each request after this step
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32, padded with 0
    query_start_loc_cpu: list[int]  # [num_reqs + 1] python copy of query_start_loc (no device sync)
    seq_lens_cpu: list[int]  # [num_reqs] python copy of seq_lens
    num_reqs: int  # requests in the batch
    max_query_len: int  # tokens, longest query of the batch
    block_size: int  # tokens per KV block
    # KV retention: a loom.attention.kv_scores.KVScoreCollector the attention layers feed with their weights this step
    # (H2O / SnapKV rank blocks by them); None = nothing to score
    kv_scores: Any = None
    # context parallelism: a loom.distributed.context_parallel.ContextParallelStep when this rank computes only its
    # share of a prefill step (this metadata then describes its own rows); the attention layers exchange K/V through it
    context_parallel: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the flattened batch (= query_start_loc_cpu[-1])."""
        return self.query_start_loc_cpu[-1]

    def check_invariants(self) -> None:
        """Assert the internal consistency of the fields (cheap; python lists only, plus shapes)."""
        assert len(self.query_start_loc_cpu) == self.num_reqs + 1
        assert len(self.seq_lens_cpu) == self.num_reqs
        assert self.block_tables.shape[0] == self.num_reqs
        assert self.slot_mapping.shape[0] == self.num_tokens
        max_blocks = self.block_tables.shape[1]
        for i in range(self.num_reqs):
            q_len = self.query_start_loc_cpu[i + 1] - self.query_start_loc_cpu[i]
            assert 0 <= q_len <= self.seq_lens_cpu[i]
            assert q_len <= self.max_query_len
            assert -(-self.seq_lens_cpu[i] // self.block_size) <= max_blocks


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build AttentionMetadata from python lists (tests, simple runners).

    Args:
        query_lens: [num_reqs] tokens computed this step per request.
        seq_lens: [num_reqs] context length per request after this step (>= query_lens[i]).
        block_tables: [num_reqs][*] block ids of each request, covering at least seq_lens[i] tokens.
        block_size: tokens per block.
        device: where the tensors go.

    Raises:
        ValueError: lengths disagree, or a block table is too short for its seq_len.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    query_start_loc = [0]
    slots: list[int] = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if q_len > seq_len:
            raise ValueError(f"query_lens entry {q_len} exceeds its seq_lens entry {seq_len}")
        if len(table) * block_size < seq_len:
            raise ValueError(f"block_tables entry of {len(table)} blocks cannot hold {seq_len} tokens")
        query_start_loc.append(query_start_loc[-1] + q_len)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(block_tables), max_blocks),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
        num_reqs=len(query_lens),
        max_query_len=max(query_lens, default=0),
        block_size=block_size,
    )
