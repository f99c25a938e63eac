"""Beam search over the engine's requests: each beam is a request, and beams that share a prefix share its
KV blocks.

The algorithm is transformers' (`GenerationMixin._beam_search`, v4.50+ vectorised form; Hugging Face,
generation/utils.py), kept step for step so that the output equals it in float32:

  * K = max(2, 1 + number of ids that end a sequence: end-of-sequence ids and stop_token_ids) x beam_width
    candidates are taken each step (transformers counts its eos_token_id list): the top K of
    (a beam's cumulative log-probability + the log-softmax of its next-token logits) over all live beams;
  * a candidate "hits the stopping criteria" when its token ends the sequence or it reaches max_tokens;
  * the beam_width best candidates that do not hit go on; among the first beam_width candidates, those that hit
    become finished hypotheses scored cumulative / generated_length ** length_penalty, and the beam_width best
    hypotheses are kept;
  * early_stopping: True stops once beam_width hypotheses are finished; False (transformers' default) stops once
    the best live beam, scored at its current length, cannot beat the worst kept hypothesis; "never" uses
    max_tokens as that length when length_penalty > 0 (the canonical, slower rule).

The engine side (the seams it uses):
  * a beam is an engine Request that samples greedily with `logprobs = K` (its top-K raw log-softmax values)
    and never stops on its own before max_tokens (the group decides);
  * each step every live beam computes one token; a beam that reported before its siblings is held
    (`Request.hold`), so a preemption cannot let it run ahead;
  * the new beams are forked from their parents (`Scheduler.fork_request`): they share the parents' KV blocks
    by reference count, and the partial last block is copied on write when two children of one parent would
    both write into it (`KVCacheManager.fork`, `allocate_slots`); then the parents end.
Plain Python and numpy (float32 sums, as transformers' tensors); no torch.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.core.sched_output import EngineCoreOutput, TokenLogprobs
from loom.core.scheduler import Scheduler
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loom.request import Request, RequestStatus
from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_BEAM_WIDTH = 32
MAX_BEAM_STOP_TOKEN_IDS = 16  # each stop id widens the candidates per step by beam_width (see K below)


@dataclass(slots=True)
class BeamSearchParams:
    """Parameters of one beam-search request (vLLM's BeamSearchParams plus transformers' early_stopping).

    | parameter | meaning | valid range | default |
    |---|---|---|---|
    | beam_width | beams kept each step (transformers' num_beams) | 1..32, <= max_num_seqs | 4 |
    | n | sequences returned, best score first (num_return_sequences) | 1..beam_width, None = beam_width | None |
    | max_tokens | most tokens generated per sequence | >= 1, None = until max_model_len | 16 |
    | length_penalty | a finished sequence scores cumulative logprob / length ** length_penalty | finite | 1.0 |
    | early_stopping | True, False or "never" (transformers' meanings; see the module docstring) | | False |
    | ignore_eos | do not end sequences on the end-of-sequence ids | bool | False |
    | stop_token_ids | more ids that end a sequence (as end-of-sequence ids do) | at most 16 ids >= 0 | [] |
    | skip_special_tokens | drop special tokens from the text | bool | True |
    """

    beam_width: int = 4
    n: int | None = None
    max_tokens: int | None = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids is not None else []
        self.verify()
        if self.n is None:
            self.n = self.beam_width

    def verify(self) -> None:
        """Raise ValueError naming the first invalid parameter."""
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise ValueError(f"beam_width must be an integer, got {self.beam_width!r}")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int)
                                   or not 1 <= self.n <= self.beam_width):
            raise ValueError(f"n must be an integer in [1, beam_width={self.beam_width}], got {self.n!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 for beam search, got {self.max_tokens!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not np.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if len(self.stop_token_ids) > MAX_BEAM_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_BEAM_STOP_TOKEN_IDS} ids with beam search "
                             f"(each widens every step's candidates), got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {t!r}")


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]  # generated tokens, the ending one included
    cumulative_logprob: float
    score: np.float32  # cumulative_logprob / len(token_ids) ** length_penalty


@dataclass(slots=True)
class _Candidate:
    score: np.float32  # cumulative logprob with this token
    parent: str  # engine request id of the beam it extends
    token_id: int


@dataclass(slots=True)
class _Group:
    """One user request's beam search."""

    request_id: str
    params: BeamSearchParams
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: within max_model_len
    stop_ids: frozenset[int]  # the ids that end a sequence
    num_candidates: int  # K
    arrival_time: float
    beams: dict[str, np.float32] = field(default_factory=dict)  # live engine request id -> cumulative logprob
    tokens: dict[str, list[int]] = field(default_factory=dict)  # live engine request id -> its generated tokens
    reported: dict[str, TokenLogprobs] = field(default_factory=dict)  # id -> this step's chosen token + top K
    finished: list[_Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    num_generated: int = 0  # tokens every live beam has generated
    ids: Any = field(default_factory=lambda: itertools.count(1))
    first_token_time: float | None = None


class BeamSearchManager:
    """Runs every beam-search request of one engine; LLMEngine calls it at add, abort and after each step."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._groups: dict[str, _Group] = {}  # user request id -> group
        self._beam_to_group: dict[str, str] = {}  # live engine request id -> user request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
            max_tokens: int, arrival_time: float, cache_salt: str | None) -> None:
        """Start a beam search: one request that prefills the prompt and holds beam_width running seats.

        Raises:
            ValueError: beam_width above max_num_seqs (`beam_width`); what Scheduler.add_request raises.
        """
        params.verify()
        seats = self.scheduler.scheduler_config.max_num_seqs
        if params.beam_width > seats:
            raise ValueError(f"beam_width ({params.beam_width}) must be <= max_num_seqs ({seats})")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        bs = self.scheduler.cache_config.block_size
        # at least one whole sequence plus a partial last block per beam (beams that share all but their last
        # block): a search the pool cannot hold even so would only thrash, preempting a beam at every step
        blocks = -(-(len(prompt_token_ids) + max_tokens) // bs) + params.beam_width
        if blocks > self.scheduler.num_blocks:
            raise ValueError(f"beam_width={params.beam_width} with max_tokens={max_tokens} needs at least {blocks} "
                             f"KV blocks of {bs} tokens with this prompt, more than the whole pool "
                             f"(num_kv_blocks={self.scheduler.num_blocks}): lower the width or max_tokens")
        num_candidates = max(2, 1 + len(stop_ids)) * params.beam_width
        beam_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     skip_special_tokens=params.skip_special_tokens)
        beam_params.logprobs = num_candidates  # past SamplingParams' user limit: the top K are this module's input
        group = _Group(request_id, params, prompt, prompt_token_ids, max_tokens, stop_ids, num_candidates,
                       arrival_time)
        root = Request(request_id=f"{request_id}#beam0", prompt_token_ids=prompt_token_ids,
                       sampling_params=beam_params, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                       max_tokens=max_tokens, cache_salt=cache_salt, group_id=request_id, beam_group=request_id,
                       num_seats=params.beam_width)
        self.scheduler.add_request(root)
        group.beams[root.request_id] = np.float32(0.0)
        group.tokens[root.request_id] = []
        self._groups[request_id] = group
        self._beam_to_group[root.request_id] = request_id

    def abort(self, request_id: str) -> bool:
        """End a beam search and free its beams' blocks; False when request_id is not a beam search."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self._end_beams(group, list(group.beams))
        return True

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """Take the beams' news out of a step's outputs: (the other requests' outputs, finished beam searches)."""
        others: list[EngineCoreOutput] = []
        touched: dict[str, _Group] = {}
        failed: dict[str, _Group] = {}
        for out in core_outputs:
            group_id = self._beam_to_group.get(out.request_id)
            if group_id is None:
                others.append(out)
                continue
            group = self._groups[group_id]
            if out.finish_reason in ("error", "abort") or (out.new_token_ids and not out.new_logprobs):
                failed[group_id] = group
                continue
            if out.new_token_ids:
                group.reported[out.request_id] = out.new_logprobs[0]
                request = self.scheduler.get_request(out.request_id)  # None when it just reached max_tokens
                if request is not None:
                    request.hold = True  # until its siblings have reported too
                touched[group_id] = group
        results = [self._fail(group) for group in failed.values()]
        for group_id, group in touched.items():
            if group_id not in failed and set(group.reported) >= set(group.beams):
                try:
                    result = self._step(group)
                except Exception:  # noqa: BLE001 - a bug or an odd input fails this search, never the step
                    logger.exception("beam search %s failed; ending it", group_id)
                    result = self._fail(group)
                if result is not None:
                    results.append(result)
        return others, results

    # ---- one step of the algorithm -------------------------------------------------------------------------

    def _step(self, group: _Group) -> RequestOutput | None:
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        params = group.params
        width = params.beam_width
        order = {beam_id: i for i, beam_id in enumerate(group.beams)}
        candidates: list[tuple[np.float32, int, int, _Candidate]] = []
        for beam_id, cumulative in group.beams.items():
            top = group.reported[beam_id]
            for token_id, logprob in zip(top.token_ids[1:], top.logprobs[1:]):
                score = np.float32(cumulative) + np.float32(logprob)
                candidates.append((score, order[beam_id], token_id, _Candidate(score, beam_id, token_id)))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        top_k = [c[3] for c in candidates[: group.num_candidates]]
        length = group.num_generated + 1  # generated tokens of every candidate
        hits = [c.token_id in group.stop_ids or length >= group.max_tokens for c in top_k]
        running = [c for c, hit in zip(top_k, hits) if not hit][:width]
        # the first beam_width candidates that end become hypotheses, unless the search is already settled
        if group.improvable and not (len(group.finished) == width and params.early_stopping is True):
            penalty = _length_factor(length, params.length_penalty)
            for c, hit in zip(top_k[:width], hits[:width]):
                if hit:
                    tokens = group.tokens[c.parent] + [c.token_id]
                    group.finished.append(_Hypothesis(tokens, float(c.score), np.float32(c.score / penalty)))
            group.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses first on a tie
            del group.finished[width:]
        group.num_generated = length
        if running and len(group.finished) == width:
            best_length = group.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 \
                else length
            best_possible = np.float32(running[0].score / _length_factor(best_length, params.length_penalty))
            group.improvable = group.improvable and bool(best_possible > min(h.score for h in group.finished))
        elif not running:
            group.improvable = False
        done = (not group.improvable or all(hits)
                or (len(group.finished) == width and params.early_stopping is True))
        if done:
            return self._finish(group)
        self._fork(group, running)
        return None

    def _fork(self, group: _Group, running: list[_Candidate]) -> None:
        parents, parent_tokens = list(group.beams), group.tokens
        group.beams, group.tokens, group.reported = {}, {}, {}
        for c in running:
            child_id = f"{group.request_id}#beam{next(group.ids)}"
            while self.scheduler.get_request(child_id) is not None:  # an engine-API caller's own id
                child_id = f"{group.request_id}#beam{next(group.ids)}"
            self.scheduler.fork_request(self.scheduler.get_request(c.parent), child_id, c.token_id)
            group.beams[child_id] = c.score
            group.tokens[child_id] = parent_tokens[c.parent] + [c.token_id]
            self._beam_to_group[child_id] = group.request_id
        self._end_beams(group, parents)

    def _end_beams(self, group: _Group, beam_ids: list[str]) -> None:
        self.scheduler.finish_requests(beam_ids, RequestStatus.FINISHED_ABORTED)
        for beam_id in beam_ids:
            self._beam_to_group.pop(beam_id, None)

    # ---- results -------------------------------------------------------------------------------------------

    def _finish(self, group: _Group) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        self._end_beams(group, list(group.beams))
        outputs = []
        for index, hyp in enumerate(group.finished[: group.params.n]):
            last = hyp.token_ids[-1] if hyp.token_ids else None
            stopped = last in group.stop_ids
            # a stop_token_id stays in the token ids but not in the text, as without beam search
            shown = hyp.token_ids[:-1] if stopped and last in group.params.stop_token_ids else hyp.token_ids
            outputs.append(CompletionOutput(
                index=index,
                text=self.tokenizer.decode(shown, skip_special_tokens=group.params.skip_special_tokens),
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cumulative_logprob,
                finish_reason="stop" if stopped else "length",
                stop_reason=last if stopped and last in group.params.stop_token_ids else None,
            ))
        return self._output(group, outputs)

    def _fail(self, group: _Group) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        self._end_beams(group, list(group.beams))
        return self._output(group, [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                                    for i in range(group.params.n)])

    def _output(self, group: _Group, outputs: list[CompletionOutput]) -> RequestOutput:
        now = time.monotonic()
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=None, outputs=outputs, finished=True,
            metrics=RequestMetrics(arrival_time=group.arrival_time, first_token_time=group.first_token_time,
                                   last_token_time=now, finished_time=now),
        )


def _length_factor(length: int, length_penalty: float) -> np.float32:
    """length ** length_penalty as transformers divides by it (a float32 divisor); inf, not OverflowError, when
    it exceeds float range (a large length_penalty: every finished score is then 0)."""
    with np.errstate(over="ignore"):
        return np.float32(np.float64(length) ** length_penalty)


__all__ = ["BeamSearchManager", "BeamSearchParams", "MAX_BEAM_WIDTH"]
