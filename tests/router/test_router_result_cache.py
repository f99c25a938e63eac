"""The router's result cache: a hit is what a fresh run returns (bar id and created), streamed or not; any change
of any key component misses; only deterministic, whole, successful answers are kept; Cache-Control opts out."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from loom.engine.model_identity import ModelIdentity
from tests.router.conftest import live_router
from tests.server.conftest import LiveServer, make_fake_front, serve

HEADER = "x-loom-router-result-cache"
BASE = {"model": "fake-model", "prompt": "the result cache", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def replica() -> Iterator[LiveServer]:
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front) as live:
        yield live


def _strip_ids(text: str) -> list[object]:
    """A body or the events of a stream, with each id and created removed."""
    def strip(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("id", "created")}
    if text.startswith("data: "):
        out: list[object] = []
        for line in text.split("\n"):
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else strip(json.loads(data)))
        return out
    return [strip(json.loads(text))]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", BASE),
    ("/v1/completions", {**BASE, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 5, "seed": 7, "temperature": 0.8}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 5, "temperature": 0, "stream": True, "logprobs": True,
                              "top_logprobs": 2}),
])
def test_a_hit_is_a_fresh_run_with_a_new_id(replica: LiveServer, path: str, body: dict) -> None:
    fresh = httpx.post(replica.base_url + path, json=body, timeout=30)
    with live_router([replica.base_url], result_cache_size=16) as (url, _):
        first = httpx.post(url + path, json=body, timeout=30)
        second = httpx.post(url + path, json=body, timeout=30)
    assert first.headers[HEADER] == "miss" and second.headers[HEADER] == "hit"
    assert _strip_ids(second.text) == _strip_ids(first.text) == _strip_ids(fresh.text)
    assert second.text != first.text  # a fresh id (and maybe created): never a replayed identity
    assert second.headers["content-type"].split(";")[0] == fresh.headers["content-type"].split(";")[0]


VARIANTS = [
    ("prompt", {"prompt": "the result cachf"}), ("max_tokens", {"max_tokens": 7}), ("stop", {"stop": ["x"]}),
    ("seed", {"seed": 1}), ("top_p", {"top_p": 0.9}), ("top_k", {"top_k": 5}), ("min_p", {"min_p": 0.1}),
    ("n", {"n": 2}), ("logprobs", {"logprobs": 1}), ("echo", {"echo": True}),
    ("presence_penalty", {"presence_penalty": 0.5}), ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.1}), ("logit_bias", {"logit_bias": {"50": 1.0}}),
    ("min_tokens", {"min_tokens": 1}), ("ignore_eos", {"ignore_eos": True}),
    ("stop_token_ids", {"stop_token_ids": [5]}), ("stream", {"stream": True}), ("cache_salt", {"cache_salt": "b"}),
    ("user", {"user": "someone"}), ("suffix", {"suffix": "!"}),
]


def test_changing_any_key_component_misses(replica: LiveServer) -> None:
    other_front, other_fake = make_fake_front(step_delay_s=0.001)
    other_fake.model_identity = ModelIdentity("fake-model", "2" * 64, "none", "float32", "float32", "0" * 64)
    with serve(other_front) as other, live_router([replica.base_url], policy="round_robin",
                                                  result_cache_size=256, health_interval_s=60) as (url, router):
        assert httpx.post(url + "/v1/completions", json=BASE, timeout=30).headers[HEADER] == "miss"
        assert httpx.post(url + "/v1/completions", json=BASE, timeout=30).headers[HEADER] == "hit"
        for name, change in VARIANTS:
            r = httpx.post(url + "/v1/completions", json={**BASE, **change}, timeout=30)
            assert r.headers.get(HEADER) == "miss", (name, r.status_code, r.text[:200])
        for auth in ("Bearer tenant-a", "Bearer tenant-b"):  # another tenant: the same body misses
            r = httpx.post(url + "/v1/completions", json=BASE, headers={"Authorization": auth}, timeout=30)
            assert r.headers[HEADER] == "miss", auth
        # another model version behind the same name: only that replica left, the same body misses
        httpx.post(url + "/router/add", json={"url": other.base_url}, timeout=10)
        httpx.post(url + "/router/drain", json={"url": replica.base_url}, timeout=10)
        r = httpx.post(url + "/v1/completions", json=BASE, timeout=30)
        assert r.headers["x-loom-replica"] == other.base_url and r.headers[HEADER] == "miss"
        assert router.cache is not None and router.cache.stats().hits == 1


def test_only_deterministic_whole_answers_are_kept_and_cache_control_opts_out(replica: LiveServer) -> None:
    with live_router([replica.base_url], result_cache_size=16) as (url, router):
        sampled = {**BASE, "temperature": 0.7}  # no seed: never cached
        for _ in range(2):
            assert httpx.post(url + "/v1/completions", json=sampled, timeout=30).headers[HEADER] == "bypass"
        invalid = {**BASE, "top_p": 5}  # a replica's 400 is not stored
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json=invalid, timeout=30)
            assert r.status_code == 400 and r.headers[HEADER] == "miss"
        body = {**BASE, "prompt": "cache control"}
        assert httpx.post(url + "/v1/completions", json=body, headers={"Cache-Control": "no-store"},
                          timeout=30).headers[HEADER] == "bypass"
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).headers[HEADER] == "miss"
        assert httpx.post(url + "/v1/completions", json=body, headers={"Cache-Control": "no-cache"},
                          timeout=30).headers[HEADER] == "bypass"  # fresh, and stored again
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).headers[HEADER] == "hit"
        metrics = httpx.get(url + "/metrics").text
        assert "loom_router:result_cache_hits_total 1.0" in metrics
        assert "loom_router:result_cache_bypasses_total 4.0" in metrics  # 2 sampled, no-store, no-cache
        assert router.cache is not None and router.cache.stats().stores == 2


def test_an_answer_from_another_model_than_the_router_knows_is_not_stored(replica: LiveServer) -> None:
    """A replica restarted at the same URL with other weights: until the next health check the router keys by the
    old identity; the replica's x-loom-model-identity header says otherwise, so nothing is stored."""
    with live_router([replica.base_url], result_cache_size=16, health_interval_s=60) as (url, router):
        state = router.replicas.get(replica.base_url)
        real = state.identity
        state.identity = "f" * 64  # what the router believed before the restart
        body = {**BASE, "prompt": "identity stamp"}
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.headers[HEADER] == "miss" and r.headers["x-loom-model-identity"] == real
        state.identity = real
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).headers[HEADER] == "miss"
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).headers[HEADER] == "hit"
