"""What the engine hands back to users."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float  # natural log of the model's probability (raw log-softmax of the logits)
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the n samples
    text: str  # cumulative text so far
    token_ids: list[int]  # cumulative generated token ids
    delta_text: str = ""  # text new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # cumulative, one per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # [num_prompt_tokens]; the first is None
    outputs: list[CompletionOutput]  # one per sample, ordered by index
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # a prefill replica's final output (disaggregation): where a decode replica pulls this prompt's K/V
    # (loom.kv_transfer.base.KVTransferParams.to_dict); None otherwise
    kv_transfer_params: dict[str, Any] | None = None
