"""The draft-model proposer: a second, smaller model with the target's tokenizer drafts k tokens greedily
(Leviathan et al. 2023; Chen et al. 2023; vLLM's `draft_model`, llama.cpp's `--model-draft`).

The draft has its own model runner and its own paged KV cache. Per request it remembers the tokens whose
K/V its cache holds; each step it keeps the longest prefix of them the request still has (accepted drafts
stay, rejected ones are dropped: rollback is a truncation), feeds the rest (a prompt the first time, in
chunks of at most `max_catch_up_tokens` per step; then the kept drafts and the target's token), and decodes
k - 1 more. So it stays in step with the target
through acceptance, rollback, preemption (the request's tokens do not change) and the target's prefix hits
(the draft computes its own K/V). All of a step's requests draft together: one catch-up pass, then one
decode pass per further draft position.

Drafts are the draft model's argmax, deterministic given the tokens, so the target's `accept_sampled` is
exact for greedy and sampled requests alike (loom/spec/verify.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from loom.core.sched_output import ScheduledRequest, SchedulerOutput
from loom.sampling_params import SamplingParams
from loom.spec.proposer import DraftRequest
from loom.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(slots=True)
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the draft cache holds, positions 0..
    blocks: list[int] = field(default_factory=list)  # the draft cache's blocks for them, in position order


# Catch-ups up to this many tokens (the last kept draft and the target's token, after a verify pass) run as decode
# rows, so the draft's one-call C decode step serves them; longer ones (a prompt) run as a prefill chunk.
MAX_DECODE_ROWS_CATCH_UP = 16


def _row(request_id: str, state: _DraftState, token_ids: list[int], sample: bool) -> ScheduledRequest:
    """The draft runner's row for `token_ids` following the tokens `state` caches, greedy."""
    return ScheduledRequest(request_id=request_id, token_ids=token_ids, start_position=len(state.tokens),
                            block_table=state.blocks, sample=sample, sampling_params=_GREEDY, prompt_token_ids=[],
                            output_token_ids=[], is_new=False,
                            decode_rows=1 < len(token_ids) <= MAX_DECODE_ROWS_CATCH_UP)


class DraftModelProposer:
    """Drafts with `runner`'s model (the draft), whose KV pool it manages.

    Blocks: a request holds the blocks for its tokens plus the drafts; when the pool runs dry, the least
    recently drafted requests outside the current step lose their draft state (recomputed when they draft
    again), and a request that still does not fit gets no drafts this step.

    Catch-up is chunked like the target's prefill: a step feeds at most `max_catch_up_tokens` tokens in all,
    so a long prompt reaches the draft's cache over several steps (drafting starts once it has) instead of
    stalling every request of one step behind a long unchunked draft pass.
    """

    name = "draft_model"

    def __init__(self, runner: ModelRunner, max_model_len: int, max_catch_up_tokens: int = 512) -> None:
        if max_catch_up_tokens < 1:
            raise ValueError(f"max_catch_up_tokens must be >= 1, got {max_catch_up_tokens}")
        self.runner = runner
        self.max_catch_up_tokens = max_catch_up_tokens
        self.block_size = runner.block_size
        self.max_model_len = min(max_model_len, runner.arch.max_position_embeddings)
        self._free: list[int] = list(range(runner.num_blocks - 1, -1, -1))  # a stack of free block ids
        self._states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently drafted first
        self.num_forward_passes = 0  # draft-model passes run (one catch-up, then one per draft position)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return self.propose_batch([DraftRequest(request_id, token_ids, max_tokens)])[0]

    def propose_branches(self, requests: Sequence[DraftRequest], max_branches: int) -> list[list[list[int]]]:
        """One branch per request: the draft's greedy run (SpeculativeConfig refuses a tree width > 1)."""
        return [[d] if d else [] for d in self.propose_batch(requests)]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        batch_ids = {r.request_id for r in requests}
        active: list[tuple[int, DraftRequest, _DraftState, int]] = []  # (index, request, state, num drafts)
        partial: list[tuple[DraftRequest, _DraftState, list[int]]] = []  # catch-ups that stop short of the end
        budget = self.max_catch_up_tokens
        for i, r in enumerate(requests):
            n = min(r.max_tokens, self.max_model_len - len(r.token_ids))
            if n <= 0 or not r.token_ids or budget <= 0:
                continue
            state = self._states.pop(r.request_id, None) or _DraftState()
            self._states[r.request_id] = state  # now the most recently drafted
            # keep the cached prefix the request still has, but always feed its last token again: its
            # logits give the first draft
            keep = 0
            limit = min(len(state.tokens), len(r.token_ids) - 1)
            while keep < limit and state.tokens[keep] == r.token_ids[keep]:
                keep += 1
            del state.tokens[keep:]
            missing = len(r.token_ids) - keep
            if not self._reserve(state, len(r.token_ids) + n - 1, batch_ids):
                continue
            if missing > budget:  # a long catch-up: part of it now, drafts in a later step
                partial.append((r, state, list(r.token_ids[keep : keep + budget])))
                budget = 0
                continue
            budget -= missing
            active.append((i, r, state, n))
        if not active and not partial:
            return drafts

        # catch-up: the tokens each cache lacks, sampling after the last where that is the request's last
        step = [_row(r.request_id, s, list(r.token_ids[len(s.tokens):]), sample=True) for _, r, s, _ in active]
        step += [_row(r.request_id, s, chunk, sample=False) for r, s, chunk in partial]
        out = self._run(step)
        for _, s, chunk in partial:
            s.tokens.extend(chunk)
        for i, r, s, _ in active:
            s.tokens = list(r.token_ids)
            drafts[i].append(out[r.request_id][0])
        # then one decode pass per further draft position, for the requests that want that many
        for j in range(1, max((n for *_, n in active), default=0)):
            rows = [(i, r, s) for i, r, s, n in active if n > j]
            out = self._run([_row(r.request_id, s, [drafts[i][-1]], sample=True) for i, r, s in rows])
            for i, r, s in rows:
                s.tokens.append(drafts[i][-1])
                drafts[i].append(out[r.request_id][0])
        return drafts

    def _run(self, scheduled: list[ScheduledRequest]) -> dict[str, list[int]]:
        self.num_forward_passes += 1
        total = sum(len(r.token_ids) for r in scheduled)
        return self.runner.execute_model(SchedulerOutput(scheduled, total)).sampled_token_ids

    def _reserve(self, state: _DraftState, num_positions: int, protected: set[str]) -> bool:
        """Give `state` blocks for positions [0, num_positions), evicting the least recently drafted
        requests outside `protected` when the pool is dry. False when they cannot be found."""
        need = -(-num_positions // self.block_size) - len(state.blocks)
        while need > len(self._free):
            victim = next((rid for rid in self._states if rid not in protected), None)
            if victim is None:
                return False
            self._free.extend(self._states.pop(victim).blocks)
        for _ in range(need):
            state.blocks.append(self._free.pop())
        return True

    def request_finished(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(state.blocks)
