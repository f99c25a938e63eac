"""Block-sparse decode attention: each decode query reads only the KV blocks that can matter to it.

The method is Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774). For every KV block and KV head the cache keeps a summary of the block's keys:
the channel-wise minimum m and maximum M over its rows. For a query q, no key k of the block can score more than

    bound(q, block) = sum_c max(q_c * m_c, q_c * M_c)   (>= q . k for every k with m <= k <= M),

which is also relu(q) . M + min(q, 0) . m, i.e. two small matmuls. A decode query then reads its request's
first `sink_blocks` blocks (attention sinks), its last `recent_blocks` blocks (the partial block that holds the
query's own key among them) and the `topk` other blocks of the largest bound; everything else is skipped.

Differences from the paper (the price of paging, one block table per request):
  * Quest selects per query head. loom's decode kernels take one block table per request and layer, so the
    selection is shared by all heads: a block's score is the max over the query heads of their bounds (a block
    that one head would rank first ranks high). With H query heads this reads k blocks where Quest reads up to
    H x k different ones (k per head), so a head may miss a block only it needed.
  * The selected blocks are read in ascending position order with the existing kernels, the partial last block
    counting only its filled rows. Rotary is applied before caching, so a query may attend any subset of its past
    keys; when sink + recent + topk covers every block of every decode request, the table is the dense one and
    the output is bit-identical to dense attention.
  * Prefill rows (and speculative verification, several query tokens per request) stay dense.

Summaries are kept per layer as one bfloat16 tensor [num_kv_heads, num_blocks, 2, head_dim] (max, then min),
rounded outward (the max up, the min down, so they still bound every key), i.e. 2 x 2 B x num_kv_heads x head_dim
per block and layer (768 B for SmolLM2-135M's 3 x 64, next to 12 KiB of float16 K/V for a 16-token block: +6.25 %;
11.8 MB at 8k tokens over its 30 layers), allocated on top of the KV cache budget. Every decode query reads all of
its request's summaries (1/16 of its K/V bytes in float16), so their width is part of every sparse step's bytes;
in float32 they were 1/8, and a step at 8k read ~3 ms more of them on one thread (benchmarks/NOTES.md). They are updated when K is written through the backend (a block
whose offset-0 row is written starts fresh; other rows widen the min/max), and a block whose rows arrive any other
way (host-tier restore, copy-on-write, pulled KV, tree-candidate copies) must be marked stale with
`BlockSparseSelector.invalidate` (the model runner does it through `stale_key_summaries`); a stale block's summary
is recomputed from the cache the next time a decode query needs it. For int8 / fp8 caches the write-time
summaries hold the keys before quantization (the bound holds within the quantization error); recomputed ones hold
the dequantized keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loom.attention.kv_quant import dequantize_rows, is_quantized, kv_head_dim


@dataclass(frozen=True, slots=True)
class SparseAttentionConfig:
    """Options of `--sparse-attention topk-blocks` (counts of KV blocks, not tokens).

    Raises:
        ValueError: topk < 1, sink_blocks < 0 or recent_blocks < 1 (the block of the query's own key is always
            read, so that every query attends at least one key).
    """

    topk: int = 64  # blocks chosen by their bound per decode query, besides the sink and recent ones
    sink_blocks: int = 1  # first blocks of the context, always read
    recent_blocks: int = 2  # last blocks of the context, always read (the partial one included)

    def __post_init__(self) -> None:
        for name, low in (("topk", 1), ("sink_blocks", 0), ("recent_blocks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"sparse attention {name} must be an integer >= {low}, got {value!r}")

    @property
    def max_blocks(self) -> int:
        """Most blocks one decode query reads (sink + recent + topk); requests with no more read every block."""
        return self.sink_blocks + self.recent_blocks + self.topk

    @classmethod
    def from_cache_config(cls, cache_config: Any) -> SparseAttentionConfig | None:
        """The options of a loom.config.CacheConfig; None when its sparse_attention is "none".

        Raises:
            ValueError: an unknown sparse_attention method, or options out of range.
        """
        method = cache_config.sparse_attention
        if method == "none":
            return None
        if method != "topk-blocks":
            raise ValueError(f"sparse_attention {method!r} is unknown; choose 'none' or 'topk-blocks'")
        return cls(topk=cache_config.sparse_attention_topk, sink_blocks=cache_config.sparse_attention_sink_blocks,
                   recent_blocks=cache_config.sparse_attention_recent_blocks)


def _bf16_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise ValueError(f"bfloat16 outward rounding takes float32 values, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    inexact = (bits & 0xFFFF) != 0  # truncation moves toward zero: away from zero is one bf16 step out
    away = inexact & ((bits >= 0) if up else (bits < 0))
    return ((bits >> 16) + away.to(torch.int32)).to(torch.int16).view(torch.bfloat16)


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded toward +inf to bfloat16: the least bfloat16 >= x (finite values past the largest
    bfloat16 become +inf; NaN is not handled). The C step rounds the same way (decode_step.c, bf16_up)."""
    return _bf16_outward(x, up=True)


