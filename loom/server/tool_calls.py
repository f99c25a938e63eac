"""Tool calling: tools into the prompt, tool calls out of the generated text, and a grammar for tool_choice.

The call format belongs to the server's tool-call parser (loom/server/tool_parsers.py, `--tool-call-parser`);
this module does the rest, the same for every format:

| piece             | what it does                                                                               |
|-------------------|--------------------------------------------------------------------------------------------|
| prompt            | a chat template that takes `tools` (it mentions them) gets them as they are; for one that  |
|                   | does not (SmolLM2's), a system message lists the tools and the parser's format, and the     |
|                   | history's assistant tool calls and tool results are rendered as the parser writes them      |
| read_calls        | a whole generated text -> (content outside the calls or None, the calls)                    |
| CallStream        | the same, streamed: content as soon as no call can change it, each call once complete       |
| tool_call_grammar | tool_choice "required" or a named function: a Lark grammar (llguidance, with its %json     |
|                   | schema rules) that only lets the model write well-formed calls of the allowed functions     |

Content around calls: the whitespace next to a call is dropped, pieces between calls are joined by a newline, and
a text without calls is its content unchanged. A streamed prefix's content is what the whole text's content
must start with (a piece's trailing whitespace waits until text follows it), so streamed and whole responses agree.

tool_choice "none" keeps the tools in the prompt but parses nothing; "auto" (the default with tools) parses what
the model writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loom.server.tool_parsers import LarkLiteral, ParsedCall, Scan, ToolCallParser, quoted
from loom.server.protocol import check_unicode


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument (it names the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether `text` is one of the tokenizer's special added tokens (detokenizing drops those by default)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(getattr(t, "content", None) == text and getattr(t, "special", False) for t in added.values())


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      parser: ToolCallParser) -> list[dict[str, Any]]:
    """For a template that knows nothing of tools: the tools described in a system message (merged into the
    conversation's own system message if it has one), assistant tool calls and tool results as `parser` writes
    them. The calls' arguments are objects (arguments_as_objects first), as the model is told to write them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            text = parser.render_calls([ParsedCall(c["function"]["name"], c["function"]["arguments"])
                                        for c in calls])
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("role") == "tool":
            m.pop("tool_call_id", None)
            m["content"] = parser.render_result(m.get("content") or "")
        out.append(m)
    if tools:
        system = parser.system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _not_json(name: str) -> Any:
    """json.loads' hook for NaN, Infinity and -Infinity, which Python reads but JSON (RFC 8259) has not."""
    raise ValueError(f"{name} is not a JSON number")


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends a call's arguments as a JSON string; templates (Qwen2.5's) expect the object.

    Raises:
        ValueError: arguments that are not a JSON object.
    """
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args, parse_constant=_not_json) if args.strip() else {}
                    except ValueError as exc:  # JSONDecodeError, NaN, or an integer of 4,300+ digits
                        raise ValueError(f"messages[{i}].tool_calls: arguments are not JSON: {exc}") from None
                    try:  # a \ud800 escape in the arguments decodes to a lone surrogate
                        check_unicode(args)
                    except ValueError:
                        raise ValueError(f"messages[{i}].tool_calls: arguments contain a lone UTF-16 surrogate: "
                                         "not valid Unicode") from None
                if not isinstance(args, dict):
                    raise ValueError(f"messages[{i}].tool_calls: arguments must be a JSON object")
                fn["arguments"] = args
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def check_tools(tools: list[dict[str, Any]]) -> None:
    """Raise ValueError for two tools of one name, or parameters that are not an object schema (a call's
    arguments are an object)."""
    seen: set[str] = set()
    for t in tools:
        name = t["function"]["name"]
        if name in seen:
            raise ValueError(f"two tools are named {name!r}")
        seen.add(name)
        params = t["function"].get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema of an object, got type "
                             f"{params.get('type')!r}")


def check_tool_history(messages: list[dict[str, Any]]) -> None:
    """Raise ValueError unless every tool message answers a call an earlier assistant message made (OpenAI's
    rule), and no two calls share an id (a tool message answering it would be ambiguous)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or []:
            if c.get("id") in made:
                raise ValueError(f"messages[{i}]: tool call id {c.get('id')!r} is used by an earlier call too")
            made.add(c.get("id"))
        if m.get("role") == "tool" and m.get("tool_call_id") not in made:
            raise ValueError(f"messages[{i}]: tool_call_id {m.get('tool_call_id')!r} answers no earlier tool call")


def _hoist_defs(schema: dict[str, Any], defs: dict[str, Any], function: str) -> dict[str, Any]:
    """`schema` without its $defs / definitions, which join `defs` (refs like #/$defs/X then resolve at the
    grammar's root, where the function's arguments schema no longer is)."""
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            if name in defs and defs[name] != sub:
                raise ValueError(f"tool {function!r}: definition {name!r} differs from another tool's")
            defs[name] = sub
    return schema



