"""The official `openai` client against a live server on the real bundled model (127.0.0.1, one module-wide server).

Bounded for 2 CPU cores: small max_tokens, 60 fuzz examples, 32 concurrent streams of 16 tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, serve, serve_app, wait_for
from tests.server.fuzz_bodies import chat_bodies, completion_bodies, resolve_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.llm_engine import LLMEngine

    # float32: greedy batch invariance is a float32 promise (bf16 GEMMs round differently by batch shape).
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", quantization="none", max_model_len=512, max_num_seqs=32, max_waiting_requests=64))
    front = AsyncLLMEngine(engine)
    front.start()
    with serve(front) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def _model(live: LiveServer) -> str:
    return live.engine.model_name


def test_chat_usage_is_exact(oai: "openai.OpenAI", live: LiveServer) -> None:
    r = oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    with httpx.Client(base_url=live.base_url) as c:
        n_prompt = c.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens <= 8 and r.usage.total_tokens == n_prompt + r.usage.completion_tokens


def test_streaming_chat_equals_non_streaming(oai: "openai.OpenAI", live: LiveServer) -> None:
    kw = dict(model=_model(live), messages=CHAT, max_tokens=12, temperature=0)
    full = oai.chat.completions.create(**kw)
    text, finish, usage = "", None, None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(oai: "openai.OpenAI", live: LiveServer) -> None:
    r = oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for pos in content:
        assert len(pos.top_logprobs) == 3 and pos.logprob <= 0
        assert pos.top_logprobs[0].logprob >= pos.top_logprobs[-1].logprob
        assert pos.token == pos.top_logprobs[0].token  # greedy picks the most likely token


def test_completion_logprobs_and_echo(oai: "openai.OpenAI", live: LiveServer) -> None:
    prompt = "The capital of France is"
    r = oai.completions.create(model=_model(live), prompt=prompt, max_tokens=4, temperature=0, echo=True,
                               logprobs=2)
    ch = r.choices[0]
    assert ch.text.startswith(prompt)
    lp = ch.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text


def test_n_greater_than_one(oai: "openai.OpenAI", live: LiveServer) -> None:
    kw = dict(model=_model(live), prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, n=3)
    r = oai.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 18
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: set[int] = set()
    for chunk in oai.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert streamed == {c.index: c.text for c in r.choices}  # same seed, same samples


def test_stop_strings(oai: "openai.OpenAI", live: LiveServer) -> None:
    kw = dict(model=_model(live), prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = oai.completions.create(**kw).choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = oai.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    r = oai.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[: text.index(stop) + len(stop)]


def test_errors_through_the_client(oai: "openai.OpenAI", live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(live), prompt="x", top_p=1.5)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(live), prompt="hello " * 600, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(live), prompt=[1, live.engine.vocab_size])
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(live), prompt="x", suffix="y")
    assert e.value.body["param"] == "suffix"
    assert [m.id for m in oai.models.list().data] == [_model(live)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(kind=st.booleans(), completion=completion_bodies(), chat=chat_bodies())
def test_fuzz_never_5xx(live: LiveServer, kind: bool, completion: dict, chat: dict) -> None:
    path, body = ("/v1/completions", completion) if kind else ("/v1/chat/completions", chat)
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        r = c.post(path, json=resolve_model(body, _model(live)))
        assert r.status_code < 500, (path, body, r.text)
        assert c.get("/health").status_code == 200


def _free_blocks(live: LiveServer) -> int:
    return asyncio.run(live.engine.call(lambda e: e.get_stats().num_free_blocks))


def _raw_post(live: LiveServer, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", int(live.base_url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_blocks(live: LiveServer, stream: bool) -> None:
    assert wait_for(lambda: asyncio.run(live.engine.call(lambda e: e.get_stats().num_running)) == 0, 30)
    start = _free_blocks(live)
    aborts = _abort_count(live)
    sock = _raw_post(live, {"model": _model(live), "prompt": "Tell me a long story. " * 20, "max_tokens": 300,
                            "temperature": 0, "stream": stream})
    assert wait_for(lambda: _free_blocks(live) < start, 30)
    sock.close()
    t0 = time.monotonic()
    assert wait_for(lambda: _free_blocks(live) == start, 10)
    assert time.monotonic() - t0 < 5
    with httpx.Client(base_url=live.base_url) as c:
        assert c.get("/health").status_code == 200
    assert wait_for(lambda: _abort_count(live) == aborts + 1, 5)  # counted once, not again by the engine
    time.sleep(0.5)
    assert _abort_count(live) == aborts + 1


def _abort_count(live: LiveServer) -> float:
    with httpx.Client(base_url=live.base_url) as c:
        text = c.get("/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("loom:request_success_total{") and 'finished_reason="abort"' in x]
    return sum(float(x.split()[-1]) for x in lines)


def test_32_concurrent_streams_match_sequential_runs(live: LiveServer) -> None:
    prompts = [f"Fact {i}: the number {i * 7} is" for i in range(32)]
    client = openai.AsyncOpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=300)

    async def one(prompt: str, stream: bool) -> str:
        kw = dict(model=_model(live), prompt=prompt, max_tokens=16, temperature=0)
        if not stream:
            return (await client.completions.create(**kw)).choices[0].text
        text = ""
        async for chunk in await client.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                text += ch.text
        return text

    async def go() -> tuple[list[str], list[str]]:
        alone = [await one(p, False) for p in prompts]
        together = await asyncio.gather(*(one(p, True) for p in prompts))
        await client.close()
        return alone, list(together)

    alone, together = asyncio.run(go())
    assert together == alone


def test_metrics_after_traffic(live: LiveServer) -> None:
    name = _model(live)
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        text = c.get("/metrics").text
    for metric in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                   "inter_token_latency_seconds_count", "request_queue_time_seconds_count"):
        line = next(x for x in text.splitlines() if x.startswith(f'loom:{metric}{{model_name="{name}"}}'))
        assert float(line.split()[-1]) > 0, line
    assert f'loom:kv_cache_usage_perc{{model_name="{name}"}}' in text
    assert "loom:request_success_total{" in text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Give me a person with a name and an age, as JSON."}]


def test_response_format_json_schema_streamed_and_not(oai: "openai.OpenAI", live: LiveServer) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(model=_model(live), messages=ASK_PERSON, max_tokens=80, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    text = "".join(ch.delta.content or "" for chunk in oai.chat.completions.create(**kw, stream=True)
                   for ch in chunk.choices)
    assert text == full.choices[0].message.content


def test_the_openai_clients_parse_with_a_pydantic_model(oai: "openai.OpenAI", live: LiveServer) -> None:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)

    r = oai.chat.completions.parse(model=_model(live), messages=ASK_PERSON, max_tokens=80, temperature=0,
                                   response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_vllm_guided_extras_on_completions_and_chat(oai: "openai.OpenAI", live: LiveServer) -> None:
    r = oai.completions.create(model=_model(live), prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                               n=2, extra_body={"guided_choice": [" yes", " no"]})
    assert all(c.text in (" yes", " no") for c in r.choices)
    r = oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=12, temperature=0.8, seed=1,
                                    extra_body={"structured_outputs": {"regex": "(red|green|blue), [a-z]+"}})
    import re

    assert re.fullmatch(r"(red|green|blue), [a-z]+", r.choices[0].message.content)


def test_a_bad_schema_is_a_400_naming_the_field(oai: "openai.OpenAI", live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert exc.value.body["param"] == "response_format"
    # the message names the field the client sent, not the engine's name for it (fresh-user trial)
    assert exc.value.body["message"].startswith("response_format is invalid"), exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=_model(live), prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})
    assert exc.value.body["param"] == "guided_regex"
    assert "structured_output" not in exc.value.body["message"], exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=_model(live), prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert exc.value.body["param"] in ("guided_regex", "guided_choice")


def test_prompt_logprobs_on_completions_and_chat(oai: "openai.OpenAI", live: LiveServer) -> None:
    """vLLM's prompt_logprobs: per prompt token (None first) the token's own logprob plus the top ones, equal to
    what echo + logprobs reports for the same prompt, and the same for every one of n choices, streamed too."""
    prompt = "The capital of France is"
    r = oai.completions.create(model=_model(live), prompt=prompt, max_tokens=2, temperature=0, n=2, seed=1,
                               extra_body={"prompt_logprobs": 2})
    body = r.model_dump()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens
    assert body["choices"][1]["prompt_logprobs"] == plp
    echo = oai.completions.create(model=_model(live), prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=2)
    with httpx.Client(base_url=live.base_url) as c:
        ids = c.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry and 2 <= len(entry) <= 3
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(echo.choices[0].logprobs.token_logprobs[pos], abs=1e-5)
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]
    chat = oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    # streamed (vLLM refuses this): the same list, in each choice's first chunk
    chunks = [c.model_dump() for c in oai.completions.create(
        model=_model(live), prompt=prompt, max_tokens=2, temperature=0, n=2, seed=1, stream=True,
        extra_body={"prompt_logprobs": 2})]
    firsts = {}
    for c in chunks:
        for ch in c["choices"]:
            firsts.setdefault(ch["index"], ch)
    assert [firsts[i]["prompt_logprobs"] for i in (0, 1)] == [plp, plp]


def test_best_of_returns_the_n_most_likely_of_its_candidates(oai: "openai.OpenAI", live: LiveServer) -> None:
    """best_of=4, n=2: the two candidates of highest cumulative logprob among the four that n=4 (same seed)
    samples, re-indexed; usage counts all four."""
    kw = dict(model=_model(live), prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, logprobs=0)
    four = oai.completions.create(**kw, n=4)
    totals = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in four.choices), reverse=True)
    best = oai.completions.create(**kw, n=2, extra_body={"best_of": 4})
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [t for _, t in totals[:2]]
    assert best.usage.completion_tokens == four.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(**kw, n=3, extra_body={"best_of": 2})
    assert exc.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(**kw, n=1, stream=True, extra_body={"best_of": 2})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_required_gives_valid_calls_and_an_agent_round_trip(oai: "openai.OpenAI",
                                                                         live: LiveServer) -> None:
    """SmolLM2's template knows no tools: they go in a system message (tool_calls.fallback_messages), and
    tool_choice "required" holds the output to well-formed calls of the tools; then the tool result goes back
    and the model answers in text."""
    jsonschema = pytest.importorskip("jsonschema")
    r = oai.chat.completions.create(model=_model(live), messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                    tool_choice="required", max_tokens=160, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    history = ASK_WEATHER + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21})}
        for c in choice.message.tool_calls]
    answer = oai.chat.completions.create(model=_model(live), messages=history, tools=[WEATHER, TIME],
                                         tool_choice="none", max_tokens=24, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_named_tool_choice_streams_its_call(oai: "openai.OpenAI", live: LiveServer) -> None:
    kw = dict(model=_model(live), messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    full = oai.chat.completions.create(**kw).choices[0]
    assert [c.function.name for c in full.message.tool_calls] == ["get_time"]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]


def test_tool_errors_name_the_field(oai: "openai.OpenAI", live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=_model(live), messages=ASK_WEATHER, tools=[WEATHER], max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert exc.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=_model(live), messages=ASK_WEATHER, tool_choice="required", max_tokens=4)
    assert exc.value.body["param"] == "tool_choice"


def test_a_pydantic_tool_with_a_nested_model_under_required(oai: "openai.OpenAI", live: LiveServer) -> None:
    """openai.pydantic_function_tool nests definitions ($defs) in parameters: found by a trial (400 before)."""
    from pydantic import BaseModel, Field

    class Addr(BaseModel):
        city: str = Field(max_length=30)

    class Lookup(BaseModel):
        addr: Addr

    r = oai.chat.completions.create(model=_model(live), messages=ASK_WEATHER, max_tokens=80, temperature=0,
                                    tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
                                    parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Lookup" and Lookup.model_validate_json(call.function.arguments)


@pytest.fixture(scope="module")
def parser_servers(live: LiveServer) -> Iterator[dict[str, LiveServer]]:
    """A server per tool-call parser, all on the live engine (the live server itself is hermes', the default)."""
    with contextlib.ExitStack() as stack:
        servers = {"hermes": live}
        for name in ("llama3_json", "mistral"):
            servers[name] = stack.enter_context(serve_app(live.engine, tool_call_parser=name))
        yield servers


def _required_call(server: LiveServer, stream: bool) -> tuple[str | None, list[tuple[str, dict]], str, bool]:
    """(content, calls, finish_reason, whether every call went out before the last chunk) of one greedy
    tool_choice="required" request."""
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=_model(server), messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
              parallel_tool_calls=False, max_tokens=80, temperature=0)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason, True
    content, calls, finish, early = "", {}, None, True
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                assert d.index not in calls and d.id and d.type == "function"  # each call whole, in one delta
                calls[d.index] = (d.function.name, json.loads(d.function.arguments))
                early &= ch.finish_reason is None
    return content or None, [calls[k] for k in sorted(calls)], finish, early


