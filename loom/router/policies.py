"""The built-in replica policies: round robin, least load, cache aware (registered in loom.router.policy).

Cache aware follows the design of SGLang's router (facts, our code): route to the replica whose remembered
prompts share the longest prefix with this one when that prefix covers at least `cache_threshold` of it,
otherwise to the replica that remembers the least (the most room to cache this new prefix); and when the
load is badly out of balance (max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x min),
to the least loaded replica instead, so a hot prefix cannot pile every request onto one replica.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from loom.router.policy import PolicyOptions, ReplicaState, RouteDecision, RouteRequest, register_policy
from loom.router.prefix_tree import PrefixTree


def _least_loaded(candidates: Sequence[ReplicaState]) -> ReplicaState:
    """Fewest requests, then least KV in use, then URL (deterministic ties)."""
    return min(candidates, key=lambda r: (r.load, r.kv_cache_usage, r.url))


class RoundRobin:
    """Each request to the next replica in URL order."""

    name = "round_robin"

    def __init__(self, options: PolicyOptions) -> None:
        self._next = 0  # requests routed so far

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaState]) -> RouteDecision:
        ordered = sorted(candidates, key=lambda r: r.url)
        replica = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(replica, "round_robin")

    def on_routed(self, request: RouteRequest, replica: ReplicaState) -> None:
        pass

    def on_removed(self, replica_url: str) -> None:
        pass


class LeastLoad:
    """The replica with the fewest requests (its own queue and running counts, or the router's in-flight
    count when larger: the replica's /load lags by one health check), then the least KV cache in use."""

    name = "least_load"

    def __init__(self, options: PolicyOptions) -> None:
        pass

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaState]) -> RouteDecision:
        return RouteDecision(_least_loaded(candidates), "least_load")

    def on_routed(self, request: RouteRequest, replica: ReplicaState) -> None:
        pass

    def on_removed(self, replica_url: str) -> None:
        pass


class CacheAware:
    """Longest remembered prefix (one PrefixTree per replica), under a load-balance guard."""

    name = "cache_aware"

    def __init__(self, options: PolicyOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self.trees: dict[str, PrefixTree] = {}  # replica URL -> what was routed there

    def _tree(self, url: str) -> PrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = PrefixTree(self.options.max_tree_chars)
        return tree

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaState]) -> RouteDecision:
        loads = [r.load for r in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.options.balance_abs_threshold and hi > self.options.balance_rel_threshold * lo:
            return RouteDecision(_least_loaded(candidates), "balance")
        text = request.text[:self.options.max_prefix_chars]  # a prefix decides; a huge prompt cannot stall us
        matches = {r.url: self._tree(r.url).match(text) for r in candidates}
        # the longest match; among equals the least loaded (a fresh prompt spreads, a shared one sticks)
        best = max(candidates, key=lambda r: (matches[r.url], -r.load, -r.kv_cache_usage, r.url))
        if text and matches[best.url] >= self.options.cache_threshold * len(text):
            return RouteDecision(best, "prefix_match", matches[best.url])
        roomiest = min(candidates, key=lambda r: (self._tree(r.url).num_chars, r.load, r.url))
        return RouteDecision(roomiest, "smallest_tree", matches[roomiest.url])

    def on_routed(self, request: RouteRequest, replica: ReplicaState) -> None:
        if request.text:
            self._tree(replica.url).insert(request.text[:self.options.max_prefix_chars], self._clock())

    def on_removed(self, replica_url: str) -> None:
        self.trees.pop(replica_url, None)


register_policy(RoundRobin.name, RoundRobin)
register_policy(LeastLoad.name, LeastLoad)
register_policy(CacheAware.name, CacheAware)

__all__ = ["CacheAware", "LeastLoad", "RoundRobin"]