def lark_literal(tokenizer: Any) -> LarkLiteral:
    """How a grammar for `tokenizer` writes a format's marker: as the token itself (`<[id]>`) where the tokenizer
    has the text as one added token (Qwen2.5's `<tool_call>`, Mistral's `[TOOL_CALLS]`), else quoted.

    Why: a tokenizer matches an added token's text before anything else, and llguidance fast-forwards a forced
    literal by tokenizing it, so the mask offers that token; but llguidance keeps added tokens apart from text
    (their bytes are not the text's), so consuming it fails the quoted literal and the request fails.
    """
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}

    def literal(text: str) -> str:
        token_id = added.get(text)
        return f"<[{int(token_id)}]>" if token_id is not None else quoted(text)

    return literal


def tool_call_grammar(tools: list[dict[str, Any]], parser: ToolCallParser, only: str | None = None,
                      parallel: bool = True, tokenizer: Any = None) -> str:
    """A Lark grammar (llguidance) of one call, or up to one per function when `parallel`, of the tools (or only
    the named one), in `parser`'s format, each call's arguments held to the function's JSON schema. With the
    model's `tokenizer`, markers that are one added token are written as that token (`lark_literal`).

    Raises:
        ValueError: `only` names no tool; two tools define one $defs name differently.
    """
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not functions:
        raise ValueError(f"tool_choice names {only!r}, which is not among the tools")
    defs: dict[str, Any] = {}
    options = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        parser.arguments_key: _hoist_defs(f.get("parameters") or {"type": "object"}, defs, f["name"])},
        "required": ["name", parser.arguments_key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_pattern": r"[\x20]{0,1}"}}
    if defs:  # the schema's own refs say #/$defs/... or #/definitions/...: both point here
        schema["$defs"] = defs
        schema["definitions"] = defs
    # at most one call per function: a small model, free to add calls, repeats one until max_tokens
    literal = lark_literal(tokenizer) if tokenizer is not None else quoted
    return parser.grammar(schema, len(functions) if parallel else 1, literal)


def _content(pieces: list[str], open_end: bool) -> str:
    """The content of a scan's pieces: whitespace next to a call dropped, pieces joined by a newline; with
    `open_end` (more text may come) the last piece's trailing whitespace too, as a call may follow it."""
    parts = []
    for k, piece in enumerate(pieces):
        if k > 0:
            piece = piece.lstrip()
        if k < len(pieces) - 1 or open_end:
            piece = piece.rstrip()
        if piece:
            parts.append(piece)
    return "\n".join(parts)


def read_calls(parser: ToolCallParser, text: str, names: set[str] | None,
               forced: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """(content or None, calls) of a whole generated text. A text without calls is its content unchanged. A call
    left unfinished at the end (max_tokens) is content, unless `forced` (tool_choice required or named: the
    grammar made the whole output calls), when it is dropped: the finish reason ("length") tells the client."""
    scan = parser.scan(text, names)
    _close(parser, scan, names, forced)
    if not scan.calls:
        content = "".join(scan.pieces)
        return (content or None) if forced else content, []
    return _content(scan.pieces, open_end=False) or None, scan.calls


def _close(parser: ToolCallParser, scan: Scan, names: set[str] | None, forced: bool) -> None:
    """Settle a scan's pending tail once the text has ended: a call, dropped (forced), or content."""
    if scan.pending:
        call = parser.close(scan.pending, names)
        if call is not None:
            scan.call(call)
        elif not forced:
            scan.content(scan.pending)
        scan.pending = ""


def openai_call(parser: ToolCallParser, call: ParsedCall) -> dict[str, Any]:
    """A call in OpenAI's shape: fresh id, arguments as a JSON string."""
    return {"id": parser.new_id(), "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


@dataclass(slots=True)
class CallStream:
    """One streamed choice read as it grows: content once no later text can change it, each call once complete.

    The content sent is always a prefix of read_calls' content of the whole text, and the calls sent are its
    calls (the first only, unless `parallel`)."""

    parser: ToolCallParser  # the call format
    names: set[str]  # the functions offered
    parallel: bool  # more than one call allowed
    forced: bool  # tool_choice required / named: an unfinished call at the end is dropped
    sent: str = ""  # content sent so far
    calls_sent: int = 0  # calls sent so far

    def step(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(new content, newly complete calls) for the text so far."""
        scan = self.parser.scan(text, self.names)
        return self._advance(_content(scan.pieces, open_end=True), scan.calls)

    def finish(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the rest of the content, the calls not yet sent) of the whole text."""
        content, calls = read_calls(self.parser, text, self.names, self.forced)
        return self._advance(content or "", calls)

    @property
    def any_calls(self) -> bool:
        return self.calls_sent > 0

    def _advance(self, content: str, calls: list[ParsedCall]) -> tuple[str, list[ParsedCall]]:
        new_text = ""
        if content.startswith(self.sent):  # always, by the scans' construction; never send a contradiction
            new_text = content[len(self.sent):]
            self.sent = content
        limit = len(calls) if self.parallel else min(1, len(calls))
        new_calls = calls[self.calls_sent:limit]
        self.calls_sent = max(self.calls_sent, limit)
        return new_text, new_calls


__all__ = ["template_takes_tools", "is_special_token", "fallback_messages", "arguments_as_objects", "check_tools",
           "check_tool_history", "tool_call_grammar", "read_calls", "openai_call", "CallStream"]
