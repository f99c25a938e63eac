"""Paged attention for CPUs (and any device torch runs on): decode tokens of the whole batch in one call.

Decode requests (one query token) are served together: their blocks are gathered into a padded
[num_reqs, max_ctx, H_kv, d] tensor and one masked scaled_dot_product_attention runs over the batch.
Grouped-query attention (arXiv:2305.13245) is a reshape: the G = H / H_kv query heads that share a KV
head become G query rows of that head, so K/V are never repeated. Prefill chunks run one SDPA per
request, with K/V broadcast over the group by `expand` (a view, not a copy); where loom's C decode kernel serves
the query, a chunk's rows of up to PER_ROW_MAX_KEYS keys of context run through it instead, each as a decode row.

The per-step work that does not depend on the layer (masks, block ids, which rows decode) is planned
once, on the first layer's call, and reused by the others.

With block-sparse decode attention (loom/attention/sparse.py, Quest arXiv:2406.10774) each layer's decode rows
read only the blocks chosen for their query: the same kernels run on a shorter block table per request.
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.attention.backend import gather_kv, gather_kv_padded, write_kv_cache
from loom.attention.metadata import AttentionMetadata
from loom.attention.reference import causal_mask
from loom.attention.sparse import BlockSparseSelector, SparseAttentionConfig
from loom.kernels.registry import paged_decode_kernels


# Prefill rows whose context is at most this many keys run as decode rows through loom's C kernel where it serves
# the query (not on the oracle path): per row, its keys in ranges fixed by its own length, so the row's bits do not
# depend on its chunk, batch or a prefix-cache hit; SDPA's blocking depends on the chunk's shape. Measured for one
# prompt on SmolLM2's shapes (9 heads, 3 KV heads, d 64, float16 cache, 2 Zen 4 threads), per layer: 64 / 512 / 1024
# / 2048 / 4096 tokens 0.07 / 3.1 / 12.3 / 51 / 204 ms, against SDPA's 0.11 / 4.0 / 11.5 / 41 / 145 ms
# (benchmarks/NOTES.md, "One summation order at every batch").
PER_ROW_MAX_KEYS = 2048

# Decode attention over at most this many gathered K/V rows (requests x padded context) runs on one thread:
# below it the gather + SDPA are slower on two threads than on one (1 request x 528 tokens, SmolLM2 shapes,
# 2-core Zen 4: 103 us on 1 thread vs 122 us on 2; equal at 2048 tokens; 4 x 528: 404 vs 299 us).
_SERIAL_MAX_TOKENS = 2048


@dataclass(slots=True)
class _DecodePlan:
    """The batched decode of one step."""

    token_rows: torch.Tensor | None  # [num_decode] int64 rows of the flattened batch; None = every row, in order
    block_ids: torch.Tensor  # [num_decode, max_blocks] int64 block ids (padding repeats a valid id)
    seq_lens: torch.Tensor  # [num_decode] int64 keys per request, the new token's included
    block_size: int  # tokens per block
    sliding_window: int | None  # tokens each query may look back, itself included; None = unlimited
    dtype: torch.dtype  # the query dtype, the mask's
    _mask: torch.Tensor | None = None

    @property
    def serial(self) -> bool:
        """Run the gather + SDPA on one intra-op thread (small contexts; see _SERIAL_MAX_TOKENS)."""
        return self.block_ids.shape[0] * self.block_ids.shape[1] * self.block_size < _SERIAL_MAX_TOKENS

    @property
    def mask(self) -> torch.Tensor:
        """[num_decode, 1, 1, max_blocks * block_size] in the query dtype: 0 = may attend, -inf = masked. Additive,
        because SDPA turns a bool mask into this with two extra ops in every layer (measured 141 -> 81 us/call).
        Built on first use: the C kernels and the C decode step need none (its arange, compare and fill were
        ~0.1 ms of a 10 ms single-stream token)."""
        if self._mask is None:
            key_pos = torch.arange(self.block_ids.shape[1] * self.block_size, device=self.block_ids.device)[None, :]
            allowed = key_pos < self.seq_lens[:, None]
            if self.sliding_window is not None:
                allowed &= key_pos >= (self.seq_lens[:, None] - self.sliding_window)
            additive = torch.zeros(allowed.shape, dtype=self.dtype, device=self.block_ids.device)
            self._mask = additive.masked_fill_(~allowed, float("-inf"))[:, None, None, :]
        return self._mask


@dataclass(slots=True)
class _PrefillPlan:
    """One request whose query has more than one token this step."""

    req_index: int  # row of the request in attn_metadata
    start: int  # first token row of the request in the flattened batch
    end: int  # one past its last token row
    seq_len: int  # tokens of context after this step
    mask: torch.Tensor | None  # [end - start, seq_len] bool, True = may attend; None = plain causal (is_causal)


@dataclass(slots=True)
class _StepPlan:
    """Everything about one step's attention that is the same in every layer."""

    attn_metadata: AttentionMetadata  # the step this plan was made for (compared by identity)
    sliding_window: int | None  # tokens, the window the masks were made for
    dtype: torch.dtype  # query dtype the decode mask was made in
    decode: _DecodePlan | None  # None = no decode tokens this step
    prefills: list[_PrefillPlan]  # requests with multi-token queries, batch order
    _has_pad_slots: bool | None = None

    @property
    def has_pad_slots(self) -> bool:
        """Some slot_mapping entry is PAD_SLOT_ID: checked once per step, when first read (the one-call C decode
        step never reads it: a comparison, a reduction and a device sync it need not pay)."""
        if self._has_pad_slots is None:
            self._has_pad_slots = bool((self.attn_metadata.slot_mapping < 0).any())
        return self._has_pad_slots


