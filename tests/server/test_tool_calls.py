"""Tool-call parsing, prompts and grammars (loom/server/tool_calls.py)."""

from __future__ import annotations

import json

import pytest

from loom.server.tool_calls import arguments_as_objects, fallback_messages, template_takes_tools, tool_call_grammar
from loom.server.tool_parsers import HermesParser

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_fallback_messages_describe_the_tools_and_render_the_history_as_text() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = fallback_messages(history, [TOOL], HermesParser())
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    assert "<tool_call>" in out[2]["content"] and "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>" and "tool_call_id" not in out[3]
    assert fallback_messages([{"role": "user", "content": "hi"}], [TOOL], HermesParser())[0]["role"] == "system"


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
        manager.compile(StructuredOutputParams(grammar=tool_call_grammar(tools, HermesParser(), only, parallel)))
    hermes = HermesParser()
    assert "~ 1..2" in tool_call_grammar(tools, hermes) and "~ 1..1" in tool_call_grammar(tools, hermes, parallel=False)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar(tools, hermes, "h")


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
    manager.compile(StructuredOutputParams(grammar=tool_call_grammar([tool], HermesParser())))
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "$defs": {"Addr": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="differs from another tool's"):
        tool_call_grammar([tool, other], HermesParser())


def test_markers_that_are_added_tokens_are_written_as_tokens_in_the_grammar() -> None:
    """Qwen2.5's tokenizer has `<tool_call>` as one added token: the model writes it, llguidance's mask for a
    quoted "<tool_call>" offers it (it fast-forwards the literal by tokenizing it), but consuming it failed the
    literal, and tool_choice "required" failed the request. As the token `<[id]>` the grammar takes it."""
    from loom.model.loader import load_tokenizer
    from loom.sample.structured import StructuredOutputManager
    from loom.sampling_params import StructuredOutputParams
    from loom.server.tool_calls import lark_literal, tool_call_grammar

    tok = load_tokenizer(None)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert lark_literal(tok)("<tool_call>") == f"<[{open_id}]>" and lark_literal(tok)("<x>") == '"<x>"'
    grammar = tool_call_grammar([TOOL], HermesParser(), tokenizer=tok)
    assert f"<[{open_id}]>" in grammar and f"<[{close_id}]>" in grammar
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == open_id and ids[-1] == close_id
    vocab = len(tok) + (-len(tok)) % 64
    for g, ok in [(grammar, True), (tool_call_grammar([TOOL], HermesParser()), False)]:
        manager = StructuredOutputManager(tok, vocab, [tok.eos_token_id])
        spec = StructuredOutputParams(grammar=g)
        mask = manager.bitmask("r", spec, [])
        assert (int(mask[open_id // 32]) >> (open_id % 32)) & 1  # offered either way
        if ok:
            mask = manager.bitmask("r", spec, ids)  # every token taken; the grammar may end
            eos = tok.eos_token_id
            assert (int(mask[eos // 32]) >> (eos % 32)) & 1
        else:
            with pytest.raises(RuntimeError, match="left its grammar"):
                manager.bitmask("r", spec, ids)