def bf16_round_down(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded toward -inf to bfloat16: the greatest bfloat16 <= x (see bf16_round_up)."""
    return _bf16_outward(x, up=False)


def block_scores(query: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q . k over each block's keys, per query head.

    Args:
        query: [num_reqs, num_heads, head_dim] (any float dtype; computed in float32); num_heads is a multiple
            of num_kv_heads (grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads)).
        summaries: [num_reqs or 1, num_kv_heads, num_blocks, 2, head_dim] float32 or bfloat16: per KV head and
            block, the channel-wise max ([..., 0, :]) and min ([..., 1, :]) of the block's keys (or bounds of
            them; 1 = the same blocks for every request).

    Returns:
        [num_reqs, num_kv_heads, num_blocks, group] float32, group = num_heads // num_kv_heads (query head
        kv_head * group + g): sum_c max(q_c * min_c, q_c * max_c), unscaled (no softmax scale), >= q . k for
        every key of the block (up to float32 rounding of the sums).
    """
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads, rows = summaries.shape[1], summaries.shape[2]
    # max(q m, q M) = relu(q) . M + min(q, 0) . m (m <= M): per KV head, one matmul of the blocks' [M, m] rows
    # with the [relu(q), min(q, 0)] columns of its query heads
    q = query.float()
    positive = q.clamp(min=0)
    qq = torch.cat([positive, q - positive], dim=2)  # [R, H, 2d]
    qq = qq.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, 2 * head_dim).transpose(2, 3)
    return torch.matmul(summaries.reshape(-1, num_kv_heads, rows, 2 * head_dim).float(), qq)


