"""KV retention policies: which whole KV blocks of a long request are kept under a memory budget.

A request under a lossy policy is prefilled with full attention (its prompt K/V are exact, and may come from or go
to the prefix cache); then, at a step boundary, the policy picks the blocks to keep within its budget and the KV
cache manager frees the others (`KVCacheManager.drop_blocks`). The request's block table is compacted: it lists
the kept blocks in position order, so attention reads the kept blocks only, with no mask and no change to any
backend. Positions stay the original ones (rotary is applied before caching), and a dropped block is only
dereferenced, never altered: a block that another request shares is untouched. From its first drop on, the
request stops feeding the prefix cache (the K/V it computes after that depend on the dropped state).

Policies (the field's names):
  * ``full``: keep everything (today's attention, bit for bit).
  * ``sinks``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
    arXiv:2309.17453): the first `sink_tokens` (rounded up to whole blocks) plus the most recent blocks.
  * ``h2o``: Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048): keep the blocks with the largest
    attention received, accumulated over every query the request has computed (prompt and output), plus the
    recent window; evicts again whenever decode grows past the budget.
  * ``snapkv``: SnapKV (Li et al. 2024, arXiv:2404.14469): once, when the prompt is complete, score the prompt's
    blocks by the attention of its last `window` queries (the observation window), pooled over neighbouring
    blocks, and keep the best within the budget plus the window itself; the selection then stays, and the blocks
    decode adds are dropped once they leave the recent window (the budget is exceeded by at most that window).

The scores are per block (one block table serves every layer, so one decision is made for all of them; the papers
choose per head and layer — the coarsening is the price of paging): H2O sums the attention over layers, heads and
queries; SnapKV takes, over layers and heads, the largest of each head's window attention to the block, so a block
one head needs is not outvoted by the many heads that look elsewhere.

Plain Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

KV_RETENTION_POLICIES = ("full", "sinks", "h2o", "snapkv")


@dataclass(frozen=True, slots=True)
class KVRetentionConfig:
    """One request's (or the engine's) retention settings.

    budget: <= 1 = a fraction of the request's context when it is first cut (its prompt); > 1 = tokens (an
    integer). sink_tokens: tokens at the start always kept (sinks and h2o; rounded up to whole blocks).
    window: recent tokens always kept, and snapkv's observation window (tokens).
    """

    policy: str = "full"
    budget: float = 0.25
    sink_tokens: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        if self.policy not in KV_RETENTION_POLICIES:
            raise ValueError(f"kv_retention must be one of {list(KV_RETENTION_POLICIES)}, got {self.policy!r}")
        check_budget(self.budget)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"kv_retention_sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"kv_retention_window must be an integer >= 1, got {self.window!r}")

    @property
    def lossy(self) -> bool:
        """Whether blocks may be dropped (every policy but full)."""
        return self.policy != "full"

    def budget_tokens(self, context_tokens: int) -> int:
        """Tokens the budget allows for a request whose context was `context_tokens` when first cut."""
        if self.budget <= 1:
            return max(1, math.ceil(self.budget * context_tokens))
        return int(self.budget)


def check_budget(budget: object, name: str = "kv_retention_budget") -> None:
    """Raise ValueError unless `budget` is a fraction in (0, 1] or an integer number of tokens > 1."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not math.isfinite(budget):
        raise ValueError(f"{name} must be a number (a fraction in (0, 1] or tokens > 1), got {budget!r}")
    if budget <= 0:
        raise ValueError(f"{name} must be > 0 (a fraction in (0, 1] or tokens > 1), got {budget!r}")
    if budget > 1 and budget != int(budget):
        raise ValueError(f"{name} above 1 is a number of tokens and must be an integer, got {budget!r}")


@dataclass(slots=True)
class RetentionState:
    """What the scheduler keeps per request under a lossy policy."""

    config: KVRetentionConfig
    block_positions: list[int]  # original block index (position // block_size) of each kept block, table order
    scores: list[float]  # accumulated attention received by each kept block (h2o, snapkv), table order
    budget_tokens: int | None = None  # fixed at the first cut
    num_dropped_blocks: int = 0  # blocks freed so far
    cut_prompt: bool = False  # snapkv: the one prompt-time selection has been made
    num_selected: int = 0  # snapkv: table entries the prompt-time selection kept (the first entries of the table)


class KVRetentionPolicy(Protocol):
    """Chooses which of a request's full blocks to drop. Registered by name in KV_RETENTION_REGISTRY."""

    name: str
    score_reduce: str  # how per-head block scores combine over heads and layers: "sum" or "max"

    def score_rows(self, state: RetentionState, start: int, end: int, num_tokens: int) -> int:
        """How many of this step's last query rows (positions start..end-1 of a request of num_tokens known tokens)
        the runner scores: 0 = none, -1 = a sample of all (loom.attention.kv_scores.ROW_STRIDE)."""
        ...

    def select_drops(self, state: RetentionState, kept_tokens: int, block_size: int, prompt_done: bool) -> list[int]:
        """Indices into the kept-block table (ascending) to drop now, for a request whose table holds `kept_tokens`
        computed tokens, once `prompt_done` (its prompt is computed and it decodes); [] = nothing. Never the newest
        block, the sinks or the recent window."""
        ...


