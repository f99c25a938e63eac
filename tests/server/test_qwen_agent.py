"""An agent round trip on Qwen2.5-Coder-0.5B-Instruct (issue 11's tool-calling check on a model whose chat template
renders tools natively; `--tool-call-parser hermes`): the model calls a tool, the tool's result goes back as a
`tool` message, and the final text answer uses it. Once with the official openai client, once with LangChain's
`ChatOpenAI.bind_tools`. Greedy, small max_tokens, max_model_len 1024.

Under tool_choice "auto" this 0.5B model writes the call's JSON bare, without the `<tool_call>` tags its own
template asks for (greedy: `{"name": "get_weather", "arguments": {...}}` as plain text), so the first turn uses
tool_choice "required" (LangChain: tool_choice="any"), which holds the output to hermes-format calls of the given
tools; the second turn is "auto". The model is fragile there too: asked the weather in Tokyo, or to multiply, it
answers the tool result by repeating the bare-JSON call, so both tests use the one exchange it completes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, serve

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers exactly.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, MULTIPLY)}


@pytest.fixture(scope="module")
def live(qwen05_gguf: Path) -> Iterator[LiveServer]:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(qwen05_gguf), max_model_len=1024, max_num_seqs=4))
    front = AsyncLLMEngine(engine)
    front.start()
    with serve(front, tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def _valid_args(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_openai_client_agent_round_trip(oai: "openai.OpenAI", live: LiveServer) -> None:
    model = live.engine.model_name
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = oai.chat.completions.create(model=model, messages=ask, tools=[WEATHER, MULTIPLY], tool_choice="required",
                                        max_tokens=48, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert not choice.message.content  # the <tool_call> markup is not leaked as text
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert _valid_args("get_weather", call.function.arguments)["city"] == "Paris"

    history = ask + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"city": "Paris", "temperature_c": 17, "sky": "light rain"})}]
    final = oai.chat.completions.create(model=model, messages=history, tools=[WEATHER, MULTIPLY],
                                        tool_choice="auto", max_tokens=48, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer.message
    assert "17" in answer.message.content, answer.message.content


def test_langchain_bind_tools_agent_round_trip(live: LiveServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    chat = langchain_openai.ChatOpenAI(base_url=live.v1, api_key="unused", model=live.engine.model_name,
                                       temperature=0, max_tokens=48, max_retries=0)
    ask = HumanMessage("What is the weather in Paris right now?")
    call_msg = chat.bind_tools([WEATHER, MULTIPLY], tool_choice="any").invoke([ask])
    assert isinstance(call_msg, AIMessage) and call_msg.response_metadata["finish_reason"] == "tool_calls"
    [call] = call_msg.tool_calls
    assert call["name"] == "get_weather" and _valid_args("get_weather", call["args"])["city"] == "Paris"
    result = ToolMessage(json.dumps({"city": "Paris", "temperature_c": 17, "sky": "light rain"}),
                         tool_call_id=call["id"])
    answer = chat.bind_tools([WEATHER, MULTIPLY]).invoke([ask, call_msg, result])
    assert answer.response_metadata["finish_reason"] == "stop" and not answer.tool_calls, answer.content
    assert "17" in answer.content, answer.content
