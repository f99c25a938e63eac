"""Scheduler under memory pressure: preemption, eviction, random traffic; outputs must not change."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import pytest

from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus

MakeRequest = Callable[..., Request]
MakeScheduler = Callable[..., Scheduler]
FakeRunnerFactory = Callable[[int], Any]  # block_size -> conftest.FakeRunner
RunUntilDone = Callable[..., Any]  # conftest.run_until_done
ReferenceOutput = Callable[[list[int], int], list[int]]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_len", range(3, 10))
def test_preemption_around_block_boundaries(
    make_request: MakeRequest,
    make_scheduler: MakeScheduler,
    fake_runner: FakeRunnerFactory,
    run_until_done: RunUntilDone,
    reference_output: ReferenceOutput,
    prompt_len: int,
    enable_prefix_caching: bool,
) -> None:
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=6, enable_prefix_caching=enable_prefix_caching)
    prompts = {f"r{i}": [i % 2] + list(range(10 * i, 10 * i + prompt_len - 1)) for i in range(4)}
    max_tokens = {f"r{i}": 13 - prompt_len + i for i in range(4)}  # reach 13..16 tokens: 4 blocks each
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens[rid]))
    result = run_until_done(sched, fake_runner(4))
    for rid, prompt in prompts.items():
        assert result.tokens[rid] == reference_output(prompt, max_tokens[rid]), rid
    assert sched.num_preemptions_total > 0
    assert sched.num_free_blocks == 8 and sched.kv_cache_usage == 0.0


def test_the_most_recently_admitted_request_is_preempted(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner
) -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    runner = fake_runner(4)
    for rid in ("old", "mid", "new"):
        sched.add_request(make_request(rid, range(4), 8))  # one full block each, then decode
    preempted: list[str] = []
    while not preempted:
        out = sched.schedule()
        preempted = out.preempted_req_ids
        sched.update_from_output(out, runner.execute(out))
    assert preempted == ["new"]
    assert [r.request_id for r in sched.running] == ["old", "mid"]
    assert sched.waiting[0].request_id == "new" and sched.waiting[0].status.value == "preempted"
    assert sched.waiting[0].num_preemptions == 1 and sched.waiting[0].num_computed_tokens == 0


def test_preempted_request_resumes_with_prompt_logprobs_sent_once(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, reference_output
) -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=5)
    runner = fake_runner(4)
    sched.add_request(make_request("a", range(100, 107), 12))
    sched.add_request(make_request("b", range(7), 12, prompt_logprobs=1, logprobs=0))
    prompt_positions: list[float] = []
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.check_invariants()
        for core_out in sched.update_from_output(out, runner.execute(out)):
            tokens[core_out.request_id].extend(core_out.new_token_ids)
            if core_out.request_id == "b":
                prompt_positions.extend(lp.logprobs[0] for lp in core_out.new_prompt_logprobs or [])
                assert len(core_out.new_logprobs or []) == len(core_out.new_token_ids)
    assert sched.get_request("b") is None
    assert sched.num_preemptions_total > 0
    assert prompt_positions == [-float(p) for p in range(1, 7)]
    assert tokens == {"a": reference_output(list(range(100, 107)), 12), "b": reference_output(list(range(7)), 12)}


def test_waiting_request_whose_cached_prefix_is_evicted(
    make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    outputs = []
    for enable in (True, False):
        sched = make_scheduler(num_blocks=6, max_num_seqs=1, enable_prefix_caching=enable)
        runner = fake_runner(4)
        shared = list(range(50, 62))
        sched.add_request(make_request("first", shared + [1], 3))
        sched.add_request(make_request("hog", range(200, 219), 5))  # 24 tokens: every block
        sched.add_request(make_request("again", shared + [2], 3))
        outputs.append(run_until_done(sched, runner).tokens)
        if enable:
            assert sched.prefix_cache_hits == 0  # "again" looked up only after the hog evicted "first"
    assert outputs[0] == outputs[1]
    assert outputs[0]["again"] == reference_output(shared + [2], 3)


@dataclass(slots=True)
class Traffic:
    tokens: dict[str, list[int]]  # request_id -> generated token ids
    finish_reasons: dict[str, str]  # request_id -> finish reason reported by the core
    scheduler: Scheduler
    requests: list[Request]  # every request sent
    aborted: set[str]  # ids aborted from outside at some step (before or after they arrived)


def _random_traffic(seed: int, enable_prefix_caching: bool, make_request: MakeRequest, make_scheduler: MakeScheduler,
                    fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone) -> Traffic:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=24, max_num_batched_tokens=rng.choice([7, 16, 32]), max_num_seqs=6,
        enable_prefix_caching=enable_prefix_caching,
    )
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    traffic = Traffic(tokens={}, finish_reasons={}, scheduler=sched, requests=[], aborted=set())
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i in range(30):
        prompt = rng.choice(bases) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        request = make_request(f"r{i}", prompt, rng.randrange(0, 20), cache_salt=rng.choice([None, None, "s"]))
        traffic.requests.append(request)
        arrivals.setdefault(rng.randrange(40), []).append(request)
        if rng.random() < 0.2:
            aborts.setdefault(rng.randrange(60), []).append(request.request_id)
            traffic.aborted.add(request.request_id)

    def before_step(step: int) -> None:
        for request in arrivals.pop(step, []):
            sched.add_request(request)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)

    sched.add_request(make_request("seed", bases[0] + [1], 4))
    runs = [run_until_done(sched, fake_runner(4), before_step=before_step)]
    while arrivals:  # requests arriving after the engine went idle
        for request in arrivals.pop(min(arrivals)):
            sched.add_request(request)
        runs.append(run_until_done(sched, fake_runner(4)))
    for run in runs:
        traffic.tokens.update(run.tokens)
        traffic.finish_reasons.update(run.finish_reasons)
    return traffic


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_prefix_cache_on_and_off_agree(
    seed: int, make_request: MakeRequest, make_scheduler: MakeScheduler, fake_runner: FakeRunnerFactory, run_until_done: RunUntilDone, reference_output
) -> None:
    on = _random_traffic(seed, True, make_request, make_scheduler, fake_runner, run_until_done)
    off = _random_traffic(seed, False, make_request, make_scheduler, fake_runner, run_until_done)
    for traffic in (on, off):
        assert traffic.scheduler.num_free_blocks == 24 and not traffic.scheduler.has_unfinished_requests()
    assert on.scheduler.prefix_cache_hits > 0 and off.scheduler.prefix_cache_hits == 0
    for request in on.requests:
        rid = request.request_id
        expected = reference_output(request.prompt_token_ids, request.max_tokens)
        for traffic in (on, off):
            got = traffic.tokens.get(rid, [])
            if rid in traffic.finish_reasons:
                assert traffic.finish_reasons[rid] == "length" and got == expected, rid
            else:  # aborted from outside: the core reports nothing, the engine does
                assert rid in traffic.aborted and got == expected[: len(got)], rid
        if rid not in on.aborted:
            assert on.tokens.get(rid, []) == off.tokens.get(rid, [])
