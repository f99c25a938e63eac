"""Hypothesis fuzzing of every endpoint of a live server on the real bundled model (issue 11's check): request
bodies over each route's schema, then poisoned with Unicode edge cases (lone surrogates sent both as JSON
\\ud800 escapes and as raw invalid UTF-8, in keys and in values; NUL, bidi and combining marks, long strings),
huge and non-finite numbers, wrong types and nested junk; sometimes truncated or not an object at all.

Every answer is below 500; every error is the OpenAI JSON shape with a message, naming a parameter the client
sent (or a missing required one) whenever the body was a readable JSON object; /health answers after each
example; and at the end no KV block is held and the scheduler's invariants hold.

Bounded for CI: derandomized (the same examples every run), fixed example counts, generation capped at a few
tokens (a poisoned max_tokens or n that happens to be valid is cut down), about 30 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, serve, wait_for

pytestmark = pytest.mark.slow

SERVED = "fuzz-model"  # the served model name
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])

# --- strategies -----------------------------------------------------------------------------------------------

_EDGE_STRINGS = [
    "\ud800", "\udfff", "a\ud83d", "\ude00b", "\ud83d\ude00",  # lone high/low surrogates; a valid pair
    "\x00", "a\x00b", "\u202e\u05d0\u05d1\u202c", "e\u0301\u0301\u0301", "\u200d\u200b\ufeff", "\uffff",
    "\U0010ffff", "\\", '"', "", " ", "\r\n", "<tool_call>", "<|im_end|>", "{{ messages }}", "{% raw %}",
]
_RAW = {"__BIGINT__": "9" * 5000, "__1E400__": "1e400", "__NEG0__": "-0", "__DEEP__": "[" * 3000 + "]" * 3000}

_nasty_text = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=()), max_size=10),  # surrogates included
    st.sampled_from(_EDGE_STRINGS),
    st.tuples(st.sampled_from(_EDGE_STRINGS[:6]), st.text(max_size=4)).map("".join),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u0301", "\ud800", "\u00e9 ", "\U0001f600"]),
              st.integers(1_000, 20_000)),  # long: past max_model_len, within the body limit
)
_nasty_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN / Infinity: Python's json writes and reads them
    st.sampled_from(list(_RAW)),  # spliced in raw after encoding: 5000 digits, 1e400, -0, 3000-deep nesting
)
_nasty_leaf = st.one_of(st.none(), st.booleans(), _nasty_number, _nasty_text)
_nasty_value = st.recursive(
    _nasty_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_nasty_text, inner, max_size=3)),
    max_leaves=6)


def _containers(obj: Any) -> list[Any]:
    """Every dict and list in `obj`, itself first."""
    out = []
    if isinstance(obj, (dict, list)):
        out.append(obj)
        for item in obj.values() if isinstance(obj, dict) else obj:
            out.extend(_containers(item))
    return out


@st.composite
def _poisoned(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> Any:
    """A body from `base` with 0-2 poisonings: a key added or renamed, or a value replaced, anywhere in it."""
    body = copy.deepcopy(draw(base))  # sampled_from and just hand out shared objects: never mutate those
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2]))):
        target = draw(st.sampled_from(_containers(body) or [None]))
        if isinstance(target, dict):
            action = draw(st.sampled_from(["add", "replace", "rename"] if target else ["add"]))
            if action == "add":
                target[draw(_nasty_text)] = draw(_nasty_value)
            else:
                key = draw(st.sampled_from(sorted(target)))
                if action == "replace":
                    target[key] = draw(_nasty_value)
                else:
                    target[draw(_nasty_text)] = target.pop(key)
        elif isinstance(target, list):
            if target and draw(st.booleans()):
                target[draw(st.integers(min_value=0, max_value=len(target) - 1))] = draw(_nasty_value)
            else:
                target.append(draw(_nasty_value))
        else:
            body = draw(_nasty_value)  # not a container at all
    return body


MAX_MODEL_LEN = 512  # of the fuzzed server

# (field, cap, limit): a value in (cap, limit] is valid and costly, so it becomes cap; past limit it is a cheap 400
_CAPS = (("max_tokens", 4, MAX_MODEL_LEN), ("max_completion_tokens", 4, MAX_MODEL_LEN), ("n", 3, 128),
         ("best_of", 3, 128), ("logprobs", 2, 20), ("top_logprobs", 2, 20), ("prompt_logprobs", 2, 20))


def _bounded(body: Any) -> Any:
    """Cut a generation length or copy count that poisoning made valid but large down to a few tokens."""
    if not isinstance(body, dict):
        return body
    for name, cap, limit in _CAPS:
        value = body.get(name)
        if type(value) is int and cap < value <= limit:
            body[name] = cap
    # no length at all (a key renamed away, or null) would generate up to max_model_len tokens
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 4
    if "prompt" in body and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = 4
    return body


VOCAB = 49_152  # the bundled model's vocabulary
_valid_text = st.one_of(st.text(max_size=10), st.sampled_from([t for t in _EDGE_STRINGS if t.isprintable() or t == ""]),
                        st.sampled_from(["\x00", "a\x00b", "\r\n", "\u202e\u05d0\u05d1\u202c", "e\u0301\u0301"]))
_token_id = st.integers(min_value=0, max_value=VOCAB - 1)
_unit = st.floats(min_value=0.01, max_value=1.0)
_penalty = st.floats(min_value=-2.0, max_value=2.0)

_COMMON: dict[str, st.SearchStrategy[Any]] = {  # valid values of every field both generation endpoints take
    "model": st.sampled_from([SERVED, None, "no-such-model"]),
    "n": st.integers(min_value=1, max_value=2),
    "temperature": st.floats(min_value=0.0, max_value=2.0),
    "top_p": _unit, "top_k": st.integers(min_value=-1, max_value=50), "min_p": st.floats(min_value=0.0, max_value=1.0),
    "presence_penalty": _penalty, "frequency_penalty": _penalty,
    "repetition_penalty": st.floats(min_value=0.5, max_value=2.0),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "logit_bias": st.dictionaries(_token_id.map(str), st.floats(min_value=-100, max_value=100), max_size=2),
    "stop_token_ids": st.lists(_token_id, max_size=2),
    "min_tokens": st.integers(min_value=0, max_value=1),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "cache_salt": _valid_text, "user": _valid_text, "request_id": _valid_text,
    "store": st.booleans(), "metadata": st.dictionaries(_valid_text, _valid_text, max_size=2),
    "service_tier": st.sampled_from(["auto", "default"]),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "prompt_logprobs": st.integers(min_value=0, max_value=2),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 10**30}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}]),
    "guided_json": st.sampled_from([{"type": "integer"}, '{"type": "string", "maxLength": 3}', "{nope"]),
    "guided_choice": st.lists(st.text(max_size=3), max_size=2),
    "guided_regex": st.sampled_from(["[0-9]+", "((", "a*", ""]),
    "guided_grammar": st.sampled_from(['start: "a" | "b"', "start: (", ""]),
    "structured_outputs": st.sampled_from([{"choice": ["a"]}, {"json_object": True}, {"nope": 1}]),
}

_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                           "content": _valid_text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": _valid_text}),
        max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(), "tool_calls": st.lists(
        st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"),
                               "function": st.fixed_dictionaries({
                                   "name": st.sampled_from(["f", "g"]),
                                   "arguments": st.sampled_from(['{"a": 1}', "{}", '{"a": NaN}', '{"\\ud800": 1}',
                                                                 "[1]", "{x", ""])})}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.sampled_from(["c1", "c2", "zz"]),
                           "content": _valid_text}),
)
_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "f", "bad name"])},
    optional={"description": _valid_text, "parameters": st.sampled_from([
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object"}, {"type": "string"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}])})})
_TEMPLATE = {
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "messages", "x"]),
                                            st.booleans(), max_size=2),
}
_CHAT = {
    **_COMMON, **_TEMPLATE,
    "max_tokens": st.integers(min_value=0, max_value=3),
    "logprobs": st.booleans(), "top_logprobs": st.integers(min_value=0, max_value=2),
    "tools": st.lists(_tool, min_size=1, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})})),
    "parallel_tool_calls": st.booleans(),
}
_COMPLETION = {
    **_COMMON,
    "echo": st.booleans(), "logprobs": st.integers(min_value=0, max_value=2), "suffix": _valid_text,
    "best_of": st.integers(min_value=1, max_value=3),
}
_prompt = st.one_of(_valid_text, st.lists(_valid_text, min_size=1, max_size=2),
                    st.lists(_token_id, min_size=1, max_size=6),
                    st.lists(st.lists(_token_id, min_size=1, max_size=3), min_size=1, max_size=2))


@st.composite
def _body(draw: st.DrawFn, required: dict[str, st.SearchStrategy[Any]],
          optional: dict[str, st.SearchStrategy[Any]], most: int = 4) -> dict[str, Any]:
    """The required fields and up to `most` optional ones, all with valid values (their combination may still be
    refused: two structured-output fields, prompt_logprobs with stream, ...)."""
    body = {name: draw(s) for name, s in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=most, unique=True)):
        body[name] = draw(optional[name])
    return body


def _completion() -> st.SearchStrategy[dict[str, Any]]:
    return _body({"prompt": _prompt, "max_tokens": st.integers(min_value=0, max_value=3)}, _COMPLETION)


def _chat() -> st.SearchStrategy[dict[str, Any]]:
    return _body({"messages": st.lists(_message, min_size=1, max_size=3),
                  "max_completion_tokens": st.integers(min_value=0, max_value=3)}, _CHAT)


def _tokenize() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        _body({"prompt": _valid_text}, {"add_special_tokens": st.booleans(), "model": _COMMON["model"]}),
        _body({"messages": st.lists(_message, min_size=1, max_size=2)}, {**_TEMPLATE, "model": _COMMON["model"]}),
        _body({}, {"prompt": _valid_text, "messages": st.lists(_message, max_size=1)}))  # neither or both


def _detokenize() -> st.SearchStrategy[dict[str, Any]]:
    return _body({"tokens": st.lists(_token_id, max_size=6)}, {"model": _COMMON["model"]})


@dataclass(slots=True)
class _Sent:
    body: Any  # the Python value sent
    wire: bytes  # what went over the wire
    readable: bool  # a well-formed JSON object of valid Unicode text (its errors must name a parameter)


@st.composite
def _encoded(draw: st.DrawFn, bodies: st.SearchStrategy[Any]) -> _Sent:
    body = _bounded(draw(_poisoned(bodies)))
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))  # True: \ud800 escapes; False: raw surrogates
    spliced = any(json.dumps(marker) in text for marker in _RAW)  # numbers or nesting Python's json refuses
    for marker, raw in _RAW.items():
        text = text.replace(json.dumps(marker), raw)
    wire = text.encode("utf-8", "surrogatepass")  # a raw surrogate becomes invalid UTF-8
    how = draw(st.sampled_from(["whole"] * 8 + ["truncated"]))
    if how == "truncated" and len(wire) > 1:
        wire = wire[:draw(st.integers(min_value=0, max_value=len(wire) - 1))]
    try:
        readable = how == "whole" and isinstance(body, dict) and not spliced
        wire.decode("utf-8")
    except UnicodeDecodeError:
        readable = False
    return _Sent(body, wire, readable)


# --- the server and the checks ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Fuzz:
    live: LiveServer
    client: httpx.Client
    free_blocks_at_start: int  # KV blocks free before any fuzzing


@pytest.fixture(scope="module")
def fuzz() -> Iterator[_Fuzz]:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=16))
    front = AsyncLLMEngine(engine)
    front.start()
    with serve(front, served_model_name=SERVED) as live, httpx.Client(base_url=live.base_url, timeout=60) as client:
        yield _Fuzz(live, client, _engine(live, lambda e: e.get_stats().num_free_blocks))


def _engine(live: LiveServer, fn: Any) -> Any:
    return asyncio.run(live.engine.call(fn))


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "prompt",
            "/detokenize": "tokens"}


def _post(f: _Fuzz, path: str, sent: _Sent) -> None:
    r = f.client.post(path, content=sent.wire, headers={"content-type": "application/json"})
    _check(r, path, sent)
    assert f.client.get("/health").status_code == 200


def _check(r: httpx.Response, path: str, sent: _Sent) -> None:
    where = (path, sent.wire[:300], r.status_code, r.text[:300])
    assert r.status_code < 500, where
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n"), where
        return
    assert r.headers["content-type"].startswith("application/json"), where
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"], where
    if sent.readable and r.status_code in (400, 404):
        # the keys as the server reads them: "\\ud800\\udc00" in JSON is one character, U+10000
        keys = {_escaped(k) for k in json.loads(sent.wire)} | {REQUIRED[path]}
        assert err["param"] in keys, where  # a readable object's error names what the client sent


@settings(FUZZ, max_examples=160)
@given(sent=_encoded(_completion()))
def test_completions(fuzz: _Fuzz, sent: _Sent) -> None:
    _post(fuzz, "/v1/completions", sent)


@settings(FUZZ, max_examples=200)
@given(sent=_encoded(_chat()))
def test_chat_completions(fuzz: _Fuzz, sent: _Sent) -> None:
    _post(fuzz, "/v1/chat/completions", sent)


@settings(FUZZ, max_examples=80)
@given(sent=_encoded(_tokenize()))
def test_tokenize(fuzz: _Fuzz, sent: _Sent) -> None:
    _post(fuzz, "/tokenize", sent)


@settings(FUZZ, max_examples=40)
@given(sent=_encoded(_detokenize()))
def test_detokenize(fuzz: _Fuzz, sent: _Sent) -> None:
    _post(fuzz, "/detokenize", sent)


@settings(FUZZ, max_examples=40)
@given(model_id=_nasty_text, method=st.sampled_from(["GET", "POST", "DELETE"]))
def test_models_and_the_other_routes(fuzz: _Fuzz, model_id: str, method: str) -> None:
    # at most 1,000 characters (up to 12 kB escaped): a request head past h11's 16 kB is refused by uvicorn itself
    path = "/v1/models/" + urllib.parse.quote(model_id[:1000].encode("utf-8", "surrogatepass"), safe="")
    for p in (path, "/v1/models", "/version", "/tokenizer_info"):
        r = fuzz.client.request(method, p)
        assert r.status_code < 500, (method, p, r.text[:200])
        if r.status_code != 200:
            assert r.json()["error"]["message"]


def test_no_block_leaks_and_the_invariants_hold_after_the_fuzz(fuzz: _Fuzz) -> None:
    """Last in the module: every request above has ended, so every KV block is back in the pool."""
    live = fuzz.live
    assert wait_for(lambda: _engine(live, lambda e: e.get_stats().num_running + e.get_stats().num_waiting) == 0, 30)
    assert wait_for(lambda: _engine(live, lambda e: e.get_stats().num_free_blocks) == fuzz.free_blocks_at_start, 10)
    _engine(live, lambda e: e.scheduler.check_invariants())
    r = fuzz.client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
