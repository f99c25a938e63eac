"""Host KV tier in the scheduler: swap-mode preemption, evicted prefix blocks coming back, salts,
and block conservation under random traffic (fake paged runner; invariants after every step)."""

from __future__ import annotations

import random

from loom.config import CacheConfig, SchedulerConfig
from loom.core.offload import HostBlockTier
from loom.core.scheduler import Scheduler
from loom.request import RequestStatus
from tests.core.conftest import make_request, reference_output
from tests.kv.conftest import OffloadFakeRunner, run_with_checks


def make_sched(
    num_blocks: int,
    num_host_blocks: int = 0,
    preemption_mode: str = "recompute",
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
    block_size: int = 4,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16, max_model_len=256,
            preemption_mode=preemption_mode,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        num_host_blocks=num_host_blocks,
        sliding_window=sliding_window,
    )  # fmt: skip


def host(sched: Scheduler) -> HostBlockTier:
    tier = sched.kv_cache_manager.host
    assert tier is not None
    return tier


def _pressure_prompts() -> tuple[dict[str, list[int]], dict[str, int]]:
    prompts = {f"r{i}": [i % 2] + list(range(10 * i, 10 * i + 6)) for i in range(4)}
    max_tokens = {f"r{i}": 7 + i for i in range(4)}  # 14..17 tokens: 4-5 blocks each, 8 blocks in the pool
    return prompts, max_tokens


def _run_pressure(mode: str, num_host_blocks: int, enable_prefix_caching: bool) -> tuple[Scheduler, OffloadFakeRunner]:
    sched = make_sched(8, num_host_blocks, mode, max_num_batched_tokens=6, enable_prefix_caching=enable_prefix_caching)
    runner = OffloadFakeRunner(4)
    prompts, max_tokens = _pressure_prompts()
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens[rid]))
    tokens = run_with_checks(sched, runner)
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_output(prompt, max_tokens[rid]), rid
    assert sched.num_preemptions_total > 0
    assert sched.num_free_blocks == 8
    return sched, runner


def test_swap_preemption_resumes_identically_with_counted_restores_and_no_recompute() -> None:
    for caching in (True, False):
        swap, swap_runner = _run_pressure("swap", 32, caching)
        recompute, recompute_runner = _run_pressure("recompute", 0, caching)
        counters = swap.offload_counters
        assert counters.num_blocks_restored > 0 and counters.num_blocks_recomputed == 0
        assert counters.num_blocks_restored == swap_runner.restored
        assert counters.num_blocks_offloaded == swap_runner.offloaded
        assert recompute.offload_counters.num_blocks_recomputed > 0
        assert swap_runner.scheduled_tokens < recompute_runner.scheduled_tokens  # nothing was computed twice
        assert not host(swap)._swapped


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full() -> None:
    sched, _ = _run_pressure("swap", 1, False)
    assert sched.offload_counters.num_blocks_recomputed > 0


def _evict_then_reuse(salt_a: str | None, salt_b: str | None, num_host_blocks: int) -> tuple[Scheduler, OffloadFakeRunner, list[int]]:
    """Request a caches a 16-token prefix, other traffic evicts it from the 6-block pool, b reuses it."""
    sched = make_sched(6, num_host_blocks)
    runner = OffloadFakeRunner(4)
    prefix = list(range(500, 516))
    sched.add_request(make_request("a", prefix + [1], 2, cache_salt=salt_a))
    run_with_checks(sched, runner)
    for i in range(3):
        sched.add_request(make_request(f"x{i}", list(range(600 + 40 * i, 620 + 40 * i)), 2))
        run_with_checks(sched, runner)
    before = runner.scheduled_tokens
    b_prompt = prefix + [2, 3]
    sched.add_request(make_request("b", b_prompt, 4, cache_salt=salt_b))
    tokens = run_with_checks(sched, runner)
    assert tokens["b"] == reference_output(b_prompt, 4)
    assert sched.num_free_blocks == 6
    return sched, runner, [runner.scheduled_tokens - before]


def test_evicted_prefix_blocks_are_copied_back_from_the_host_tier() -> None:
    sched, runner, (b_tokens,) = _evict_then_reuse(None, None, 16)
    assert not sched.kv_cache_manager.block_pool.cached_block_hash_to_block.keys() & set()  # smoke
    assert sched.offload_counters.num_blocks_offloaded >= 4
    assert sched.offload_counters.num_blocks_restored == 4  # the four prefix blocks of b
    assert b_tokens == 18 + 4 - 1 - 16  # only the tail and the decode steps were computed
    _, _, (cold_tokens,) = _evict_then_reuse(None, None, 0)
    assert cold_tokens == 18 + 4 - 1


def test_cache_salt_isolates_device_and_host_hits() -> None:
    sched, _, (b_tokens,) = _evict_then_reuse("alice", "bob", 16)
    assert sched.offload_counters.num_blocks_restored == 0 and b_tokens == 18 + 4 - 1
    sched, _, (b_tokens,) = _evict_then_reuse("alice", "alice", 16)
    assert sched.offload_counters.num_blocks_restored == 4 and b_tokens == 18 + 4 - 1 - 16
    # Device tier: the same prompt under two salts shares nothing.
    sched = make_sched(32)
    runner = OffloadFakeRunner(4)
    sched.add_request(make_request("a", range(17), 1, cache_salt="alice"))
    run_with_checks(sched, runner)
    sched.add_request(make_request("b", range(17), 1, cache_salt="bob"))
    sched.add_request(make_request("c", range(17), 1, cache_salt="alice"))
    run_with_checks(sched, runner)
    assert sched.get_request("b") is None
    assert sched.prefix_cache_hits == 16  # c only


def test_random_traffic_with_aborts_swaps_and_offload_returns_every_block() -> None:
    rng = random.Random(7)
    for mode, num_host in (("swap", 12), ("swap", 3), ("recompute", 6)):
        sched = make_sched(10, num_host, mode, max_num_batched_tokens=rng.choice([5, 8, 13]))
        runner = OffloadFakeRunner(4)
        prompts: dict[str, list[int]] = {}
        max_tokens: dict[str, int] = {}
        aborted: set[str] = set()
        shared = [rng.randrange(900) for _ in range(8)]

        def before_step(step: int) -> None:
            for k in range(rng.randrange(3) if step < 60 else 0):
                rid = f"q{step}_{k}"
                tail = [rng.randrange(900) for _ in range(rng.randrange(1, 9))]
                prompts[rid] = (shared if rng.random() < 0.6 else []) + tail
                max_tokens[rid] = rng.randrange(1, 20)
                sched.add_request(make_request(rid, prompts[rid], max_tokens[rid]))
            live = [r for r in sched.requests if r not in aborted]
            if live and rng.random() < 0.08:
                victim = rng.choice(live)
                aborted.add(victim)
                sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)

        prompts["seed"], max_tokens["seed"] = shared + [1], 19
        sched.add_request(make_request("seed", prompts["seed"], max_tokens["seed"]))
        tokens = run_with_checks(sched, runner, before_step)
        for rid, prompt in prompts.items():
            if rid not in aborted:
                assert tokens[rid] == reference_output(prompt, max_tokens[rid]), (mode, rid)
        assert sched.num_free_blocks == 10 and sched.kv_cache_usage == 0.0
        tier = host(sched)
        assert not tier._swapped
        tier.check_invariants()
        assert sched.num_preemptions_total > 0, mode
        assert sched.offload_counters.num_blocks_offloaded > 0 and sched.offload_counters.num_blocks_restored > 0
