"""LangChain's OpenAI chat model against a live server on the bundled model: with_structured_output in all its
methods and bind_tools (issue 11's client checks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import LiveServer, serve

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow


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
def chat(live: LiveServer):  # noqa: ANN201
    return langchain_openai.ChatOpenAI(base_url=live.v1, api_key="unused", model=live.engine.model_name,
                                       temperature=0, max_tokens=120, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(chat, method: str) -> None:  # noqa: ANN001
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)

    person = chat.with_structured_output(Person, method=method).invoke(
        "Give me a person named Ann, 30 years old, as JSON with name and age.")
    assert isinstance(person, Person)


def test_bind_tools_and_the_tool_result_round_trip(chat) -> None:  # noqa: ANN001
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    ask = HumanMessage("What's the weather in Paris?")
    call_msg = chat.bind_tools([get_weather], tool_choice="any").invoke([ask])
    assert [c["name"] for c in call_msg.tool_calls] == ["get_weather"]
    call = call_msg.tool_calls[0]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = chat.bind_tools([get_weather]).invoke([ask, call_msg, result])
    assert isinstance(answer.content, str)
