"""litellm against a live server on the bundled model (issue 11's client checks): chat, async chat, streaming,
response_format json_schema, tools under tool_choice "required", text completion, and an error.

litellm is told to stay offline: LITELLM_LOCAL_MODEL_COST_MAP makes it read its bundled model-cost map instead
of fetching one at import (which otherwise waits on the network), and telemetry is off.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, serve

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: it reads it then
litellm = pytest.importorskip("litellm")
litellm.telemetry = False
pytestmark = [pytest.mark.slow,  # litellm's own pydantic types warn about TypedDict ReadOnly items
              pytest.mark.filterwarnings("ignore:Items? .*ReadOnly:UserWarning")]

ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=1024))
    front = AsyncLLMEngine(engine)
    front.start()
    with serve(front) as server:
        yield server


@pytest.fixture(scope="module")
def kw(live: LiveServer) -> dict[str, Any]:
    """How litellm reaches an OpenAI-compatible server: the "openai/" provider prefix and api_base."""
    return {"model": f"openai/{live.engine.model_name}", "api_base": live.v1, "api_key": "unused",
            "temperature": 0, "num_retries": 0, "timeout": 120}


def _count(live: LiveServer, body: dict[str, Any]) -> int:
    with httpx.Client(base_url=live.base_url) as c:
        return int(c.post("/tokenize", json=body).json()["count"])


def test_chat_answer_sync_and_async(kw: dict[str, Any], live: LiveServer) -> None:
    r = litellm.completion(messages=ASK, max_tokens=8, **kw)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == _count(live, {"messages": ASK}) and 0 < r.usage.completion_tokens <= 8
    again = asyncio.run(litellm.acompletion(messages=ASK, max_tokens=8, **kw))
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy: the same answer


def test_streaming_equals_non_streaming(kw: dict[str, Any]) -> None:
    whole = litellm.completion(messages=ASK, max_tokens=12, **kw).choices[0].message.content
    chunks = list(litellm.completion(messages=ASK, max_tokens=12, stream=True, **kw))
    assert len(chunks) > 2  # it streamed
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_response_format_json_schema(kw: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = litellm.completion(
        messages=[{"role": "user", "content": "Give me a person named Ann, 30 years old, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
        max_tokens=60, **kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_tools_with_tool_choice_required(kw: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = litellm.completion(messages=ask, tools=tools, tool_choice="required", max_tokens=60, **kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    call = message.tool_calls[0]
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # the round trip: the call and its result in the history, answered in text
    history = [*ask, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = litellm.completion(messages=history, tools=tools, max_tokens=16, **kw)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_text_completion(kw: dict[str, Any], live: LiveServer) -> None:
    prompt = "The capital of France is"
    r = litellm.text_completion(prompt=prompt, max_tokens=6, **kw)
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        direct = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    assert r.choices[0].text == direct["choices"][0]["text"]  # it went to /v1/completions, raw prompt
    assert r.usage.prompt_tokens == _count(live, {"prompt": prompt})


def test_a_400_reaches_the_caller_naming_the_parameter(kw: dict[str, Any]) -> None:
    with pytest.raises(litellm.BadRequestError) as e:
        litellm.completion(messages=ASK, max_tokens=4, top_p=1.5, **kw)
    assert "top_p" in str(e.value)
