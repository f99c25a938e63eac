"""Scheduler: admission and rejection, chunked prefill, seats, stops, max_tokens 0, aborts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from loom.core.scheduler import QueueFullError, Scheduler
from loom.request import Request, RequestStatus

MakeRequest = Callable[..., Request]
MakeScheduler = Callable[..., Scheduler]
FakeRunnerFactory = Callable[[int], Any]  # block_size -> conftest.FakeRunner
RunUntilDone = Callable[..., Any]  # conftest.run_until_done
ReferenceOutput = Callable[[list[int], int], list[int]]


def test_requests_generate_the_reference_tokens(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    sched = make_scheduler()
    prompts = {f"r{i}": list(range(i, i + 3 + 2 * i)) for i in range(5)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, 6))
    result = run_until_done(sched, fake_runner(4))
    for rid, prompt in prompts.items():
        assert result.tokens[rid] == reference_output(prompt, 6)
        assert result.finish_reasons[rid] == "length"
    assert sched.num_free_blocks == 64 and not sched.has_unfinished_requests()


def test_chunked_prefill_respects_the_budget(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, reference_output
) -> None:
    sched = make_scheduler(max_num_batched_tokens=5)
    runner = fake_runner(4)
    prompt = list(range(40, 63))  # 23 tokens: 5 chunks
    sched.add_request(make_request("a", prompt, 3))
    tokens: list[int] = []
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 5
        (one,) = out.scheduled
        assert one.sample == (one.start_position + len(one.token_ids) == len(prompt) + len(tokens))
        assert one.is_new == (steps == 0)
        for core_out in sched.update_from_output(out, runner.execute(out)):
            tokens.extend(core_out.new_token_ids)
        steps += 1
        if steps == 4:
            assert tokens == []  # 20 of 23 prompt tokens computed, nothing sampled yet
    assert tokens == reference_output(prompt, 3)
    assert steps == 5 + 2


def test_max_num_seqs_bounds_running(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i, 1, 2], 4))

    def before_step(_: int) -> None:
        assert sched.num_running <= 2

    result = run_until_done(sched, fake_runner(4), before_step=before_step)
    assert all(result.tokens[f"r{i}"] == reference_output([i, 1, 2], 4) for i in range(5))


def test_rejections_name_the_parameter_and_leave_others_running(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=32)  # the pool holds 16 tokens
    sched.add_request(make_request("ok", range(5), 4, max_model_len=32))
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("empty", [], 4, max_model_len=32))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", range(33), 4, max_model_len=32))
    full = make_request("full", range(32), 4, max_model_len=32)
    full.max_tokens = 4  # as if not resolved: no room left for an output token
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(full)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        sched.add_request(make_request("big", range(17), 4, max_model_len=32))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        sched.add_request(make_request("grows", range(10), 10, max_model_len=32))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("ok", range(5), 4, max_model_len=32))
    sched.add_request(make_request("fits", range(12), 4, max_model_len=32))  # exactly 16 tokens
    result = run_until_done(sched, fake_runner(4))
    assert result.tokens == {"ok": reference_output(list(range(5)), 4), "fits": reference_output(list(range(12)), 4)}
    assert sched.num_free_blocks == 4


def test_prompt_of_max_model_len_with_max_tokens_zero_is_accepted(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done
) -> None:
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("z", range(16), 0, max_model_len=16))
    result = run_until_done(sched, fake_runner(4))
    assert result.finish_reasons == {"z": "length"} and result.tokens["z"] == []


def test_max_tokens_zero_returns_prompt_logprobs_once_and_no_tokens(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner
) -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = fake_runner(4)
    sched.add_request(make_request("p", range(10, 21), 0, prompt_logprobs=2))
    positions: list[float] = []
    finish = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not any(r.sample for r in out.scheduled)
        for core_out in sched.update_from_output(out, runner.execute(out)):
            assert core_out.new_token_ids == []
            positions.extend(lp.logprobs[0] for lp in core_out.new_prompt_logprobs or [])
            finish = core_out.finish_reason
    assert positions == [-float(p) for p in range(1, 11)]
    assert finish == "length"
    assert sched.num_free_blocks == 64


def test_stop_token_finishes_with_stop_reason(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    prompt = [3, 1, 4, 1, 5]
    expected = reference_output(prompt, 10)
    stop_at = next(i for i in range(2, 10) if expected[i] not in expected[:i])  # its first occurrence
    sched = make_scheduler()
    sched.add_request(make_request("s", prompt, 10, stop_token_ids=[expected[stop_at]]))
    sched.add_request(make_request("e", prompt, 10, eos_token_ids=[expected[stop_at]]))
    result = run_until_done(sched, fake_runner(4))
    assert result.tokens["s"] == expected[: stop_at + 1] == result.tokens["e"]
    assert result.finish_reasons == {"s": "stop", "e": "stop"}


def test_queue_full(make_request: MakeRequest, make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(max_waiting_requests=2, max_num_seqs=2)
    for rid in "abcd":  # an idle scheduler: two take the free seats at the next step, two wait
        sched.add_request(make_request(rid, [1], 50))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("e", [1], 50))
    sched.schedule()  # a and b admitted: the seats are taken, c and d wait, the queue is full
    assert sched.num_waiting == 2 and sched.num_running == 2
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("e", [1], 50))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # a seat frees: one more may queue
    sched.add_request(make_request("e", [1], 50))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("f", [1], 50))


def test_the_copies_of_one_request_count_once_against_the_queue(make_request: MakeRequest,
                                                                 make_scheduler: MakeScheduler) -> None:
    """n copies larger than max_waiting_requests still queue: they are one user request (before, such a
    request got 'queue full, retry later' forever)."""
    sched = make_scheduler(max_waiting_requests=1, max_num_seqs=1)
    sched.add_request(make_request("busy", [1], 50))
    sched.schedule()  # the one seat is taken
    for i in range(4):
        r = make_request(f"{i}_big", [1], 50)
        r.group_id = "big"
        sched.add_request(r)
    other = make_request("other", [1], 50)
    with pytest.raises(QueueFullError):  # the queue holds one user request: "big"
        sched.add_request(other)
    assert sched.num_waiting == 4


def test_abort_waiting_and_running_frees_blocks(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner
) -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = fake_runner(4)
    sched.add_request(make_request("run", range(9), 20))
    sched.add_request(make_request("wait", range(5), 20))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.num_running == 1 and sched.num_waiting == 1 and sched.num_free_blocks < 64
    sched.finish_requests(["wait", "run", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("run", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    sched.check_invariants()
    assert sched.num_free_blocks == 64 and not sched.has_unfinished_requests()
    assert sched.get_request("run") is None
    out = sched.schedule()
    assert sorted(out.finished_req_ids) == ["run", "wait"] and out.is_empty
    assert sched.schedule().finished_req_ids == []


def test_abort_between_schedule_and_update_ignores_the_output(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner
) -> None:
    sched = make_scheduler()
    runner = fake_runner(4)
    sched.add_request(make_request("a", range(6), 5))
    sched.add_request(make_request("b", range(7), 5))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    core_outs = sched.update_from_output(out, runner.execute(out))
    assert [o.request_id for o in core_outs] == ["b"]
    sched.check_invariants()


def test_finish_requests_rejects_an_unfinished_status(make_scheduler: MakeScheduler) -> None:
    with pytest.raises(ValueError, match="status"):
        make_scheduler().finish_requests("a", RequestStatus.RUNNING)


def test_num_cached_tokens_and_prefix_stats(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done
) -> None:
    sched = make_scheduler()
    runner = fake_runner(4)
    sched.add_request(make_request("a", range(13), 2))
    run_until_done(sched, runner)
    sched.add_request(make_request("b", range(13), 2))
    out = sched.schedule()
    (b,) = out.scheduled
    assert b.start_position == 12 and b.token_ids == [12] and b.is_new
    core_outs = sched.update_from_output(out, runner.execute(out))
    assert core_outs[0].num_cached_tokens == 12
    assert sched.prefix_cache_hits == 12 and sched.prefix_cache_queries == 26


def _copies(make_request: MakeRequest, user: str, n: int, prompt: list[int], max_tokens: int) -> list[Request]:
    """The n copies of one user request, as LLMEngine.add_request makes them."""
    copies = [make_request(f"{i}_{user}", prompt, max_tokens) for i in range(n)]
    for r in copies:
        r.group_id = user
    return copies


def test_a_request_with_many_copies_does_not_hold_every_seat_from_a_later_one(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory,
    run_until_done: RunUntilDone, reference_output
) -> None:
    """n = 8 copies of a long generation on 4 seats, then a short request: before, the short one waited until
    copies ended (their 60 tokens, ~120 steps with 8 copies); now one copy gives up its seat and the short request
    runs at once. Every output is still the reference (the preempted copy recomputes), nothing leaks."""
    sched = make_scheduler(max_num_seqs=4, num_blocks=128)
    runner = fake_runner(4)
    for r in _copies(make_request, "big", 8, [5, 6, 7], 60):
        sched.add_request(r)
    done_at: dict[str, int] = {}

    def before_step(step: int) -> None:
        if step == 3:
            sched.add_request(make_request("late", [9, 8], 3))
        if step > 3:
            assert sched.num_running <= 4
        for rid in ("late",):
            if step > 3 and rid not in done_at and sched.get_request(rid) is None:
                done_at[rid] = step

    result = run_until_done(sched, runner, before_step=before_step)
    assert result.tokens["late"] == reference_output([9, 8], 3)
    assert done_at["late"] <= 3 + 6  # one step to free a seat, one to admit, three tokens
    assert sched.num_fair_share_preemptions == 1
    assert all(result.tokens[f"{i}_big"] == reference_output([5, 6, 7], 60) for i in range(8))
    assert sched.num_free_blocks == 128


def test_copies_use_every_seat_while_nobody_else_waits(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory
) -> None:
    sched = make_scheduler(max_num_seqs=4)
    runner = fake_runner(4)
    for r in _copies(make_request, "big", 6, [1, 2], 20):
        sched.add_request(r)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        assert sched.num_running == 4 and not out.preempted_req_ids
    assert sched.num_fair_share_preemptions == 0


def test_single_requests_keep_first_come_first_served(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory
) -> None:
    """A seat is taken only from copies: four single long requests keep their seats, a fifth waits its turn."""
    sched = make_scheduler(max_num_seqs=4)
    runner = fake_runner(4)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [i, 1], 30))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("r4", [4, 1], 3))
    for _ in range(5):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        assert not out.preempted_req_ids and sched.get_request("r4").status == RequestStatus.WAITING
    assert sched.num_fair_share_preemptions == 0


def test_a_second_request_with_copies_gets_a_seat_and_then_its_turn_first(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory,
    run_until_done: RunUntilDone, reference_output
) -> None:
    """Two users with 6 copies each on 4 seats: the second gets one seat at once (one copy of the first is
    preempted), and each seat that frees goes to the user holding fewer, so both run side by side."""
    sched = make_scheduler(max_num_seqs=4, num_blocks=128)
    runner = fake_runner(4)
    for r in _copies(make_request, "a", 6, [1, 2, 3], 12):
        sched.add_request(r)
    seen_both: list[bool] = []

    def before_step(step: int) -> None:
        if step == 2:
            for r in _copies(make_request, "b", 6, [4, 5], 12):
                sched.add_request(r)
        if step >= 4:
            users = {r.group_id for r in sched.running}
            seen_both.append(users == {"a", "b"})

    result = run_until_done(sched, runner, before_step=before_step)
    assert seen_both[0]  # b runs two steps after it arrived, long before a's copies are done
    assert sched.num_fair_share_preemptions == 1
    assert all(result.tokens[f"{i}_a"] == reference_output([1, 2, 3], 12) for i in range(6))
    assert all(result.tokens[f"{i}_b"] == reference_output([4, 5], 12) for i in range(6))
    assert sched.num_free_blocks == 128