def block_bounds(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """The bounds of block_scores from the min and max given apart, per query head.

    Args:
        query: [num_reqs, num_heads, head_dim].
        key_min, key_max: [num_reqs, num_blocks, num_kv_heads, head_dim] float32.

    Returns:
        [num_reqs, num_blocks, num_heads] float32 (see block_scores).
    """
    summaries = torch.stack([key_max, key_min], dim=3).transpose(1, 2).contiguous()  # [R, H_kv, blocks, 2, d]
    scores = block_scores(query, summaries)  # [R, H_kv, blocks, G]
    return scores.permute(0, 2, 1, 3).reshape(query.shape[0], -1, query.shape[1])


def select_blocks(
    scores: torch.Tensor, num_blocks: torch.Tensor, config: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which block positions each request reads: its sink and recent blocks plus the topk others of the
    highest score, in ascending position order.

    Args:
        scores: [num_reqs, max_blocks] float32 finite score of each block position (only the first
            num_blocks[i] of row i are real); ties are broken by torch.topk.
        num_blocks: [num_reqs] int64 blocks in each request's context (>= 1).
        config: the counts.

    Returns:
        positions: [num_reqs, width] int64 block positions in ascending order, width = min(max_blocks,
            config.max_blocks); a request with fewer picks is padded at the end with max_blocks - 1.
        count: [num_reqs] int64 positions picked per request: min(num_blocks, config.max_blocks).
    """
    return _select(scores, _position_bias(num_blocks, scores.shape[1], config), num_blocks, config), \
        num_blocks.clamp(max=config.max_blocks)


def _position_bias(num_blocks: torch.Tensor, max_blocks: int, config: SparseAttentionConfig) -> torch.Tensor:
    """[num_reqs, max_blocks] float32 added to the scores: +inf at the positions always read (sink, recent), -inf
    past the context, 0 elsewhere."""
    pos = torch.arange(max_blocks, device=num_blocks.device)[None, :]
    nb = num_blocks[:, None]
    forced = (pos < config.sink_blocks) | (pos >= nb - config.recent_blocks)
    bias = torch.zeros(forced.shape, device=num_blocks.device).masked_fill_(forced, float("inf"))
    return bias.masked_fill_(pos >= nb, float("-inf"))


def _select(scores: torch.Tensor, bias: torch.Tensor, num_blocks: torch.Tensor,
            config: SparseAttentionConfig) -> torch.Tensor:
    """Positions [num_reqs, width] (see select_blocks) from scores and _position_bias."""
    max_blocks = scores.shape[1]
    top = torch.topk(scores + bias, min(max_blocks, config.max_blocks), dim=1, sorted=False).indices
    # picks past the context (requests with fewer blocks than the width) sort last: they are never read
    top.masked_fill_(top >= num_blocks[:, None], max_blocks - 1)
    return torch.sort(top, dim=1).values


@dataclass(slots=True)
class _StepTables:
    """What the selection needs of a step's decode tables, the same in every layer (made on the first)."""

    block_ids: torch.Tensor  # [num_reqs, max_blocks] int64, the plan's (held, compared by identity)
    seq_lens: torch.Tensor  # [num_reqs] int64, the plan's (held, compared by identity)
    num_blocks: torch.Tensor  # [num_reqs] int64 blocks of each context
    bias: torch.Tensor  # [num_reqs, max_blocks] float32, see _position_bias
    selected_lens: torch.Tensor  # [num_reqs] int64 keys in the selected blocks
    real_ids: torch.Tensor  # [sum of num_blocks] int64 the block ids in the contexts
    real_filled: torch.Tensor  # [sum of num_blocks] int64 rows of those blocks in the context


@dataclass(slots=True)
class _StepSlots:
    """What the summary update needs of a step's slot_mapping, the same in every layer (made on the first)."""

    slot_mapping: torch.Tensor  # as given (held, compared by identity)
    keep: torch.Tensor | None  # [num_tokens] bool rows actually written; None = all
    blocks: torch.Tensor  # [written] int64 block id of each written row
    fresh: torch.Tensor | None  # int64 blocks whose offset-0 row is written (they start over); None = none


class BlockSparseSelector:
    """Per-layer key summaries and the top-k block selection of decode queries (Quest, arXiv:2406.10774).

    One instance serves every layer of a backend; a layer is told apart by its cache tensor (the model runner
    hands each layer the same tensor every step). A layer's summaries are allocated on its first write: bfloat16
    [num_kv_heads, num_blocks, 2, head_dim] (per KV head and block, the channel-wise max then min of its keys,
    rounded outward: `bf16_round_up` / `bf16_round_down`) plus a [num_blocks] bool validity flag.
    """

    def __init__(self, config: SparseAttentionConfig) -> None:
        self.config = config
        self._summaries: dict[int, torch.Tensor] = {}  # kv_cache data_ptr -> [H_kv, num_blocks, 2, head_dim]
        self._valid: dict[int, torch.Tensor] = {}  # kv_cache data_ptr -> [num_blocks] bool
        self._tables: _StepTables | None = None
        self._slots: _StepSlots | None = None
        # blocks marked stale by invalidate() and not yet seen valid again in every layer, and layers whose
        # summaries were just allocated (every block stale) and not yet checked against a step's tables. Every
        # other block a decode query reads was written through record_keys or the C step (a block's first row
        # starts its summary over), so while both are empty the per-step validity check is skipped; the C step
        # still refuses a stale summary (loom/kernels/decode_step.py then refreshes every layer and reruns it)
        self._stale: set[int] = set()
        self._unchecked: set[int] = set()  # kv_cache data_ptr of layers not checked since allocation

    def summaries(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summaries [num_kv_heads, num_blocks, 2, head_dim] bfloat16 max / min, valid [num_blocks] bool) of the
        layer whose cache is kv_cache [2, num_blocks, block_size, num_kv_heads, row]; created, every block
        stale, on first use."""
        key = kv_cache.data_ptr()
        summaries = self._summaries.get(key)
        if summaries is None or summaries.shape[1] != kv_cache.shape[1]:
            _, num_blocks, _, num_kv_heads, _ = kv_cache.shape
            summaries = torch.zeros(num_kv_heads, num_blocks, 2, kv_head_dim(kv_cache), dtype=torch.bfloat16,
                                    device=kv_cache.device)
            self._summaries[key] = summaries
            self._valid[key] = torch.zeros(num_blocks, dtype=torch.bool, device=kv_cache.device)
            self._unchecked.add(key)
        return summaries, self._valid[key]

    def record_keys(self, kv_cache: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor,
                    has_pad_slots: bool) -> None:
        """Fold the keys just written by write_kv_cache into their blocks' summaries.

        Args:
            kv_cache: [2, num_blocks, block_size, num_kv_heads, row] of the layer.
            key: [num_tokens, num_kv_heads, head_dim] the keys written.
            slot_mapping: [num_tokens] int64 block_id * block_size + offset, or -1 (not written).
            has_pad_slots: whether slot_mapping holds a -1.
        """
        slots = self._step_slots(slot_mapping, has_pad_slots, kv_cache.shape[2])
        if slots.blocks.numel() == 0:
            return
        summaries, valid = self.summaries(kv_cache)
        if slots.fresh is not None:
            summaries[:, :, 0].index_fill_(1, slots.fresh, float("-inf"))
            summaries[:, :, 1].index_fill_(1, slots.fresh, float("inf"))
            valid.index_fill_(0, slots.fresh, True)
        k = (key if slots.keep is None else key[slots.keep]).float().transpose(0, 1)  # [H_kv, written, d]
        index = slots.blocks[None, :, None].expand(k.shape)
        # rounding is monotone: the max of the rounded-up keys is the rounded-up max
        summaries[:, :, 0].scatter_reduce_(1, index, bf16_round_up(k), "amax", include_self=True)
        summaries[:, :, 1].scatter_reduce_(1, index, bf16_round_down(k), "amin", include_self=True)

    def _step_slots(self, slot_mapping: torch.Tensor, has_pad_slots: bool, block_size: int) -> _StepSlots:
        slots = self._slots
        if slots is not None and slots.slot_mapping is slot_mapping:
            return slots
        keep = slot_mapping >= 0 if has_pad_slots else None
        written = slot_mapping if keep is None else slot_mapping[keep]
        blocks = torch.div(written, block_size, rounding_mode="floor")
        fresh = blocks[written - blocks * block_size == 0]  # blocks whose first row is (re)written: start over
        self._slots = _StepSlots(slot_mapping, keep, blocks, fresh if fresh.numel() else None)
        return self._slots

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Mark blocks of every layer stale: their rows changed without passing record_keys (a copy)."""
        ids = sorted(set(block_ids))
        if not ids:
            return
        self._stale.update(ids)
        for valid in self._valid.values():
            valid[torch.tensor(ids, dtype=torch.int64, device=valid.device)] = False

    def _prune_stale(self) -> None:
        """Forget the stale marks of blocks valid again in every layer (rewritten from their first row, or
        recomputed)."""
        if not self._valid:
            return
        ids = torch.tensor(sorted(self._stale), dtype=torch.int64)
        still = torch.zeros(len(ids), dtype=torch.bool)
        for valid in self._valid.values():
            still |= ~valid.index_select(0, ids.to(valid.device)).cpu()
        self._stale = set(ids[still].tolist())

    def refresh_stale(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, seq_lens: torch.Tensor,
                      force: bool = False) -> None:
        """Recompute the stale summaries of the blocks a decode step's requests read, in every layer (before loom's
        one-call C decode step, which widens and reads the summaries itself).

        Args:
            kv_caches: each layer's [2, num_blocks, block_size, num_kv_heads, row] cache.
            block_ids: [num_reqs, max_blocks] int64 the requests' block ids in position order.
            seq_lens: [num_reqs] int64 keys of each context, this step's included.
            force: check every layer even when no block is known to be stale.
        """
        if block_ids.shape[1] <= self.config.max_blocks:
            return  # nothing is selected: every block is read
        if not (force or self._stale or self._unchecked):
            return  # nothing is stale
        tables = self._step_tables(block_ids, seq_lens, kv_caches[0].shape[2])
        for kv_cache in kv_caches:
            self._check(kv_cache, tables)

    def select(self, query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
               seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block table and key count each decode query reads.

        Args:
            query: [num_reqs, num_heads, head_dim], one decode token per request.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, row] of the layer (this step's keys written).
            block_ids: [num_reqs, max_blocks] int64 block ids in position order, covering each seq_len (padded
                with any valid id); the same tensor in every layer of a step (per-step work is cached on it).
            seq_lens: [num_reqs] int64 keys of each request's context (>= 1).

        Returns:
            None when no request has more than config.max_blocks blocks (read everything: the dense table);
            else (block_ids [num_reqs, width] int64 of the selected blocks in ascending position order, padded
            with a valid id; seq_lens [num_reqs] int64 keys in them, the partial last block counting its filled
            rows only).
        """
        num_reqs, max_blocks = block_ids.shape
        if max_blocks <= self.config.max_blocks:
            return None
        tables = self._step_tables(block_ids, seq_lens, kv_cache.shape[2])
        summaries, _ = self.summaries(kv_cache)
        if self._stale or kv_cache.data_ptr() in self._unchecked:
            self._check(kv_cache, tables)
        if num_reqs * max_blocks * 2 >= summaries.shape[1]:  # the tables cover much of the cache: score every block
            scores = block_scores(query, summaries[None]).amax(dim=(1, 3)).gather(1, block_ids)
        else:
            rows = summaries.index_select(1, block_ids.view(-1)).view(summaries.shape[0], num_reqs, max_blocks, -1)
            scores = block_scores(query, rows.transpose(0, 1)).amax(dim=(1, 3))
        positions = _select(scores, tables.bias, tables.num_blocks, self.config)
        return block_ids.gather(1, positions), tables.selected_lens

    def _check(self, kv_cache: torch.Tensor, tables: _StepTables) -> None:
        """Recompute the layer's stale summaries among the step's blocks; the layer counts as checked after."""
        summaries, valid = self.summaries(kv_cache)
        if not bool(valid.index_select(0, tables.real_ids).all()):
            self._refresh(summaries, valid, kv_cache, tables)
        self._unchecked.discard(kv_cache.data_ptr())

    def _step_tables(self, block_ids: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> _StepTables:
        tables = self._tables
        if tables is not None and tables.block_ids is block_ids and tables.seq_lens is seq_lens:
            return tables
        if self._stale:  # a new step: blocks rewritten or recomputed since are no longer stale
            self._prune_stale()
        max_blocks = block_ids.shape[1]
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        bias = _position_bias(num_blocks, max_blocks, self.config)
        # the last block (the only partial one) is among the recent blocks, so only whole blocks are skipped
        selected_lens = seq_lens - (num_blocks - num_blocks.clamp(max=self.config.max_blocks)) * block_size
        pos = torch.arange(max_blocks, device=block_ids.device)[None, :]
        real = pos < num_blocks[:, None]
        filled = (seq_lens[:, None] - pos * block_size).clamp(max=block_size)
        self._tables = _StepTables(block_ids, seq_lens, num_blocks, bias, selected_lens, block_ids[real],
                                   filled[real])
        return self._tables

    @staticmethod
    def _refresh(summaries: torch.Tensor, valid: torch.Tensor, kv_cache: torch.Tensor, tables: _StepTables) -> None:
        """Recompute, from the cache, the summaries of the stale blocks among the requests' blocks (rows past a
        request's seq_len left out)."""
        stale = ~valid.index_select(0, tables.real_ids)
        ids, filled = tables.real_ids[stale], tables.real_filled[stale]
        unique = torch.unique(ids)
        # a block listed twice (shared) keeps its most filled rows
        rows = torch.zeros(valid.shape[0], dtype=torch.int64, device=ids.device)
        rows = rows.scatter_reduce_(0, ids, filled, "amax", include_self=False)[unique]
        block_size = kv_cache.shape[2]
        keys = kv_cache[0, unique]  # [S, block_size, H_kv, row]
        keys = dequantize_rows(keys, torch.float32) if is_quantized(keys.dtype) else keys.float()
        empty = (torch.arange(block_size, device=ids.device)[None, :] >= rows[:, None])[:, :, None, None]
        summaries[:, unique, 0] = bf16_round_up(keys.masked_fill(empty, float("-inf")).amax(dim=1).transpose(0, 1))
        summaries[:, unique, 1] = bf16_round_down(keys.masked_fill(empty, float("inf")).amin(dim=1).transpose(0, 1))
        valid[unique] = True


def copied_block_ids(scheduler_output: Any, block_size: int) -> Iterator[int]:
    """Device blocks whose rows a step's copies overwrite before its forward: host-tier restores, copy-on-write
    destinations, pulled KV loads, and the scratch blocks of tree candidates (loom.core.sched_output.SchedulerOutput
    fields; the model runner runs the copies). A generator: nothing is computed unless it is consumed."""
    yield from (dst for _, dst in scheduler_output.blocks_to_restore)
    yield from (dst for _, dst in scheduler_output.blocks_to_copy)
    for load in scheduler_output.kv_loads:
        yield from load.dst_block_ids
    for req in scheduler_output.scheduled:
        if req.spec_branches and req.start_position % block_size:  # rows before the root are copied in
            yield from (table[req.start_position // block_size] for _, table in req.spec_branches)


def stale_key_summaries(backend: Any, block_ids: Iterable[int]) -> None:
    """Tell a block-sparse backend that these blocks' rows were copied in (no-op, block_ids not consumed, for
    other backends or None)."""
    sparse = getattr(backend, "sparse", None)
    if sparse is not None:
        sparse.invalidate(block_ids)


__all__ = ["BlockSparseSelector", "SparseAttentionConfig", "bf16_round_down", "bf16_round_up", "block_bounds",
           "block_scores", "copied_block_ids", "select_blocks", "stale_key_summaries"]
