"""What the scheduler tells the model runner for one step, and what comes back. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # [num_scheduled_tokens] tokens whose K/V are computed this step
    start_position: int  # position of token_ids[0] (= num_computed_tokens before this step)
    block_table: list[int]  # block ids covering positions [0, start_position + len(token_ids))
    sample: bool  # True when this chunk reaches the request's last known token: sample one token after it
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # read-only view, for penalties and prompt logprobs
    output_token_ids: list[int]  # read-only view, for penalties
    is_new: bool  # first time scheduled since (re)admission: the runner resets its per-request state if needed
    # draft tokens (speculative decoding): token_ids = [last token] + spec_token_ids; the runner verifies them
    # and samples at every position (sample is True)
    spec_token_ids: list[int] = field(default_factory=list)
    # tree candidates: the other branches, each (its draft tokens, its block table). A branch's rows are
    # [last token] + its tokens at positions start_position ..; its table is the request's up to the block
    # holding start_position and scratch blocks from there (the runner copies that block's earlier rows in
    # first). Only for greedy requests; the runner keeps the branch with the longest accepted run.
    spec_branches: list[tuple[list[int], list[int]]] = field(default_factory=list)
    # each token a decode row of its own (row j attends to positions <= start_position + j), as verify rows are, but
    # only the last sampled (when sample): a short chunk then runs the batched decode path and the one-call C step
    # instead of the chunked-prefill path (the draft model's catch-up of its last draft and the target's token)
    decode_rows: bool = False
    # a hybrid KV cache (loom/core/kv_groups.py): each KV cache group's block table, group order (block_table is
    # group 0's); None = one group, block_table serves every layer
    group_block_tables: list[list[int]] | None = None
    # KV retention (loom/core/kv_retention.py): context tokens whose blocks were dropped (whole blocks, all before
    # start_position); block_table lists the kept blocks only, so token p's slot is in entry
    # (p - num_dropped_tokens) // block_size and the attention context is start_position + len - num_dropped_tokens
    num_dropped_tokens: int = 0
    # rows whose attention the runner sums per kept block for the policy (ModelRunnerOutput.kv_block_scores): the
    # last kv_score_rows query rows of this request's chunk; -1 = all; 0 = none
    kv_score_rows: int = 0
    kv_score_reduce: str = "sum"  # how head and layer scores combine: "sum" (h2o) or "max" (snapkv)


@dataclass(slots=True)
class KVBlockLoad:
    """Pulled KV blocks (prefill/decode disaggregation) to write into a request's blocks before the forward."""

    payload: Any  # loom.kv_transfer.base.KVPayload: the producer's blocks as host bytes (opaque here)
    src_indices: list[int]  # payload blocks to load, position order
    dst_block_ids: list[int]  # the request's blocks they go to, same order


@dataclass(frozen=True, slots=True)
class PinnedKV:
    """A finished request's prompt blocks kept for a decode replica to pull."""

    transfer_id: str  # the handle to pull them with
    block_ids: list[int]  # position order
    num_tokens: int  # prompt tokens whose K/V they hold
    prompt_digest: str  # digest of those tokens (loom.kv_transfer.base.prompt_digest)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = field(default_factory=list)  # requests that ended since the last step
    preempted_req_ids: list[str] = field(default_factory=list)
    # Host-tier copies, run by the runner in this order before the forward: offloads first (each device
    # block is read before anything this step overwrites it), then restores.
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    blocks_to_restore: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id)
    # Copy-on-write copies of shared partial blocks (beam search), run after the host-tier copies:
    # (source block id, destination block id), whole blocks
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # pulled KV blocks to write after the copies above, before the forward (disaggregated decode)
    kv_loads: list[KVBlockLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-N (raw log-softmax)."""

    token_ids: list[int]  # [1 + num_top]
    logprobs: list[float]  # [1 + num_top], natural log
    ranks: list[int]  # [1 + num_top], 1 = most likely


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]  # request_id -> tokens sampled this step (one, or more with speculation)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per sampled token, when asked
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # prompt positions computed this step
    # tree candidates: request_id -> the branch its tokens were kept from (0 = spec_token_ids; absent = 0)
    spec_branch: dict[str, int] = field(default_factory=dict)
    # KV retention: request_id -> attention received by each entry of its block table this step, summed over layers,
    # heads and the scored query rows (ScheduledRequest.kv_score_rows)
    kv_block_scores: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news after a step, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_pinned: PinnedKV | None = None  # the request ended with its prompt blocks pinned for a decode replica
