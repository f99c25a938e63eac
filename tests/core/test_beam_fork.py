"""Scheduler.fork_request and the KV manager's copy on write: the seams beam search stands on.

The fake runner's K/V at a slot is a hash of every earlier token, so a child that wrote into a block its
sibling still reads, or read a block its parent had not finished, generates different tokens than the
reference run of its own token sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus

BS = 4


def _step(scheduler: Scheduler, runner) -> dict[str, list[int]]:
    sched = scheduler.schedule()
    scheduler.check_invariants()
    news = {out.request_id: out.new_token_ids for out in scheduler.update_from_output(sched, runner.execute(sched))}
    scheduler.check_invariants()
    return news


@pytest.mark.parametrize("prompt_len", [5, 7, 10])  # computed rows at the fork: 6, 8 (a block boundary), 11
def test_children_share_blocks_and_copy_the_partial_one_on_write(
    prompt_len: int, make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request],
    fake_runner, reference_output,
) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=BS)
    runner = fake_runner(BS)
    prompt = list(range(100, 100 + prompt_len))
    parent = make_request("p", prompt, max_tokens=12)
    scheduler.add_request(parent)
    _step(scheduler, runner)  # prefill + the first token
    _step(scheduler, runner)  # a second token: the parent's last token is pending (not computed)
    assert parent.num_computed_tokens == parent.num_tokens - 1
    manager = scheduler.kv_cache_manager
    parent_blocks = manager.get_block_ids("p")
    children = [scheduler.fork_request(parent, f"c{t}", t) for t in (7, 8, 9)]
    scheduler.check_invariants()
    for child in children:
        assert manager.get_block_ids(child.request_id) == parent_blocks
    assert all(manager.block_pool.blocks[b].ref_cnt == 4 for b in parent_blocks)
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    sched = scheduler.schedule()
    partial = parent.num_computed_tokens % BS != 0
    # every child but the last to be scheduled copies the shared partial block; full blocks stay shared
    assert len(sched.blocks_to_copy) == (2 if partial else 0)
    full = parent.num_computed_tokens // BS
    assert len({tuple(r.block_table[:full]) for r in sched.scheduled}) == 1
    scheduler.update_from_output(sched, runner.execute(sched))
    scheduler.check_invariants()
    while scheduler.has_unfinished_requests():
        _step(scheduler, runner)
    for child, token in zip(children, (7, 8, 9)):
        known = prompt + parent.output_token_ids[:-1] + [token]
        expected = reference_output(known, 12 - len(parent.output_token_ids))
        assert child.output_token_ids == parent.output_token_ids[:-1] + [token] + expected
    assert manager.num_free_blocks == 32


def test_a_waiting_parent_forks_into_a_waiting_child(
    make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request], fake_runner, reference_output,
) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=BS)
    runner = fake_runner(BS)
    parent = make_request("p", list(range(6)), max_tokens=6)
    scheduler.add_request(parent)
    _step(scheduler, runner)
    scheduler._preempt(scheduler.running.pop())  # as the scheduler does when the pool runs out
    child = scheduler.fork_request(parent, "c", 42)
    assert child.status == RequestStatus.PREEMPTED and child.num_computed_tokens == 0
    assert list(scheduler.waiting) == [child, parent]
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    while scheduler.has_unfinished_requests():
        _step(scheduler, runner)
    known = list(range(6)) + [42]
    assert child.output_token_ids == [42] + reference_output(known, 5)
    assert scheduler.kv_cache_manager.num_free_blocks == 32


def test_held_requests_are_not_scheduled_and_keep_their_queue_place(
    make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request], fake_runner,
) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=BS)
    runner = fake_runner(BS)
    a, b = make_request("a", [1, 2, 3], max_tokens=4), make_request("b", [4, 5, 6], max_tokens=4)
    a.hold = True
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert set(_step(scheduler, runner)) == {"b"}  # a waits, b overtakes it
    assert list(scheduler.waiting) == [a]
    a.hold = False
    assert set(_step(scheduler, runner)) == {"a", "b"}
    b.hold = True
    assert set(_step(scheduler, runner)) == {"a"}


def test_a_request_holding_seats_counts_them(
    make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request], fake_runner,
) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=BS, max_num_seqs=4)
    runner = fake_runner(BS)
    wide = make_request("wide", [1, 2, 3], max_tokens=4)
    wide.num_seats = 3
    scheduler.add_request(wide)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", [4, 5, 6 + i], max_tokens=4))
    assert set(_step(scheduler, runner)) == {"wide", "r0"}  # 3 + 1 seats: r1 waits
    assert scheduler.num_seats_used == 4


def test_fork_refuses_unknown_parents_and_used_ids(
    make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request], fake_runner,
) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=BS)
    runner = fake_runner(BS)
    parent = make_request("p", [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError, match="cannot be forked"):
        scheduler.fork_request(parent, "c", 1)  # not in the scheduler
    scheduler.add_request(parent)
    with pytest.raises(ValueError, match="cannot be forked"):
        scheduler.fork_request(parent, "c", 1)  # no output token yet
    _step(scheduler, runner)
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.fork_request(parent, "p", 1)


def test_held_requests_are_preempted_before_a_working_one(
    make_scheduler: Callable[..., Scheduler], make_request: Callable[..., Request], fake_runner,
) -> None:
    """When a running request needs a block, an idle held request (a beam waiting for its group) is preempted,
    not the last admitted request that is working."""
    scheduler = make_scheduler(num_blocks=4, block_size=BS)
    runner = fake_runner(BS)
    held, busy = make_request("held", [1, 2, 3, 4, 5, 6], max_tokens=8), make_request("busy", [7, 8, 9], max_tokens=8)
    scheduler.add_request(held)
    scheduler.add_request(busy)
    _step(scheduler, runner)  # held: 2 blocks, busy: 1 block; one free
    held.hold = True
    _step(scheduler, runner)  # busy fills its block
    sched = scheduler.schedule()  # busy needs a second block, and then a third: held must make room
    scheduler.check_invariants()
    while not sched.preempted_req_ids:
        scheduler.update_from_output(sched, runner.execute(sched))
        sched = scheduler.schedule()
    assert sched.preempted_req_ids == ["held"] and [r.request_id for r in sched.scheduled] == ["busy"]
    assert held.num_computed_tokens == 0 and busy.status == RequestStatus.RUNNING


def test_a_beam_search_the_pool_cannot_hold_is_refused(make_scheduler: Callable[..., Scheduler]) -> None:
    """One whole sequence plus a block per beam must fit the pool, or the search would preempt a beam at every
    step; what fits is admitted."""
    from loom.engine.beam_search import BeamSearchManager, BeamSearchParams

    scheduler = make_scheduler(num_blocks=8, block_size=BS)
    manager = BeamSearchManager(scheduler, tokenizer=None, eos_token_ids=frozenset({0}))
    prompt = list(range(1, 9))  # 2 blocks
    with pytest.raises(ValueError, match="num_kv_blocks=8"):  # 2 + 3 + 4 beams = 9 > 8
        manager.add("wide", None, prompt, BeamSearchParams(beam_width=4, max_tokens=12), 12, 0.0, None)
    assert not scheduler.has_unfinished_requests()
    manager.add("fits", None, prompt, BeamSearchParams(beam_width=3, max_tokens=12), 12, 0.0, None)  # 2 + 3 + 3
    assert "fits" in manager and scheduler.num_waiting == 1
