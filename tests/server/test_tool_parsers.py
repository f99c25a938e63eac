"""Tool-call parsers (loom/server/tool_parsers.py): reading each format, whole and streamed, and its grammar."""

from __future__ import annotations

import pytest

from loom.server.tool_calls import CallStream, fallback_messages, read_calls, tool_call_grammar
from loom.server.tool_parsers import (
    TOOL_CALL_PARSERS, HermesParser, Llama3JsonParser, MistralParser, ParsedCall, ToolCallParser, get_tool_call_parser,
)

F1, G0 = ParsedCall("f", {"x": 1}), ParsedCall("g", {})
H, L, M = HermesParser(), Llama3JsonParser(), MistralParser()

# (parser, text, content, calls) of whole texts
CASES = [
    (H, 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me check.", [F1, G0]),
    (H, 'Sure <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> then', "Sure\nthen", [F1]),
    (H, "no calls here ", "no calls here ", []),
    (H, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (H, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (H, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}'
        '</tool_call>', []),  # arguments not an object
    (H, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [F1]),  # cut before its closing tag
    (H, '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut inside the JSON
    (L, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None, [F1, G0]),
    (L, '{"name": "f", "arguments": {"x": 1}}', None, [F1]),  # "arguments" read too, as vLLM does
    (L, 'Let me look. <|python_tag|>{"name": "f", "parameters": {"x": 1}}', "Let me look.", [F1]),
    (L, '  {"name": "f", "parameters": {"x": 1}} and more', "and more", [F1]),
    (L, '{"answer": 42} is JSON, no call', '{"answer": 42} is JSON, no call', []),
    (L, '{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),  # malformed (cut)
    (L, 'Use {"name": "f", "parameters": {}} like this', 'Use {"name": "f", "parameters": {}} like this', []),
    (M, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "Sure.",
     [F1, G0]),
    (M, '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]\nDone.', "Done.", [F1]),
    (M, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "argu', '{"name": "g", "argu', [F1]),
    (M, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (M, '[TOOL_CALLS][{"name": "f", "arguments": "x"}]', '[TOOL_CALLS][{"name": "f", "arguments": "x"}]', []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES,
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_texts(parser: ToolCallParser, text: str, content: str | None, calls: list[ParsedCall]) -> None:
    assert read_calls(parser, text, None) == (content, calls)


def _streamed(parser: ToolCallParser, text: str, names: set[str] | None, forced: bool = False,
              parallel: bool = True) -> tuple[str, list[ParsedCall], list[int], str]:
    """Content and calls of `text` fed one character at a time, the length of text at which each call went
    out, and the content sent before the end."""
    stream = CallStream(parser, names, parallel, forced)
    content, calls, at, before_end = "", [], [], ""
    for end in range(len(text) + 1):
        before_end = content
        new_content, new_calls = stream.step(text[:end]) if end < len(text) else stream.finish(text)
        content += new_content
        calls += new_calls
        at += [end] * len(new_calls)
    return content, calls, at, before_end


@pytest.mark.parametrize(("parser", "text"), [(c[0], c[1]) for c in CASES],
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_streamed_equals_whole_and_never_shows_markup(parser: ToolCallParser, text: str) -> None:
    whole_content, whole_calls = read_calls(parser, text, None)
    content, calls, _, before_end = _streamed(parser, text, None)
    assert (content or None) == (whole_content or None) and calls == whole_calls
    if whole_calls:  # an unfinished call in auto becomes content at the end only
        assert parser.marker not in before_end and '"name"' not in before_end


def test_each_call_streams_as_soon_as_it_is_complete() -> None:
    for parser in (H, L, M):
        text = parser.render_calls([F1, G0])
        _, calls, at, _ = _streamed(parser, text, None)
        assert calls == [F1, G0]
        first_end = text.index("}}") + 2  # the first call's JSON is complete here
        # Hermes waits for the closing tag; the JSON formats take a call as soon as its object is complete
        assert at[0] < len(text) and at[0] <= first_end + len("\n</tool_call>")


def test_content_before_a_call_streams_without_the_space_the_whole_response_strips() -> None:
    """Found by a trial: streamed content kept "Sure " where the whole response said "Sure"."""
    text = 'Sure <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert _streamed(H, text, None)[0] == read_calls(H, text, None)[0] == "Sure"


def test_a_call_cut_by_max_tokens_under_a_forced_choice_is_dropped_not_content() -> None:
    for parser, text in [(H, '<tool_call>\n{"name": "f", "arguments": {"x": '),
                         (L, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "para'),
                         (M, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g"')]:
        content, calls = read_calls(parser, text, None, forced=True)
        assert content is None and calls == ([] if parser is H else [F1])
        assert _streamed(parser, text, None, forced=True)[:2] == ("", calls)


def test_calls_of_functions_not_among_the_tools_stay_content() -> None:
    for parser in (H, L, M):
        text = parser.render_calls([ParsedCall("zzz", {})])
        assert read_calls(parser, text, {"f"}) == (text, [])
        assert read_calls(parser, text, {"zzz"})[1] == [ParsedCall("zzz", {})]


def test_parallel_false_streams_the_first_call_only() -> None:
    for parser in (H, L, M):
        assert _streamed(parser, parser.render_calls([F1, G0]), None, parallel=False)[1] == [F1]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}]


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_grammar_accepts_what_the_parser_reads(name: str) -> None:
    """Each parser's grammar (tool_choice required) accepts its own rendering of calls, which it reads back."""
    import llguidance
    import llguidance.hf

    from loom.model.loader import load_tokenizer

    parser = get_tool_call_parser(name)
    tokenizer = load_tokenizer(None)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152, eos_token=[2])
    text = parser.render_calls([F1, G0])
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(TOOLS, parser)))
    assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting()
    assert read_calls(parser, text, {"f", "g"}) == (None, [F1, G0])


def test_fallback_prompts_describe_each_format() -> None:
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    for parser, marker in [(H, "<tool_call>"), (L, '"parameters"'), (M, "[TOOL_CALLS]")]:
        out = fallback_messages(history, TOOLS, parser)
        assert out[0]["role"] == "system" and marker in out[0]["content"] and '"name": "f"' in out[0]["content"]
        assert read_calls(parser, out[2]["content"], None)[1] == [F1]
        assert "42" in out[3]["content"]


def test_a_marker_that_is_a_special_token_is_recognised() -> None:
    """Such a marker keeps special tokens in the output (else detokenizing drops it and no call is read)."""
    from loom.model.loader import load_tokenizer
    from loom.server.tool_calls import is_special_token

    tokenizer = load_tokenizer(None)
    assert is_special_token(tokenizer, "<|im_start|>") and not is_special_token(tokenizer, M.marker)


def test_ids_and_unknown_names() -> None:
    assert M.new_id().isalnum() and len(M.new_id()) == 9  # Mistral's templates refuse other ids
    assert H.new_id().startswith("call_")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, mistral, got 'x'"):
        get_tool_call_parser("x")


def test_serve_refuses_an_unknown_parser_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--tool-call-parser", "nope", "--port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    error, hint = err.splitlines()  # the error, then where the options are listed (as for a malformed value)
    assert error.startswith("loom serve: error: --tool-call-parser must be one of") and "'nope'" in error
    assert hint == "(run 'loom serve --help' for its options)"
