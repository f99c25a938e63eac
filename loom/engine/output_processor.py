"""From engine-core token ids to user-facing RequestOutputs: detokenization, stop strings, n>1 fan-in.

The engine runs one engine request ("child") per sample; this module merges the n children of a
user request ("parent") back into one RequestOutput with n CompletionOutputs, ordered by index.

Stop strings are matched on the text, wherever they fall: inside one token, across several tokens,
or on the very first token. Text that could still grow into a stop string is held back from
delta_text until decided, so a client never sees text that is later taken back. Semantics follow the
OpenAI API and vLLM: the matched string is cut from the text (kept with include_stop_str_in_output),
the token that completed it is kept in token_ids, and the text of a token that ended the request as
EOS or a stop token id is not shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loom.core.sched_output import EngineCoreOutput, TokenLogprobs
from loom.engine.detokenizer import IncrementalDetokenizer, decode_token
from loom.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from loom.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # one per parent with news this step, in order of first news
    reqs_to_abort: list[str]  # child request ids that matched a stop string: the engine must free them


@dataclass(slots=True)
class _Child:
    request_id: str  # engine request id
    index: int  # which of the parent's n samples
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # [num_output_tokens]
    text: str = ""  # all text decoded so far (cut at the stop string once matched)
    shown_len: int = 0  # chars of `text` that are final (not held back as a possible stop string)
    sent_len: int = 0  # chars of `text` already sent in a delta_text
    sent_tokens: int = 0  # tokens already sent in a delta_token_ids
    logprobs: list[PositionLogprobs] | None = None  # one dict per output token, when asked
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str  # the user-facing id
    prompt: str | None
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    n: int  # number of children expected
    metrics: RequestMetrics
    children: dict[int, _Child] = field(default_factory=dict)  # index -> child
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None] + one per prompt token so far
    num_cached_tokens: int = 0  # from child 0: prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return len(self.children) == self.n and all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutputs. Single-threaded; the engine owns it."""

    def __init__(self, tokenizer: Any) -> None:
        """Args: tokenizer: a transformers fast tokenizer (or `tokenizers.Tokenizer`)."""
        self._tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}  # parent id -> state
        self._child_to_parent: dict[str, tuple[str, int]] = {}  # unfinished child id -> (parent id, index)
        self._abort_outputs: dict[str, RequestOutput] = {}  # parent id -> final output, sent by the next call
        self._token_text: dict[int, str] = {}  # token id -> decoded text, for logprobs

    def add_request(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        n: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        """Track one child of a parent request (call n times, index 0..n-1).

        Raises:
            ValueError: `request_id` already tracked, `index` outside [0, n), or `n` disagreeing with an
                earlier child of the same parent.
        """
        if request_id in self._child_to_parent:
            raise ValueError(f"request_id {request_id!r} is already being processed")
        if not 0 <= index < n:
            raise ValueError(f"index must be in [0, {n}), got {index}")
        parent = self._parents.get(parent_id)
        if parent is None:
            self._abort_outputs.pop(parent_id, None)  # a reused id must not receive the old request's end
            parent = _Parent(parent_id, prompt, list(prompt_token_ids), n, RequestMetrics(arrival_time=arrival_time))
            if params.prompt_logprobs is not None:
                parent.prompt_logprobs = [None]
            self._parents[parent_id] = parent
        elif parent.n != n or index in parent.children:
            raise ValueError(f"n ({n}) or index ({index}) disagrees with earlier children of {parent_id!r}")
        detokenizer = IncrementalDetokenizer(self._tokenizer, prompt_token_ids, params.skip_special_tokens)
        child = _Child(request_id, index, params, detokenizer)
        if params.logprobs is not None:
            child.logprobs = []
            child.cumulative_logprob = 0.0
        parent.children[index] = child
        self._child_to_parent[request_id] = (parent_id, index)

    def record_scheduled(self, request_ids: list[str], now: float) -> None:
        """Note when each parent was first scheduled (queue time = first_scheduled_time - arrival_time).

        Args: request_ids: child ids scheduled this step; now: time.monotonic() seconds.
        """
        for request_id in request_ids:
            entry = self._child_to_parent.get(request_id)
            if entry is not None:
                metrics = self._parents[entry[0]].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's news; return a RequestOutput for every parent with news.

        Also returns the final outputs of parents aborted since the previous call. Outputs for unknown
        or already finished children are ignored.
        """
        result = ProcessedOutputs(request_outputs=list(self._abort_outputs.values()), reqs_to_abort=[])
        self._abort_outputs.clear()
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        for out in outputs:
            key = self._child_to_parent.get(out.request_id)
            if key is None:
                continue
            parent_id, index = key
            parent = self._parents[parent_id]
            child = parent.children[index]
            if self._apply(parent, child, out, result.reqs_to_abort, now):
                touched[parent_id] = parent
        for parent in touched.values():
            result.request_outputs.append(self._make_output(parent, now))
        return result

    def abort_request(self, parent_id: str) -> list[str]:
        """Abort a parent: its unfinished children end with finish_reason "abort".

        The parent is forgotten at once; its final RequestOutput (all text so far, finished=True) is
        returned by the next process_outputs call, unless the id is reused by add_request first.

        Returns:
            The child ids that were still unfinished (the engine frees them); [] for unknown ids.
        """
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        aborted = []
        for child in parent.children.values():
            if child.finish_reason is None:
                child.text += child.detokenizer.flush()
                self._finish(child, "abort", None)
                aborted.append(child.request_id)
        parent.n = len(parent.children)  # children never added will never come
        self._abort_outputs[parent_id] = self._make_output(parent, time.monotonic())
        return aborted

    def get_child_ids(self, parent_id: str) -> list[str]:
        """Child request ids of a parent, by index; [] when unknown."""
        parent = self._parents.get(parent_id)
        return [] if parent is None else [parent.children[i].request_id for i in sorted(parent.children)]

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- one child's news -----------------------------------------------------------------------------------

    def _apply(
        self, parent: _Parent, child: _Child, out: EngineCoreOutput, reqs_to_abort: list[str], now: float
    ) -> bool:
        """Fold one EngineCoreOutput into its child. Returns whether the parent has news."""
        news = False
        if out.new_prompt_logprobs and child.index == 0 and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._position_logprobs(t) for t in out.new_prompt_logprobs)
            news = True
        if child.index == 0:
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if child.finish_reason is not None:
            return news
        if out.new_token_ids:
            parent.metrics.first_token_time = parent.metrics.first_token_time or now
            parent.metrics.last_token_time = now
            news = True
        if self._append_tokens(child, out):
            if out.finish_reason is None:
                reqs_to_abort.append(child.request_id)
            return True
        if out.finish_reason is not None:
            child.text += child.detokenizer.flush()
            self._finish(child, out.finish_reason, out.stop_reason)
            return True
        _release_text(child)
        return news

    def _append_tokens(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Append the new tokens one by one; returns True when a stop string finished the child."""
        params = child.params
        # A token that ended the request as EOS / stop token id keeps its id but not its text.
        ended_by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        last = len(out.new_token_ids) - 1
        for k, token_id in enumerate(out.new_token_ids):
            child.token_ids.append(token_id)
            if child.logprobs is not None and out.new_logprobs is not None:
                entry = out.new_logprobs[k]
                child.logprobs.append(self._position_logprobs(entry))
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry.logprobs[0]
            if k == last and ended_by_token:
                break
            old_len = len(child.text)
            child.text += child.detokenizer.step(token_id)
            if params.stop and len(child.token_ids) >= params.min_tokens:
                match = find_stop_string(child.text, old_len, params.stop)
                if match is not None:
                    start, stop = match
                    end = start + len(stop) if params.include_stop_str_in_output else start
                    assert child.sent_len <= end, "held-back text was already sent"
                    child.text = child.text[:end]
                    self._finish(child, "stop", stop)
                    return True
        return False

    def _finish(self, child: _Child, finish_reason: str, stop_reason: int | str | None) -> None:
        child.finish_reason = finish_reason
        child.stop_reason = stop_reason
        child.shown_len = len(child.text)  # nothing can become a stop string any more
        self._child_to_parent.pop(child.request_id, None)

    # ---- building outputs -----------------------------------------------------------------------------------

    def _make_output(self, parent: _Parent, now: float) -> RequestOutput:
        completions = [_snapshot(parent.children[i]) for i in sorted(parent.children)]
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = now
            self._parents.pop(parent.request_id, None)
            for child in parent.children.values():
                self._child_to_parent.pop(child.request_id, None)
        prompt_logprobs = None if parent.prompt_logprobs is None else list(parent.prompt_logprobs)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=parent.metrics.arrival_time,
                first_scheduled_time=parent.metrics.first_scheduled_time,
                first_token_time=parent.metrics.first_token_time,
                last_token_time=parent.metrics.last_token_time,
                finished_time=parent.metrics.finished_time,
            ),
        )

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in result:
                result[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=self._decoded(token_id))
        return result

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = decode_token(self._tokenizer, token_id)
        return text


def find_stop_string(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside text[old_len:] (the newly added text).

    Returns:
        (start index in text, the stop string), or None. Ties at one start go to the earlier-listed string.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, old_len - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _release_text(child: _Child) -> None:
    """Advance shown_len to everything that can no longer turn into a stop string."""
    params = child.params
    hold = held_back_len(child.text, params.stop) if params.stop and not params.include_stop_str_in_output else 0
    child.shown_len = max(child.shown_len, len(child.text) - hold)


def _snapshot(child: _Child) -> CompletionOutput:
    """The child's CompletionOutput now, with the deltas since its previous snapshot."""
    text = child.text[: child.shown_len]
    delta_text = text[child.sent_len :]
    delta_token_ids = child.token_ids[child.sent_tokens :]
    child.sent_len = len(text)
    child.sent_tokens = len(child.token_ids)
    return CompletionOutput(
        index=child.index,
        text=text,
        token_ids=list(child.token_ids),
        delta_text=delta_text,
        delta_token_ids=delta_token_ids,
        cumulative_logprob=child.cumulative_logprob,
        logprobs=None if child.logprobs is None else list(child.logprobs),
        finish_reason=child.finish_reason,
        stop_reason=child.stop_reason,
    )