def test_each_tool_call_parser_end_to_end_streamed_and_not(parser_servers: dict[str, LiveServer]) -> None:
    """Per parser (its fallback prompt and its grammar on SmolLM2), tool_choice required gives schema-valid calls
    of offered functions; streamed, each call goes out as soon as it is complete, and the content and calls
    equal the non-streamed ones. The six requests run together (greedy float32 is batch invariant)."""
    from concurrent.futures import ThreadPoolExecutor

    jsonschema = pytest.importorskip("jsonschema")
    specs = {"get_weather": WEATHER, "get_time": TIME}
    with ThreadPoolExecutor(6) as pool:
        runs = {(name, stream): pool.submit(_required_call, server, stream)
                for name, server in parser_servers.items() for stream in (False, True)}
        results = {key: future.result() for key, future in runs.items()}
    for name in parser_servers:
        whole, streamed = results[(name, False)], results[(name, True)]
        assert streamed == whole, name
        content, calls, finish, early = streamed
        assert finish == "tool_calls" and len(calls) == 1 and early, (name, streamed)
        for fn, args in calls:
            jsonschema.validate(args, specs[fn]["function"]["parameters"])


def test_a_required_call_cut_by_max_tokens_is_no_content(oai: "openai.OpenAI", live: LiveServer) -> None:
    """Before, the cut markup came back as content; now the finish reason alone says the call was cut."""
    kw = dict(model=_model(live), messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=6,
              temperature=0)
    choice = oai.chat.completions.create(**kw).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", None, None)
    deltas = [ch.delta for chunk in oai.chat.completions.create(**kw, stream=True) for ch in chunk.choices]
    assert not any(d.content or d.tool_calls for d in deltas)


