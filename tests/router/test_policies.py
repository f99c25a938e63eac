"""Replica policies: round robin, least load and cache aware (with its balance guard)."""

from __future__ import annotations

import pytest

from loom.router.policy import PolicyOptions, ReplicaState, RouteRequest, make_policy


def _req(text: str) -> RouteRequest:
    return RouteRequest("/v1/completions", "m", text, {"model": "m", "prompt": text})


def _fleet(n: int = 2) -> list[ReplicaState]:
    return [ReplicaState(f"http://127.0.0.1:{9000 + i}", ("m",), healthy=True) for i in range(n)]


def _route(policy, request: RouteRequest, fleet: list[ReplicaState]) -> ReplicaState:
    decision = policy.choose(request, fleet)
    policy.on_routed(request, decision.replica)
    return decision.replica


def test_round_robin_cycles_over_the_replicas() -> None:
    policy, fleet = make_policy("round_robin"), _fleet(3)
    urls = [_route(policy, _req("x"), fleet).url for _ in range(6)]
    assert urls == [r.url for r in fleet] * 2


def test_least_load_takes_the_emptiest_replica() -> None:
    policy, fleet = make_policy("least_load"), _fleet(3)
    fleet[0].in_flight, fleet[1].num_waiting, fleet[2].num_running = 3, 1, 2
    assert policy.choose(_req("x"), fleet).replica is fleet[1]
    fleet[1].in_flight = 5  # the router's own count wins when the replica's /load lags
    assert policy.choose(_req("x"), fleet).replica is fleet[2]


def test_cache_aware_keeps_a_shared_prefix_on_one_replica_and_spreads_new_ones() -> None:
    policy, fleet = make_policy("cache_aware"), _fleet(2)
    systems = [f"System prompt number {i}: " + "rules " * 50 for i in range(4)]
    homes: dict[int, set[str]] = {i: set() for i in range(4)}
    for user in range(5):
        for i, system in enumerate(systems):
            homes[i].add(_route(policy, _req(system + f"user {user} asks something"), fleet).url)
    assert all(len(urls) == 1 for urls in homes.values())  # each system prompt sticks to one replica
    assert {next(iter(u)) for u in homes.values()} == {r.url for r in fleet}  # and they are spread over both


def test_cache_aware_balance_guard_overrides_a_prefix_match() -> None:
    policy = make_policy("cache_aware", PolicyOptions(balance_abs_threshold=4, balance_rel_threshold=1.5))
    fleet = _fleet(2)
    text = "shared prefix " * 40
    home = _route(policy, _req(text + "a"), fleet)
    other = next(r for r in fleet if r is not home)
    assert policy.choose(_req(text + "b"), fleet).replica is home
    home.in_flight = 10  # 10 - 0 > 4 and 10 > 1.5 x 0: out of balance
    decision = policy.choose(_req(text + "c"), fleet)
    assert decision.replica is other and decision.reason == "balance"


def test_cache_aware_forgets_a_removed_replica() -> None:
    policy, fleet = make_policy("cache_aware"), _fleet(2)
    home = _route(policy, _req("p" * 100), fleet)
    policy.on_removed(home.url)
    assert home.url not in policy.trees


def test_unknown_policy_and_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        make_policy("random_walk")
    with pytest.raises(ValueError, match="cache_threshold"):
        PolicyOptions(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        PolicyOptions(balance_rel_threshold=0.5)
