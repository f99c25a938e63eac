"""Host offload tier counters (EngineStats.num_blocks_offloaded/_restored/_recomputed) in /metrics."""

from __future__ import annotations

import re

import httpx

from loom.server.metrics import ServerMetrics
from tests.server.conftest import make_fake_front, serve, wait_for
from tests.server.fake_engine import FakeStats

NAMES = ("kv_blocks_offloaded_total", "kv_blocks_restored_total", "kv_blocks_recomputed_total")


def _value(text: str, name: str) -> float:
    match = re.search(rf'^loom:{name}{{model_name="fake-model"}} (\S+)$', text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def _stats(offloaded: int, restored: int, recomputed: int) -> FakeStats:
    return FakeStats(0, 0, 0.0, 8, 8, 0, 0, 0, offloaded, restored, recomputed)


def test_counters_advance_by_the_engine_deltas() -> None:
    metrics = ServerMetrics("fake-model")
    text = metrics.render().decode()
    assert [_value(text, n) for n in NAMES] == [0.0, 0.0, 0.0]
    for cumulative in ((3, 0, 1), (3, 2, 1), (7, 2, 4), (7, 2, 4)):  # cumulative engine counts per step
        metrics.on_step([], _stats(*cumulative), now=0.0)
        text = metrics.render().decode()
        assert [_value(text, n) for n in NAMES] == [float(c) for c in cumulative]


def test_stats_without_the_offload_fields_leave_the_counters_at_zero() -> None:
    class OldStats:  # an engine that predates the host tier
        num_running, num_waiting, kv_cache_usage = 0, 0, 0.0
        prefix_cache_queries, prefix_cache_hits = 0, 0

    metrics = ServerMetrics("fake-model")
    metrics.on_step([], OldStats(), now=0.0)
    assert [_value(metrics.render().decode(), n) for n in NAMES] == [0.0, 0.0, 0.0]


def test_live_server_exposes_the_engine_counters() -> None:
    front, fake = make_fake_front(step_delay_s=0.002)
    fake.offload_counters = [5, 3, 2]
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
        assert wait_for(lambda: _value(client.get("/metrics").text, NAMES[0]) == 5.0)
        text = client.get("/metrics").text
        assert [_value(text, n) for n in NAMES] == [5.0, 3.0, 2.0]