def test_tokenize_takes_tools_like_the_chat_endpoint(oai: "openai.OpenAI", live: LiveServer) -> None:
    r = oai.chat.completions.create(model=_model(live), messages=ASK_WEATHER, tools=[WEATHER], max_tokens=1,
                                    temperature=0)
    with httpx.Client(base_url=live.base_url) as c:
        counted = c.post("/tokenize", json={"messages": ASK_WEATHER, "tools": [WEATHER]}).json()["count"]
        bare = c.post("/tokenize", json={"messages": ASK_WEATHER}).json()["count"]
        refused = c.post("/tokenize", json={"prompt": "hi", "tools": [WEATHER]})
    assert counted == r.usage.prompt_tokens > bare
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


# ---- beam search -------------------------------------------------------------------------------------------


def test_beam_search_completions_equal_transformers(oai: "openai.OpenAI", live: LiveServer, hf_gguf_model,
                                                    hf_tokenizer) -> None:
    from tests.e2e.test_beam_search import hf_beam_search

    prompt = "The quick brown fox"
    eos = sorted(live.engine.engine.eos_token_ids)
    reference = hf_beam_search(hf_gguf_model, hf_tokenizer.encode(prompt), eos, 3, 1.0, False, 12)
    r = oai.completions.create(model=_model(live), prompt=prompt, max_tokens=12, n=2, best_of=3,
                               extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [hf_tokenizer.decode(t, skip_special_tokens=True) for t in reference[:2]]
    assert r.usage.completion_tokens == sum(len(t) for t in reference[:2])


def test_beam_search_chat(oai: "openai.OpenAI", live: LiveServer) -> None:
    r = oai.chat.completions.create(model=_model(live), messages=CHAT, max_tokens=10, n=2,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                "early_stopping": "never"})
    assert len(r.choices) == 2 and r.choices[0].message.content != r.choices[1].message.content
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert live.engine.engine.scheduler.num_free_blocks == live.engine.engine.num_kv_blocks


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "logprobs": 0}, "logprobs"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "n"),
    ({"use_beam_search": True, "n": 40}, "n"),
    ({"use_beam_search": True, "max_tokens": 0}, "max_tokens"),
    ({"use_beam_search": True, "stop_token_ids": list(range(17))}, "stop_token_ids"),  # each widens every step
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_beam_search_refusals_name_the_parameter(live: LiveServer, body: dict, param: str) -> None:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_beam_wider_than_the_seats_is_a_400() -> None:
    from types import SimpleNamespace

    from loom.engine.beam_search import BeamSearchParams
    from loom.server.protocol import RequestError
    from loom.server.serving_common import check_beam_width

    ctx = SimpleNamespace(engine=SimpleNamespace(max_num_seqs=4))
    check_beam_width(ctx, BeamSearchParams(beam_width=4), "n")
    with pytest.raises(RequestError) as e:
        check_beam_width(ctx, BeamSearchParams(beam_width=5, n=1), "best_of")
    assert e.value.param == "best_of" and "max_num_seqs" in e.value.message


