"""Tool-call parsing, prompts and grammars (loom/server/tool_calls.py)."""

from __future__ import annotations

import json

import pytest

from loom.server.tool_calls import (
    arguments_as_objects, fallback_messages, held_back, parse_hermes, template_takes_tools, tool_call_grammar,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_parse_hermes_calls_and_the_content_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    "no calls here",
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
])
def test_parse_hermes_leaves_text_that_is_no_call_as_content(text: str) -> None:
    assert parse_hermes(text) == (text, [])


def test_parse_hermes_takes_a_last_call_cut_before_its_closing_tag() -> None:
    content, calls = parse_hermes('<tool_call>\n{"name": "f", "arguments": {"a": "b"}}')
    assert content is None and calls[0]["function"]["name"] == "f"
    assert parse_hermes('<tool_call>\n{"name": "f", "argu')[1] == []  # cut inside the JSON: no call


def test_held_back_is_a_possible_start_of_a_call() -> None:
    assert held_back("Sure <tool") == len("<tool") and held_back("Sure") == 0 and held_back("<") == 1


def test_fallback_messages_describe_the_tools_and_render_the_history_as_text() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = fallback_messages(history, [TOOL])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    assert "<tool_call>" in out[2]["content"] and "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>" and "tool_call_id" not in out[3]
    assert fallback_messages([{"role": "user", "content": "hi"}], [TOOL])[0]["role"] == "system"


def test_arguments_become_objects_for_templates_and_bad_ones_are_refused() -> None:
    msgs = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert arguments_as_objects(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(ValueError, match="not JSON"):
        arguments_as_objects([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_template_takes_tools() -> None:
    class Tok:
        chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}"

    class Plain:
        chat_template = "{{ messages }}"

    assert template_takes_tools(Tok()) and not template_takes_tools(Plain())


def test_tool_call_grammar_names_and_bounds() -> None:
    from loom.model.loader import load_tokenizer
    from loom.sample.structured import StructuredOutputManager
    from loom.sampling_params import StructuredOutputParams

    tools = [TOOL, {"type": "function", "function": {"name": "g"}}]
    manager = StructuredOutputManager(load_tokenizer(None), 49152, [2])
    for only, parallel in [(None, True), ("g", False)]:
        manager.compile(StructuredOutputParams(grammar=tool_call_grammar(tools, only, parallel)))
    assert "~ 1..2" in tool_call_grammar(tools) and "~ 1..1" in tool_call_grammar(tools, parallel=False)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar(tools, "h")


def test_checks_of_tools_and_history() -> None:
    from loom.server.tool_calls import check_tool_history, check_tools

    with pytest.raises(ValueError, match="two tools are named 'f'"):
        check_tools([TOOL, TOOL])
    with pytest.raises(ValueError, match="must be a JSON schema of an object"):
        check_tools([{"type": "function", "function": {"name": "p", "parameters": {"type": "string"}}}])
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {}}}]}
    check_tool_history([call, {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    with pytest.raises(ValueError, match="answers no earlier tool call"):
        check_tool_history([call, {"role": "tool", "tool_call_id": "c2", "content": "ok"}])
    with pytest.raises(ValueError, match="answers no earlier tool call"):
        check_tool_history([{"role": "tool", "tool_call_id": "c1", "content": "ok"}, call])


def test_calls_of_functions_not_among_the_tools_stay_content() -> None:
    text = '<tool_call>{"name": "zzz", "arguments": {}}</tool_call>'
    assert parse_hermes(text, {"f"}) == (text, [])
    assert parse_hermes(text, {"zzz"})[1][0]["function"]["name"] == "zzz"


def test_nested_definitions_of_a_pydantic_tool_resolve_in_the_grammar() -> None:
    """openai.pydantic_function_tool puts $defs inside parameters; the grammar nests parameters under
    "arguments", so they are hoisted to its root, where #/$defs/... points."""
    from loom.model.loader import load_tokenizer
    from loom.sample.structured import StructuredOutputManager
    from loom.sampling_params import StructuredOutputParams

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}}, "required": ["addr"],
        "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}}
    manager = StructuredOutputManager(load_tokenizer(None), 49152, [2])
    manager.compile(StructuredOutputParams(grammar=tool_call_grammar([tool])))
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "$defs": {"Addr": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="differs from another tool's"):
        tool_call_grammar([tool, other])
