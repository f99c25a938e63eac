"""Factories for the engine-core tests: requests, schedulers and a fake model runner.

The fake runner keeps a simulated paged KV cache: the "K/V" written at a slot is a running hash of
every token up to that position, read back through the block table. A sampled token is a function of
that state, so a lost, repeated or misplaced token, a wrong block table, or a prefix-cache hit on a
block whose contents were overwritten all change the generated tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest

from loom.config import CacheConfig, SchedulerConfig
from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams

VOCAB_SIZE = 997  # tokens the fake model samples from: 0..996
_MODULUS = (1 << 61) - 1


def mix(state: int, token_id: int, position: int) -> int:
    """Fake K/V at `position`: depends on every earlier token and on the position."""
    return (state * 1_000_003 + token_id * 31 + position + 7) % _MODULUS


def sample_from(state: int) -> int:
    return (state >> 7) % VOCAB_SIZE


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What an unconstrained engine generates for `prompt` (no stop tokens)."""
    state = 0
    tokens = list(prompt)
    for position, token_id in enumerate(tokens):
        state = mix(state, token_id, position)
    out: list[int] = []
    while len(out) < max_tokens:
        token_id = sample_from(state)
        out.append(token_id)
        state = mix(state, token_id, len(prompt) + len(out) - 1)
    return out


@dataclass(slots=True)
class FakeRunner:
    """Executes a SchedulerOutput against a simulated paged KV cache."""

    block_size: int  # tokens per block
    kv: dict[int, int] = field(default_factory=dict)  # slot -> fake K/V state
    steps: int = 0  # executed steps

    def slot(self, block_table: list[int], position: int) -> int:
        assert position // self.block_size < len(block_table), "block table does not cover the position"
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for src, dst in sched.blocks_to_copy:  # copy on write (beam search forks), before the forward
            for offset in range(self.block_size):
                if src * self.block_size + offset in self.kv:
                    self.kv[dst * self.block_size + offset] = self.kv[src * self.block_size + offset]
        out = ModelRunnerOutput(sampled_token_ids={})
        for req in sched.scheduled:
            start = req.start_position
            state = 0 if start == 0 else self.kv[self.slot(req.block_table, start - 1)]
            for k, token_id in enumerate(req.token_ids):
                state = mix(state, token_id, start + k)
                self.kv[self.slot(req.block_table, start + k)] = state
            params = req.sampling_params
            if params.prompt_logprobs is not None:
                n_prompt = len(req.prompt_token_ids)
                positions = range(max(start, 1), min(start + len(req.token_ids), n_prompt))
                out.prompt_logprobs[req.request_id] = [
                    TokenLogprobs([req.prompt_token_ids[p]], [-float(p)], [1]) for p in positions
                ]
            if req.sample:
                token_id = sample_from(state)
                out.sampled_token_ids[req.request_id] = [token_id]
                if params.logprobs is not None:
                    out.logprobs[req.request_id] = [TokenLogprobs([token_id], [-0.5], [1])]
        return out


def make_request(
    request_id: str,
    prompt: Iterable[int],
    max_tokens: int = 8,
    *,
    max_model_len: int = 256,
    cache_salt: str | None = None,
    eos_token_ids: Iterable[int] = (),
    **params: object,
) -> Request:
    """A greedy request with max_tokens resolved as the engine does."""
    prompt_ids = list(prompt)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=sampling,
        eos_token_ids=frozenset(eos_token_ids),
        arrival_time=0.0,
        max_tokens=max(0, min(max_tokens, max_model_len - len(prompt_ids))),
        cache_salt=cache_salt,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    max_waiting_requests: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_waiting_requests=max_waiting_requests,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


@dataclass(slots=True)
class RunResult:
    tokens: dict[str, list[int]]  # request_id -> generated token ids
    finish_reasons: dict[str, str]  # request_id -> finish reason
    steps: int  # engine steps taken


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 10_000,
    before_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Step until no request is left, checking invariants after every step."""
    result = RunResult(tokens={}, finish_reasons={}, steps=0)
    while scheduler.has_unfinished_requests():
        if before_step is not None:
            before_step(result.steps)
            if not scheduler.has_unfinished_requests():
                break
        assert result.steps < max_steps, "engine made no progress"
        sched = scheduler.schedule()
        scheduler.check_invariants()
        assert sched.total_num_scheduled_tokens == sum(len(r.token_ids) for r in sched.scheduled)
        if sched.preempted_req_ids:  # no admission in a step that had to preempt
            assert not any(r.is_new for r in sched.scheduled)
        assert not {r.request_id for r in sched.scheduled} & set(sched.preempted_req_ids)
        for out in scheduler.update_from_output(sched, runner.execute(sched)):
            result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                result.finish_reasons[out.request_id] = out.finish_reason
        scheduler.check_invariants()
        result.steps += 1
    return result


@pytest.fixture(name="make_request")
def make_request_fixture() -> Callable[..., Request]:
    return make_request


@pytest.fixture(name="make_scheduler")
def make_scheduler_fixture() -> Callable[..., Scheduler]:
    return make_scheduler


@pytest.fixture(name="fake_runner")
def fake_runner_fixture() -> type[FakeRunner]:
    """The FakeRunner class: call it with the block size."""
    return FakeRunner


@pytest.fixture(name="run_until_done")
def run_until_done_fixture() -> Callable[..., RunResult]:
    return run_until_done


@pytest.fixture(name="reference_output")
def reference_output_fixture() -> Callable[[list[int], int], list[int]]:
    return reference_output
