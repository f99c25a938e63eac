"""What rank 0 sends the other ranks each step: a diff of the SchedulerOutput, as vLLM v1 sends
NewRequestData once and CachedRequestData after (vllm/v1/core/sched/output.py).

A request's prompt and sampling parameters cross once, when it is (re)admitted; after that a step carries only the
tokens to compute, their start position and the change to each block table (keep the first n ids, append the
rest: appends are the common case, and a rolled-back or shrunk table is just a smaller n). The encoder keeps a
mirror of the tables each worker holds, the decoder the tables themselves; both forget a request when it finishes
or is preempted. No torch: this module is bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.core.sched_output import ScheduledRequest, SchedulerOutput
from loom.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen since its (re)admission."""

    request_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    sampling_params: SamplingParams  # the workers read prompt_logprobs only (rank 0 samples)


@dataclass(slots=True)
class StepRequestData:
    """One scheduled request's part of a step."""

    request_id: str
    token_ids: list[int]  # [num_scheduled_tokens] tokens whose K/V are computed this step
    start_position: int  # position of token_ids[0]
    sample: bool  # logits are taken after the last token (rank 0 samples; the others join the LM head's gather)
    is_new: bool
    # per KV cache group: (ids kept from the previous step's table, ids appended after them)
    table_edits: list[tuple[int, list[int]]]
    spec_token_ids: list[int] = field(default_factory=list)
    spec_branches: list[tuple[list[int], list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class StepMessage:
    """Everything a worker needs to run the same step as rank 0."""

    new_requests: list[NewRequestData]
    requests: list[StepRequestData]  # in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    blocks_to_offload: list[tuple[int, int]]
    blocks_to_restore: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]


def _edit(old: list[int] | None, new: list[int]) -> tuple[int, list[int]]:
    """(length of the common prefix of old and new, new's ids after it)."""
    keep = 0
    if old is not None:
        limit = min(len(old), len(new))
        while keep < limit and old[keep] == new[keep]:
            keep += 1
    return keep, new[keep:]


def _tables(req: ScheduledRequest) -> list[list[int]]:
    return req.group_block_tables if req.group_block_tables is not None else [req.block_table]


class StepEncoder:
    """Rank 0's side: SchedulerOutput -> StepMessage, remembering the tables the workers hold."""

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}  # request_id -> each group's table as the workers have it

    def encode(self, scheduler_output: SchedulerOutput) -> StepMessage:
        for request_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self._tables.pop(request_id, None)
        new_requests: list[NewRequestData] = []
        requests: list[StepRequestData] = []
        for req in scheduler_output.scheduled:
            tables = _tables(req)
            known = None if req.is_new else self._tables.get(req.request_id)
            if known is None:
                new_requests.append(NewRequestData(req.request_id, list(req.prompt_token_ids), req.sampling_params))
            edits = [_edit(None if known is None else known[g], table) for g, table in enumerate(tables)]
            self._tables[req.request_id] = [list(t) for t in tables]
            requests.append(StepRequestData(
                request_id=req.request_id, token_ids=list(req.token_ids), start_position=req.start_position,
                sample=req.sample, is_new=known is None, table_edits=edits,
                spec_token_ids=list(req.spec_token_ids),
                spec_branches=[(list(tokens), list(table)) for tokens, table in req.spec_branches]))
        return StepMessage(
            new_requests=new_requests, requests=requests,
            total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            finished_req_ids=list(scheduler_output.finished_req_ids),
            preempted_req_ids=list(scheduler_output.preempted_req_ids),
            blocks_to_offload=list(scheduler_output.blocks_to_offload),
            blocks_to_restore=list(scheduler_output.blocks_to_restore),
            blocks_to_copy=list(scheduler_output.blocks_to_copy))

    @property
    def num_tracked(self) -> int:
        """Requests whose tables the workers hold (for tests: finished ones must not stay)."""
        return len(self._tables)


@dataclass(slots=True)
class _WorkerRequest:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tables: list[list[int]]


class StepDecoder:
    """A worker's side: StepMessage -> the SchedulerOutput rank 0 ran (what the runner reads of it)."""

    def __init__(self) -> None:
        self._requests: dict[str, _WorkerRequest] = {}

    def decode(self, message: StepMessage) -> SchedulerOutput:
        """Raises:
            KeyError: a step for a request the worker was never sent (a protocol bug)."""
        for request_id in (*message.finished_req_ids, *message.preempted_req_ids):
            self._requests.pop(request_id, None)
        for new in message.new_requests:
            self._requests[new.request_id] = _WorkerRequest(new.prompt_token_ids, new.sampling_params, [])
        scheduled: list[ScheduledRequest] = []
        for data in message.requests:
            state = self._requests[data.request_id]
            if data.is_new:
                state.tables = [[] for _ in data.table_edits]
            state.tables = [table[:keep] + tail for table, (keep, tail) in
                            zip(state.tables, data.table_edits, strict=True)]
            tables = state.tables
            scheduled.append(ScheduledRequest(
                request_id=data.request_id, token_ids=data.token_ids, start_position=data.start_position,
                block_table=tables[0], sample=data.sample, sampling_params=state.sampling_params,
                prompt_token_ids=state.prompt_token_ids, output_token_ids=[], is_new=data.is_new,
                spec_token_ids=data.spec_token_ids, spec_branches=data.spec_branches,
                group_block_tables=[list(t) for t in tables] if len(tables) > 1 else None))
        return SchedulerOutput(
            scheduled=scheduled, total_num_scheduled_tokens=message.total_num_scheduled_tokens,
            finished_req_ids=message.finished_req_ids, preempted_req_ids=message.preempted_req_ids,
            blocks_to_offload=message.blocks_to_offload, blocks_to_restore=message.blocks_to_restore,
            blocks_to_copy=message.blocks_to_copy)

    @property
    def num_tracked(self) -> int:
        return len(self._requests)
