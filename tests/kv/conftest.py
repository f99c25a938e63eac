"""Fakes for the host-tier tests: the core tests' fake paged runner, plus the host copies it must run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
from loom.core.scheduler import Scheduler
from tests.core.conftest import FakeRunner


@dataclass(slots=True)
class OffloadFakeRunner:
    """FakeRunner whose fake K/V also move between device blocks and host slots, in the runner's order
    (offloads, then restores, then the forward). A missing, late or misdirected copy changes the tokens."""

    block_size: int  # tokens per block
    device: FakeRunner = field(init=False)
    host: dict[tuple[int, int], int | None] = field(default_factory=dict)  # (slot, offset) -> fake K/V state
    offloaded: int = 0  # blocks copied device -> host
    restored: int = 0  # blocks copied host -> device
    scheduled_tokens: int = 0  # tokens computed, over all steps

    def __post_init__(self) -> None:
        self.device = FakeRunner(self.block_size)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for block_id, slot in sched.blocks_to_offload:
            for k in range(bs):
                self.host[(slot, k)] = self.device.kv.get(block_id * bs + k)
            self.offloaded += 1
        for slot, block_id in sched.blocks_to_restore:
            for k in range(bs):
                state = self.host[(slot, k)]
                if state is None:
                    self.device.kv.pop(block_id * bs + k, None)
                else:
                    self.device.kv[block_id * bs + k] = state
            self.restored += 1
        self.scheduled_tokens += sched.total_num_scheduled_tokens
        return self.device.execute(sched)


def run_with_checks(
    scheduler: Scheduler,
    runner: OffloadFakeRunner,
    before_step: Callable[[int], None] | None = None,
    max_steps: int = 10_000,
) -> dict[str, list[int]]:
    """Step until done, checking every invariant after schedule and after update; returns tokens per request."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while scheduler.has_unfinished_requests():
        if before_step is not None:
            before_step(step)
            if not scheduler.has_unfinished_requests():
                break
        assert step < max_steps, "no progress"
        sched = scheduler.schedule()
        scheduler.check_invariants()
        for out in scheduler.update_from_output(sched, runner.execute(sched)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        scheduler.check_invariants()
        step += 1
    return tokens
