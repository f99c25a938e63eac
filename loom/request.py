"""A request as the engine core tracks it. Plain Python: no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loom.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV blocks; waits at the front of the queue to be recomputed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


class FinishReason(str, enum.Enum):
    """The OpenAI finish reasons (plus "abort" and "error")."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


STATUS_TO_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique inside the engine (the front end adds a suffix for client ids and n > 1)
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # tokenizer EOS + generation-config EOS ids
    arrival_time: float  # time.monotonic() seconds, when the request reached the engine front
    max_tokens: int  # resolved: min(sampling_params.max_tokens, max_model_len - num_prompt_tokens)
    cache_salt: str | None = None  # extra key of the prefix-cache hash: different salts never share blocks
    group_id: str | None = None  # the user-facing request this one is a copy of (n > 1); None = itself
    output_token_ids: list[int] = field(default_factory=list)  # [num_output_tokens]
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks, block order
    # draft tokens being verified this step (speculative decoding): their K/V are computed with the step's
    # tokens, and num_computed_tokens counts them until the runner's answer rolls the rejected ones back
    spec_token_ids: list[int] = field(default_factory=list)
    # beam search (loom/engine/beam_search.py): the group this beam belongs to (never drafted for), the
    # running seats it stands for (a group's first request holds its whole width), and whether it waits for
    # the rest of its group (a held request is not scheduled)
    beam_group: str | None = None
    num_seats: int = 1
    hold: bool = False
    # prefill/decode disaggregation (loom/kv_transfer): on a prefill replica, the handle under which the prompt's
    # blocks stay pinned when the request ends (None = freed as usual); on a decode replica, the prompt K/V pulled
    # from the prefill replica (a loom.kv_transfer.base.RemoteKV), loaded at admission instead of computed
    kv_transfer_id: str | None = None
    remote_kv: Any = None
    # KV retention (loom/core/kv_retention.py): this request's lossy policy (a KVRetentionConfig, set by the scheduler
    # from its sampling params and the engine's setting); None = full attention
    kv_retention: Any = None

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the drafts in flight."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return STATUS_TO_FINISH_REASON.get(self.status)