def plan_step(
    attn_metadata: AttentionMetadata, sliding_window: int | None, dtype: torch.dtype = torch.float32
) -> _StepPlan:
    """Split a step into one batched decode and per-request prefills, and build their masks.

    Args:
        attn_metadata: the step (python lists give the query and context lengths; one device sync when
            has_pad_slots is first read).
        sliding_window: tokens each query may look back, query included; None = unlimited.
        dtype: the query dtype, in which the additive decode mask is built.
    """
    starts = attn_metadata.query_start_loc_cpu
    seq_lens = attn_metadata.seq_lens_cpu
    decode_reqs: list[int] = []
    prefills: list[_PrefillPlan] = []
    device = attn_metadata.block_tables.device
    for i in range(attn_metadata.num_reqs):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode_reqs.append(i)
        elif q_len > 1:
            mask = None
            if sliding_window is not None or q_len != seq_lens[i]:
                mask = causal_mask(q_len, seq_lens[i], sliding_window, device)
            prefills.append(_PrefillPlan(i, starts[i], starts[i + 1], seq_lens[i], mask))
    decode = _plan_decode(attn_metadata, decode_reqs, sliding_window, dtype) if decode_reqs else None
    return _StepPlan(attn_metadata, sliding_window, dtype, decode, prefills)