def _protected(state: RetentionState, num_kept: int, block_size: int) -> tuple[int, int]:
    """(leading table entries kept as sinks, trailing entries kept as the recent window) for `num_kept` blocks."""
    cfg = state.config
    sinks = 0
    sink_blocks = -(-cfg.sink_tokens // block_size)
    while sinks < num_kept and state.block_positions[sinks] < sink_blocks:
        sinks += 1
    recent = min(num_kept - sinks, 1 + -(-cfg.window // block_size))  # the newest (maybe partial) block + window
    return sinks, recent


def _over_budget(state: RetentionState, kept_tokens: int, block_size: int) -> int:
    """Whole blocks to drop to bring `kept_tokens` within the budget (0 when within)."""
    assert state.budget_tokens is not None
    return max(0, -(-(kept_tokens - state.budget_tokens) // block_size))


class FullRetention:
    """Keep every block (no state is made for it)."""

    name = "full"
    score_reduce = "sum"

    def score_rows(self, state: RetentionState, start: int, end: int, num_tokens: int) -> int:
        return 0

    def select_drops(self, state: RetentionState, kept_tokens: int, block_size: int, prompt_done: bool) -> list[int]:
        return []


class SinkRetention:
    """StreamingLLM: attention sinks (the first tokens) plus the recent window; drops the oldest others first."""

    name = "sinks"
    score_reduce = "sum"

    def score_rows(self, state: RetentionState, start: int, end: int, num_tokens: int) -> int:
        return 0

    def select_drops(self, state: RetentionState, kept_tokens: int, block_size: int, prompt_done: bool) -> list[int]:
        if not prompt_done:
            return []
        need = _over_budget(state, kept_tokens, block_size)
        sinks, recent = _protected(state, len(state.block_positions), block_size)
        candidates = list(range(sinks, len(state.block_positions) - recent))
        return candidates[:need]


class HeavyHitterRetention:
    """H2O: drop the blocks that received the least attention so far (accumulated over all queries), keeping
    the sinks and the recent window; ties go to the older block."""

    name = "h2o"
    score_reduce = "sum"  # attention accumulated over every query and head

    def score_rows(self, state: RetentionState, start: int, end: int, num_tokens: int) -> int:
        return -1

    def select_drops(self, state: RetentionState, kept_tokens: int, block_size: int, prompt_done: bool) -> list[int]:
        if not prompt_done:
            return []
        return _lowest_scores(state, _over_budget(state, kept_tokens, block_size), block_size)


class SnapKVRetention:
    """SnapKV: one selection when the prompt is complete, from the attention of the observation window (the last
    `window` prompt queries, pooled over neighbouring blocks); then decode's blocks beyond the recent window go."""

    name = "snapkv"
    score_reduce = "max"  # SnapKV selects per head: a block counts as much as the head that attends to it most

    def score_rows(self, state: RetentionState, start: int, end: int, num_tokens: int) -> int:
        if state.cut_prompt:
            return 0
        # the observation window: the last `window` known tokens, scored in whichever chunks hold them
        return max(0, end - max(start, num_tokens - state.config.window))

    def select_drops(self, state: RetentionState, kept_tokens: int, block_size: int, prompt_done: bool) -> list[int]:
        if not prompt_done:
            return []
        need = _over_budget(state, kept_tokens, block_size)
        if not state.cut_prompt:
            state.cut_prompt = True
            drops = _lowest_scores(state, need, block_size, _max_pool(state.scores))
            state.num_selected = len(state.block_positions) - len(drops)
            return drops
        # after the prompt cut the selection stays; the blocks decode added go once they leave the recent window,
        # oldest first (SnapKV compresses the prompt only)
        sinks, recent = _protected(state, len(state.block_positions), block_size)
        return list(range(max(sinks, state.num_selected), len(state.block_positions) - recent))[:need]


def _max_pool(scores: list[float], radius: int = 1) -> list[float]:
    """1-D max pooling over neighbouring blocks (SnapKV pools token scores so that a selected token keeps its
    neighbours; at block granularity a radius of one block)."""
    n = len(scores)
    return [max(scores[max(0, i - radius) : min(n, i + radius + 1)]) for i in range(n)]


def _lowest_scores(state: RetentionState, need: int, block_size: int, scores: list[float] | None = None) -> list[int]:
    """The `need` unprotected table entries of lowest score (ascending table order); older first on ties."""
    if need <= 0:
        return []
    scores = state.scores if scores is None else scores
    sinks, recent = _protected(state, len(state.block_positions), block_size)
    candidates = range(sinks, len(state.block_positions) - recent)
    chosen = sorted(candidates, key=lambda i: (scores[i], i))[:need]
    return sorted(chosen)


# Read-only registry: policy name -> factory. New policies add an entry here.
KV_RETENTION_REGISTRY: Mapping[str, Callable[[], KVRetentionPolicy]] = MappingProxyType({
    "full": FullRetention, "sinks": SinkRetention, "h2o": HeavyHitterRetention, "snapkv": SnapKVRetention,
})


def get_retention_policy(name: str) -> KVRetentionPolicy:
    """The policy registered under `name`. Raises ValueError naming the registered ones."""
    factory = KV_RETENTION_REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"kv_retention {name!r} is unknown; registered: {sorted(KV_RETENTION_REGISTRY)}")
    return factory()


__all__ = ["KV_RETENTION_POLICIES", "KV_RETENTION_REGISTRY", "KVRetentionConfig", "KVRetentionPolicy",
           "RetentionState", "check_budget", "get_retention_policy"]