def test_beam_search_survives_a_huge_length_penalty_and_other_requests_too(live: LiveServer) -> None:
    """length ** length_penalty beyond float range raised OverflowError inside the engine step, which failed
    every request in flight; now such a search ends normally (every finished score is 0)."""
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "n": 2, "use_beam_search": True,
                                            "length_penalty": 2000.0, "early_stopping": "never"})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "n": 0}, "n"),
    ({"use_beam_search": True, "early_stopping": "Never"}, "early_stopping"),
])
def test_beam_search_errors_say_what_is_allowed(live: LiveServer, body: dict, param: str) -> None:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "best_of=0" not in r.json()["error"]["message"]
    assert body.get("early_stopping") is None or "never" in r.json()["error"]["message"]


def test_beam_search_takes_values_that_change_nothing_and_hides_stop_token_text(live: LiveServer) -> None:
    tokenizer = live.engine.tokenizer
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={
            "prompt": "The capital of Italy is", "max_tokens": 8, "n": 2, "use_beam_search": True,
            "top_p": 1.0, "top_k": -1, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": [], "seed": 3,
            "stop_token_ids": [period]})
        assert r.status_code == 200, r.text
        assert all("." not in choice["text"] for choice in r.json()["choices"])
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "n": None, "stream": None, "logprobs": None,
                                                 "max_tokens": 4})
        assert r.status_code == 200, r.text  # null is the default, as in OpenAI's API

