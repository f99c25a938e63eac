"""The result cache unit (loom/router/result_cache.py): LRU, TTL, byte bound, key, templates, completeness."""

from __future__ import annotations

import json

import pytest

from loom.router.result_cache import (
    CachedResponse, ResultCache, body_is_complete, body_is_deterministic, canonical_body, events_are_complete,
    parse_cache_control, request_key, tenant_of,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def body(text: str = "x") -> CachedResponse:
    return CachedResponse.of_body(json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 5,
                                              "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]},
                                             separators=(",", ":")).encode())


def test_lru_evicts_the_least_recently_used() -> None:
    cache = ResultCache(max_entries=2)
    cache.put("a", body("a"))
    cache.put("b", body("b"))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", body("c"))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    s = cache.stats()
    assert (s.hits, s.misses, s.stores, s.evictions, s.entries) == (3, 1, 3, 1, 2)
    cache.put("c", body("c2"))  # replacing keeps one entry
    assert len(cache) == 2 and b"c2" in cache.get("c").render_body("i", 1)


def test_ttl_with_an_injected_clock() -> None:
    clock = Clock()
    cache = ResultCache(max_entries=4, ttl_s=10.0, clock=clock)
    cache.put("a", body())
    clock.now += 9.99
    assert cache.get("a") is not None
    clock.now += 0.01
    assert cache.get("a") is None
    s = cache.stats()
    assert (s.hits, s.misses, s.expirations, s.entries, s.bytes) == (1, 1, 1, 0, 0)


def test_byte_bound() -> None:
    one = body("y" * 1000)
    per_entry = one.nbytes + len("k0") + 256
    cache = ResultCache(max_entries=100, max_bytes=2 * per_entry + 10)
    for i in range(3):
        assert cache.put(f"k{i}", one)
    assert len(cache) == 2 and cache.get("k0") is None and cache.stats().bytes == 2 * per_entry
    assert not cache.put("big", body("z" * 5000))  # larger than the whole cache: not stored, nothing evicted
    assert len(cache) == 2
    cache.clear()
    assert cache.stats().bytes == 0 and len(cache) == 0


@pytest.mark.parametrize("kwargs,param", [({"max_entries": 0}, "max_entries"), ({"max_entries": True}, "max_entries"),
                                          ({"max_bytes": 0}, "max_bytes"), ({"ttl_s": 0}, "ttl_s"),
                                          ({"ttl_s": float("nan")}, "ttl_s")])
def test_bad_bounds_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        ResultCache(**{"max_entries": 1, **kwargs})


def test_templates_take_a_fresh_id_and_created() -> None:
    raw = b'{"id":"chatcmpl-old","object":"chat.completion","created":123,"choices":[{"text":"\\"id\\":1"}]}'
    r = CachedResponse.of_body(raw)
    assert r.render_body('chatcmpl-n"ew', 999) == raw.replace(b"chatcmpl-old", b'chatcmpl-n\\"ew').replace(
        b"123", b"999")
    events = [b'data: {"id": "cmpl-old", "object": "text_completion", "created": 123, "choices": []}\n\n',
              b"data: [DONE]\n\n"]
    replayed = CachedResponse.of_events(events).render_events("cmpl-new", 7)
    assert replayed == [events[0].replace(b"cmpl-old", b"cmpl-new").replace(b"123", b"7"), events[1]]
    assert CachedResponse.of_body(b'{"other": 1}').render_body("x", 1) == b'{"other": 1}'  # no head: untouched


def test_cache_control() -> None:
    assert parse_cache_control(None) == parse_cache_control("max-age=60")
    assert (parse_cache_control(None).lookup, parse_cache_control(None).store) == (True, True)
    for header in ("no-cache", "No-Cache", "max-age=0", "private, no-cache"):
        assert (parse_cache_control(header).lookup, parse_cache_control(header).store) == (False, True), header
    for header in ("no-store", "no-cache, no-store"):
        assert (parse_cache_control(header).lookup, parse_cache_control(header).store) == (False, False), header


def test_determinism_of_a_body() -> None:
    assert body_is_deterministic({"temperature": 0}) and body_is_deterministic({"temperature": 0.0})
    assert body_is_deterministic({"temperature": 0.9, "seed": 1}) and body_is_deterministic({"seed": 0})
    assert body_is_deterministic({"use_beam_search": True})
    assert not body_is_deterministic({}) and not body_is_deterministic({"temperature": 0.3, "seed": None})


def test_key_varies_with_every_component() -> None:
    base = {"model_identity": "m" * 64, "route": "/v1/completions", "body": {"prompt": "x", "temperature": 0},
            "tenant": tenant_of(None, None), "prompt_token_ids": [[1, 2], [3]], "sampling_key": "{}"}
    variants = [{"model_identity": "n" * 64}, {"route": "/v1/chat/completions"},
                {"body": {"prompt": "x", "temperature": 0, "n": 2}}, {"tenant": tenant_of("Bearer a", None)},
                {"tenant": tenant_of(None, "salt")}, {"prompt_token_ids": [[1], [2, 3]]},
                {"prompt_token_ids": [[1, 2, 3]]}, {"prompt_token_ids": []}, {"sampling_key": '{"n":2}'}]
    keys = {request_key(**base)} | {request_key(**{**base, **v}) for v in variants}
    assert len(keys) == 1 + len(variants)
    # top-level order never matters; a nested object's order (a schema's properties) does
    assert request_key(**{**base, "body": {"temperature": 0, "prompt": "x"}}) == request_key(**base)
    a = {"response_format": {"schema": {"a": 1, "b": 2}}}
    b = {"response_format": {"schema": {"b": 2, "a": 1}}}
    assert canonical_body(a) != canonical_body(b)
    assert tenant_of("Bearer a", "s") != tenant_of("Bearer as", "") != tenant_of(None, None)
    with pytest.raises(ValueError, match="model_identity"):
        request_key(**{**base, "model_identity": ""})


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_only_whole_successful_responses_are_complete() -> None:
    ok = [_event({"choices": [{"index": 0, "finish_reason": None}]}),
          _event({"choices": [{"index": 0, "finish_reason": "stop"}]}), b"data: [DONE]\n\n"]
    assert events_are_complete(ok)
    assert not events_are_complete(ok[:-1])  # cut short
    assert not events_are_complete(ok[:1] + ok[2:])  # a choice never finished
    assert not events_are_complete([_event({"choices": [{"index": 0, "finish_reason": "error"}]}), ok[-1]])
    assert not events_are_complete([_event({"choices": [{"index": 0, "finish_reason": "abort"}]}), ok[-1]])
    assert not events_are_complete([_event({"error": {"message": "x"}}), ok[-1]])
    assert not events_are_complete([b"data: {not json\n\n", ok[-1]])
    assert body_is_complete(b'{"choices": [{"index": 0, "finish_reason": "length"}]}')
    assert not body_is_complete(b'{"error": {"message": "x"}}')
    assert not body_is_complete(b'{"choices": [{"index": 0, "finish_reason": "error"}]}')
    assert not body_is_complete(b"[1]")