def _plan_decode(
    attn_metadata: AttentionMetadata, decode_reqs: list[int], sliding_window: int | None, dtype: torch.dtype
) -> _DecodePlan:
    """Block ids and additive key masks (dtype) of the decode requests (indices into attn_metadata's requests)."""
    block_size = attn_metadata.block_size
    seq_lens_cpu = attn_metadata.seq_lens_cpu
    max_blocks = -(-max(seq_lens_cpu[i] for i in decode_reqs) // block_size)
    device = attn_metadata.block_tables.device
    every_row = len(decode_reqs) == attn_metadata.num_reqs == attn_metadata.num_tokens
    if every_row:
        block_ids = attn_metadata.block_tables[:, :max_blocks].long()
        seq_lens = attn_metadata.seq_lens.long()
        token_rows = None
    else:
        req_index = torch.tensor(decode_reqs, dtype=torch.int64, device=device)
        block_ids = attn_metadata.block_tables.index_select(0, req_index)[:, :max_blocks].long()
        seq_lens = attn_metadata.seq_lens.index_select(0, req_index).long()
        token_rows = torch.tensor(
            [attn_metadata.query_start_loc_cpu[i] for i in decode_reqs], dtype=torch.int64, device=device
        )
    return _decode_plan(token_rows, block_ids, seq_lens, block_size, sliding_window, dtype)


def _decode_plan(token_rows: torch.Tensor | None, block_ids: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 sliding_window: int | None, dtype: torch.dtype) -> _DecodePlan:
    """The decode plan over block_ids [num_decode, max_blocks] int64 and seq_lens [num_decode] int64 (its additive
    key mask in dtype made when first read)."""
    return _DecodePlan(token_rows, block_ids, seq_lens, block_size, sliding_window, dtype)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One-token attention of a batch over padded contexts, GQA by reshape.

    Args:
        query: [num_reqs, num_heads, head_dim].
        key, value: [num_reqs, max_ctx, num_kv_heads, head_dim], dtype of query.
        mask: [num_reqs, 1, 1, max_ctx] bool (True = may attend) or additive in query's dtype (0 or -inf);
            at least one attended key per request.
        scale: softmax scale.

    Returns:
        [num_reqs, num_heads, head_dim], dtype of query.
    """
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    out = F.scaled_dot_product_attention(
        query.view(num_reqs, num_kv_heads, group, head_dim),  # the group's heads act as query rows
        key.transpose(1, 2),  # [num_reqs, H_kv, max_ctx, d]
        value.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(num_reqs, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of one request's query chunk over its context, GQA by broadcasting K/V (no copy).

    Args:
        query: [q_len, num_heads, head_dim].
        key, value: [seq_len, num_kv_heads, head_dim], dtype of query.
        mask: [q_len, seq_len] bool, True = may attend; None = causal with q_len == seq_len.
        scale: softmax scale.

    Returns:
        [q_len, num_heads, head_dim], dtype of query.
    """
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [H_kv, G, q_len, d]
    k = key.transpose(0, 1)[:, None].expand(num_kv_heads, group, seq_len, head_dim)
    v = value.transpose(0, 1)[:, None].expand(num_kv_heads, group, seq_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


class CpuPagedBackend:
    """Paged attention with one batched SDPA for all decode tokens and one SDPA per prefill chunk.

    K/V are written with `write_kv_cache` and read with `gather_kv_padded` / `gather_kv`, so quantized
    caches work unchanged. Keeps the plan of the current step (one instance serves every layer).
    With `sparse`, decode rows read only their selected blocks (loom/attention/sparse.py).
    """

    name: str = "cpu_paged"

    def __init__(self, float32_kernels: bool = False, sparse: SparseAttentionConfig | None = None) -> None:
        """float32_kernels: let loom's C decode kernel serve float32 caches too (off on the oracle path,
        quantization "none", which keeps SDPA; bfloat16 caches always use a kernel when one builds).
        sparse: block-sparse decode attention (Quest top-k blocks); None = every decode query reads every block."""
        # plans of the step being run, one per (metadata, sliding window): Gemma's layers alternate two windows,
        # and a hybrid KV cache gives each group of layers its own metadata; reused across layers
        self._plans: dict[tuple[int, int | None], _StepPlan] = {}
        self._plans_step: list[int] | None = None  # the step they are for (its query_start_loc_cpu, held)
        # loom's C decode kernels for CPU caches, best first (AVX512-BF16, then AVX2 / portable); empty where none
        # builds (LOOM_CPU_KERNELS=0, no compiler): then SDPA over gathered blocks serves every decode
        self.decode_kernels: list[Any] = paged_decode_kernels()
        self.float32_kernels = float32_kernels
        # key summaries and top-k block selection of block-sparse decode; None = dense
        self.sparse: BlockSparseSelector | None = None if sparse is None else BlockSparseSelector(sparse)

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
        key/value [num_tokens, num_kv_heads, head_dim]; returns [num_tokens, num_heads, head_dim].

        Raises:
            ValueError: block-sparse decode on a sliding-window layer (not supported).
        """
        plan = self._step_plan(attn_metadata, sliding_window, query.dtype)
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, plan.has_pad_slots)
        if self.sparse is not None:
            if sliding_window is not None:
                raise ValueError("sparse attention (topk-blocks) does not support sliding-window layers")
            self.sparse.record_keys(kv_cache, key, attn_metadata.slot_mapping, plan.has_pad_slots)
        if plan.decode is not None and plan.decode.token_rows is None:
            return self._decode(query, kv_cache, plan.decode, scale, sliding_window)  # the common pure-decode step
        output = torch.empty_like(query)
        if plan.decode is not None:
            rows = plan.decode.token_rows
            assert rows is not None
            decoded = self._decode(query.index_select(0, rows), kv_cache, plan.decode, scale, sliding_window)
            output.index_copy_(0, rows, decoded)
        kernel = self._decode_kernel(query, kv_cache) if plan.prefills else None
        for item in plan.prefills:
            start, q_len = item.start, item.end - item.start
            mask = item.mask
            if kernel is not None:
                # rows whose context is at most PER_ROW_MAX_KEYS keys: each as a decode row over its own causal
                # prefix, by the decode kernel (key ranges fixed by the row's length), so that a row's result is
                # the same bits fresh, after a prefix-cache hit, in another chunk, or as a speculative verify row
                first_pos = item.seq_len - q_len  # position of the chunk's first row
                rows = max(0, min(q_len, PER_ROW_MAX_KEYS - first_pos))
                if rows:
                    table = attn_metadata.block_tables[item.req_index : item.req_index + 1].long().expand(rows, -1)
                    lens = torch.arange(first_pos + 1, first_pos + rows + 1, dtype=torch.int64)
                    output[start : start + rows] = kernel(query[start : start + rows], kv_cache, table, lens, scale,
                                                          sliding_window, lengths_checked=True)
                if rows == q_len:
                    continue
                start, q_len = start + rows, q_len - rows
                mask = causal_mask(q_len, item.seq_len, sliding_window, query.device)
            k, v = gather_kv(
                kv_cache, attn_metadata.block_tables[item.req_index], item.seq_len, attn_metadata.block_size,
                out_dtype=query.dtype,
            )
            output[start : start + q_len] = prefill_attention(
                query[start : start + q_len], k.to(query.dtype), v.to(query.dtype), mask, scale
            )
        return output

    def _step_plan(
        self, attn_metadata: AttentionMetadata, sliding_window: int | None, dtype: torch.dtype
    ) -> _StepPlan:
        # a new step (a hybrid KV cache's per-group metadata share their step's query_start_loc_cpu list): drop the
        # last step's plans, so their masks are not kept alive
        step = attn_metadata.query_start_loc_cpu
        if step is not self._plans_step:
            self._plans.clear()
            self._plans_step = step
        key = (id(attn_metadata), sliding_window)  # a plan holds its metadata, so the id is not reused meanwhile
        plan = self._plans.get(key)
        if plan is None or plan.attn_metadata is not attn_metadata or plan.dtype != dtype:
            plan = plan_step(attn_metadata, sliding_window, dtype)
            self._plans[key] = plan
        return plan

    @property
    def decode_kernel(self) -> Any:
        """The first decode kernel, or None (tests and the start-up report read it)."""
        return self.decode_kernels[0] if self.decode_kernels else None

    def _decode_kernel(self, query: torch.Tensor, kv_cache: torch.Tensor) -> Any:
        if query.dtype == torch.float32 and not self.float32_kernels:
            return None
        return next((k for k in self.decode_kernels if k.supports(query, kv_cache)), None)

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """query [num_decode, num_heads, head_dim] -> [num_decode, num_heads, head_dim], on one intra-op
        thread when plan.serial (restored afterwards).

        A float32 query (off the oracle path) or a bfloat16 one over a float32, bfloat16, float16 or int8 cache
        goes to loom's C kernel, which reads each request's blocks in place (no padded gather, no mask); anything
        else (fp8 caches, the oracle path) gathers and runs SDPA. With block-sparse decode, both run on the
        blocks selected for this layer's queries."""
        kernel = self._decode_kernel(query, kv_cache)
        if self.sparse is not None:
            selected = self.sparse.select(query, kv_cache, plan.block_ids, plan.seq_lens)
            if selected is not None:  # (the mask, made only if the gather path reads it, over the selected blocks)
                plan = _decode_plan(plan.token_rows, *selected, kv_cache.shape[2], sliding_window, query.dtype)
        if kernel is not None:
            # decode requests have their new token's key written, so every seq_len >= 1: no check per layer.
            # The kernel splits long contexts over threads itself, so it keeps every thread.
            return kernel(query, kv_cache, plan.block_ids, plan.seq_lens, scale, sliding_window,
                          lengths_checked=True)
        threads = torch.get_num_threads()
        if not plan.serial or threads == 1:
            return _gather_and_attend(query, kv_cache, plan, scale)
        torch.set_num_threads(1)  # ~0.1 us each way
        try:
            return _gather_and_attend(query, kv_cache, plan, scale)
        finally:
            torch.set_num_threads(threads)


def _gather_and_attend(query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float) -> torch.Tensor:
    """Batched decode attention of query [num_decode, num_heads, head_dim] over the plan's blocks."""
    key, value = gather_kv_padded(kv_cache, plan.block_ids, out_dtype=query.dtype)
    return decode_attention(query, key.to(query.dtype), value.to(query.dtype), plan.mask, scale)
