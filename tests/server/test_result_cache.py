"""The result cache in `loom serve` (loom/server/serving_result_cache.py) on the fake engine: zero wrong hits when
any key component changes, hits equal to fresh runs but for id and created, bypasses, nothing stored that failed."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from loom.router.result_cache import ResultCache
from tests.server.conftest import LiveServer, make_fake_front, serve, serve_app, wait_for

CHAT = [{"role": "user", "content": "hi"}]
HEADER = "x-loom-result-cache"
_ID_CREATED = re.compile(rb'"id": ?"(chatcmpl|cmpl)-[0-9a-f]{32}"|"created": ?\d+')

CHAT_BASE = {"messages": CHAT, "temperature": 0, "max_tokens": 6}
COMPLETION_BASE = {"prompt": "hello", "temperature": 0, "max_tokens": 6}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

# one change per key component, each against the base body (every sampling parameter and every other field that
# changes the answer's bytes)
COMMON_VARIANTS = [
    {"n": 2}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.1}, {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5}, {"logit_bias": {"100": 5}}, {"seed": 1}, {"temperature": 0.5, "seed": 1},
    {"max_tokens": 7}, {"min_tokens": 1}, {"stop": ["q"]}, {"stop_token_ids": [7]}, {"ignore_eos": True},
    {"include_stop_str_in_output": True}, {"prompt_logprobs": 0}, {"skip_special_tokens": False},
    {"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]+"}, {"stream": True},
    {"stream": True, "stream_options": {"include_usage": True}}, {"cache_salt": "tenant-b"}, {"user": "u2"},
    {"request_id": "abc"},
]
CHAT_VARIANTS = COMMON_VARIANTS + [
    {"messages": [{"role": "user", "content": "ho"}]}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 2},
    {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}, {"add_generation_prompt": False},
    {"max_tokens": None, "max_completion_tokens": 6},
]
COMPLETION_VARIANTS = COMMON_VARIANTS + [
    {"prompt": "hellp"}, {"prompt": ["hello", "hello"]}, {"echo": True}, {"logprobs": 0}, {"logprobs": 2},
    {"best_of": 2, "seed": 3}, {"prompt": [h + 3 for h in b"hello"]},
]


@pytest.fixture(scope="module")
def cached_server() -> Iterator[LiveServer]:
    front, _ = make_fake_front(step_delay_s=0.001, max_waiting_requests=64, max_model_len=1024, vocab_size=300)
    with serve(front, result_cache=ResultCache(max_entries=1000)) as live:
        yield live


@pytest.fixture()
def client(cached_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cached_server.base_url, timeout=30) as c:
        yield c


def _route(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def ask(client: httpx.Client, body: dict, **headers: str) -> httpx.Response:
    r = client.post(_route(body), json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def normalized(content: bytes) -> bytes:
    return _ID_CREATED.sub(b"", content)


@pytest.mark.parametrize("base,variants", [(CHAT_BASE, CHAT_VARIANTS), (COMPLETION_BASE, COMPLETION_VARIANTS)],
                         ids=["chat", "completion"])
def test_every_key_component_misses(client: httpx.Client, base: dict, variants: list[dict]) -> None:
    salt = {"cache_salt": f"run-{time.monotonic_ns()}"}  # a fresh tenant: nothing from other tests
    base = {**base, **salt}
    first = ask(client, base)
    assert first.headers[HEADER] == "miss"
    assert ask(client, base).headers[HEADER] == "hit"
    for change in variants:
        body = {**base, **change}
        r = ask(client, body)
        assert r.headers[HEADER] == "miss", change  # never the base's (or an earlier variant's) answer
        assert ask(client, body).headers[HEADER] == "hit", change  # it is cacheable: the key really differed
    for auth in ("Bearer key-a", "Bearer key-b"):  # the tenant's bearer token
        assert ask(client, base, authorization=auth).headers[HEADER] == "miss"
        assert ask(client, base, authorization=auth).headers[HEADER] == "hit"


def test_model_identity_is_part_of_the_key() -> None:
    cache = ResultCache(max_entries=100)  # one cache, two models of the same name
    front_a, fake_a = make_fake_front()
    front_b, fake_b = make_fake_front()
    fake_b.model_identity = dataclasses.replace(fake_a.model_identity, weights_sha256="1" * 64)
    try:
        with serve_app(front_a, result_cache=cache) as a, serve_app(front_b, result_cache=cache) as b:
            for live, expected in ((a, "miss"), (a, "hit"), (b, "miss"), (b, "hit")):
                with httpx.Client(base_url=live.base_url, timeout=30) as c:
                    assert ask(c, CHAT_BASE).headers[HEADER] == expected
            assert len(fake_b.added_prompts) == 1
    finally:
        front_a.shutdown()
        front_b.shutdown()


@pytest.mark.parametrize("body", [
    {**CHAT_BASE, "n": 2, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1},
    {**CHAT_BASE, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True},
    {**COMPLETION_BASE, "prompt": ["ab", "cd"], "echo": True, "logprobs": 1, "seed": 5, "temperature": 0.8},
    {**COMPLETION_BASE, "stream": True, "n": 2, "logprobs": 2, "stream_options": {"include_usage": True}},
], ids=["chat", "chat-stream", "completion", "completion-stream"])
def test_a_hit_is_a_fresh_run_but_for_id_and_created(client: httpx.Client, body: dict) -> None:
    body = {**body, "cache_salt": f"run-{time.monotonic_ns()}"}
    stored = ask(client, body)
    hit = ask(client, body)
    fresh = ask(client, body, **{"cache-control": "no-cache"})  # runs the engine again
    assert [r.headers[HEADER] for r in (stored, hit, fresh)] == ["miss", "hit", "bypass"]
    assert normalized(hit.content) == normalized(fresh.content) == normalized(stored.content)
    assert hit.content != stored.content  # a fresh id per response
    assert hit.headers["content-type"] == fresh.headers["content-type"]
    if body.get("stream"):
        ids = set(re.findall(rb'"id": "([^"]+)"', hit.content))
        assert len(ids) == 1 and ids != set(re.findall(rb'"id": "([^"]+)"', stored.content))  # one per stream


def test_non_deterministic_requests_are_never_cached(client: httpx.Client, cached_server: LiveServer) -> None:
    fake = cached_server.engine.engine
    before = len(fake.added_prompts)
    for body in ({**CHAT_BASE, "temperature": 0.7}, {"messages": CHAT, "max_tokens": 3},
                 {**COMPLETION_BASE, "temperature": 1.0, "seed": None}):
        for _ in range(2):
            assert ask(client, body).headers[HEADER] == "bypass"
    assert len(fake.added_prompts) == before + 6


def test_cache_control_bypasses(client: httpx.Client, cached_server: LiveServer) -> None:
    body = {**CHAT_BASE, "cache_salt": f"run-{time.monotonic_ns()}"}
    cache = cached_server.app.state.ctx.result_cache
    stores = cache.stats().stores
    assert ask(client, body, **{"cache-control": "no-store"}).headers[HEADER] == "bypass"
    assert cache.stats().stores == stores  # no-store: nothing kept
    assert ask(client, body, **{"cache-control": "no-cache"}).headers[HEADER] == "bypass"
    assert cache.stats().stores == stores + 1  # no-cache: not served from the cache, but the answer is kept
    assert ask(client, body).headers[HEADER] == "hit"
    assert ask(client, body, **{"cache-control": "no-store"}).headers[HEADER] == "bypass"
    metrics = client.get("/metrics").text
    for name in ("hits_total", "misses_total", "bypasses_total", "evictions_total", "entries", "bytes"):
        assert f"loom:result_cache_{name}{{" in metrics, name


def test_errors_and_cut_streams_are_not_stored() -> None:
    front, fake = make_fake_front(step_delay_s=0.01)
    cache = ResultCache(max_entries=100)
    with serve(front, result_cache=cache) as live, httpx.Client(base_url=live.base_url, timeout=30) as c:
        for stream in (False, True):
            body = {**CHAT_BASE, "stream": stream}
            fake.fail_next_step = True
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 if not stream else b'"finish_reason": "error"' in r.content, r.text
            assert cache.stats().stores == 0
        body = {**COMPLETION_BASE, "max_tokens": 60, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:  # the client leaves after the first event
            next(r.iter_lines())
        assert wait_for(lambda: not fake.reqs)  # the engine request was aborted
        time.sleep(0.05)
        assert cache.stats().stores == 0
        assert ask(c, body).headers[HEADER] == "miss"  # nothing was stored under its key
        assert cache.stats().stores == 1


def test_result_cache_options() -> None:
    import argparse

    from loom.server.cli import result_cache_of

    def ns(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"result_cache_size": 0, "result_cache_ttl": 600.0,
                                     "result_cache_max_bytes": 1 << 20, **kw})

    assert result_cache_of(ns()) is None
    cache = result_cache_of(ns(result_cache_size=5, result_cache_ttl=2.0))
    assert cache is not None and (cache.max_entries, cache.ttl_s, cache.max_bytes) == (5, 2.0, 1 << 20)
    for kw, name in (({"result_cache_size": -1}, "result_cache_size"), ({"result_cache_ttl": 0}, "result_cache_ttl"),
                     ({"result_cache_max_bytes": 0}, "result_cache_max_bytes")):
        with pytest.raises(ValueError, match=name):
            result_cache_of(ns(**kw))
