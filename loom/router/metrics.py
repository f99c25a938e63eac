"""The router's own Prometheus metrics (one registry per router app), prefixed `loom_router:`."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loom.router.policy import ReplicaState
from loom.router.result_cache import ResultCache

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


class RouterMetrics:
    """Per-replica requests and latency, routing decisions, retries, the cache-aware hit-rate estimate and the
    replicas' own state (health, load, prefix-cache hit rate as they report it on /load)."""

    def __init__(self, cache: ResultCache | None = None) -> None:
        r = self.registry = CollectorRegistry()
        if cache is not None:
            r.register(_ResultCacheCollector(cache))
        self.requests = Counter("loom_router:requests", "Requests answered, by replica and HTTP status.",
                                ["replica", "status"], registry=r)
        self.latency = Histogram("loom_router:request_latency_seconds",
                                 "Time from routing to the end of the replica's response (E2E), by replica.",
                                 ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("loom_router:time_to_first_byte_seconds",
                              "Time from routing to the first body bytes forwarded (streams: the first token).",
                              ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("loom_router:routing_decisions", "Routing decisions by policy and reason.",
                                 ["policy", "reason"], registry=r)
        self.model_selections = Counter("loom_router:model_selections",
                                        "Requests for the routing alias, by selector and chosen model.",
                                        ["selector", "model"], registry=r)
        self.retries = Counter("loom_router:retries", "Requests sent again to another replica, by cause.",
                               ["cause"], registry=r)
        self.failed_streams = Counter("loom_router:streams_failed",
                                      "Streams cut by a replica failure after tokens had been forwarded.",
                                      registry=r)
        self.routed_chars = Counter("loom_router:prompt_chars", "Prompt characters routed.", registry=r)
        self.matched_chars = Counter("loom_router:prefix_match_chars",
                                     "Prompt characters the chosen replica probably had cached (cache aware).",
                                     registry=r)
        self.hit_rate = Gauge("loom_router:prefix_hit_rate_estimate",
                              "prefix_match_chars / prompt_chars since start (cache aware's own estimate).",
                              registry=r)
        self.healthy = Gauge("loom_router:replica_healthy", "1 when the replica's last health check passed.",
                             ["replica"], registry=r)
        self.draining = Gauge("loom_router:replica_draining", "1 while the replica is draining.", ["replica"],
                              registry=r)
        self.in_flight = Gauge("loom_router:replica_in_flight", "Requests the router has open at the replica.",
                               ["replica"], registry=r)
        self.replica_hit_rate = Gauge("loom_router:replica_prefix_cache_hit_rate",
                                      "The replica's own prefix-cache hit rate (hits / queries from /load).",
                                      ["replica"], registry=r)
        self._routed = 0
        self._matched = 0

    def record_decision(self, policy: str, reason: str, prompt_chars: int, matched_chars: int) -> None:
        self.decisions.labels(policy, reason).inc()
        self._routed += prompt_chars
        self._matched += matched_chars
        self.routed_chars.inc(prompt_chars)
        self.matched_chars.inc(matched_chars)
        if self._routed:
            self.hit_rate.set(self._matched / self._routed)

    def observe_replicas(self, replicas: list[ReplicaState]) -> None:
        for r in replicas:
            self.healthy.labels(r.url).set(1.0 if r.healthy else 0.0)
            self.draining.labels(r.url).set(1.0 if r.draining else 0.0)
            self.in_flight.labels(r.url).set(r.in_flight)
            if r.prefix_cache_queries:
                self.replica_hit_rate.labels(r.url).set(r.prefix_cache_hits / r.prefix_cache_queries)

    def forget(self, url: str) -> None:
        """Drop a removed replica's labelled series."""
        for metric in (self.healthy, self.draining, self.in_flight, self.replica_hit_rate):
            try:
                metric.remove(url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ResultCacheCollector(Collector):
    """The router's result cache as `loom_router:result_cache_*`, read at scrape time."""

    def __init__(self, cache: ResultCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Any]:
        s = self._cache.stats()
        for name, value in (("hits", s.hits), ("misses", s.misses), ("bypasses", s.bypasses), ("stores", s.stores),
                            ("evictions", s.evictions), ("expirations", s.expirations)):
            yield CounterMetricFamily(f"loom_router:result_cache_{name}", f"Result cache {name} at the router.",
                                      value=value)
        for name, value in (("entries", s.entries), ("bytes", s.bytes)):
            yield GaugeMetricFamily(f"loom_router:result_cache_{name}", f"Result cache {name} held by the router.",
                                    value=value)


__all__ = ["RouterMetrics"]
