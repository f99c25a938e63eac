"""Tool-call parsers: how a model writes calls, chosen by `loom serve --tool-call-parser NAME`.

Each parser owns one call format (vLLM's parser names; formats as vLLM reads them):

| name          | the model writes                                                                | models          |
|---------------|---------------------------------------------------------------------------------|-----------------|
| `hermes`      | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call  | Hermes, Qwen2.5 |
| `llama3_json` | `{"name": ..., "parameters": {...}}` as the whole answer (or after               | Llama 3.1 / 3.2 |
|               | `<|python_tag|>`), several separated by `;`                                     |                 |
| `mistral`     | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content         | Mistral 7B v0.3 |

A parser reads a text left to right into a `Scan`: content pieces, the calls complete so far, and a pending tail
that may still become a call. The same scan serves the whole response and every streamed prefix
(loom/server/tool_calls.py turns scans into content and deltas), so streamed and whole responses agree. A parser
also gives the grammar that holds `tool_choice` required / named to its format, the system prompt describing the
format for chat templates that know nothing of tools, and the text of a history's calls and results for them.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

_DECODER = json.JSONDecoder()

# The Lark term (llguidance) that matches a literal text in a grammar: a quoted string, or the token itself where
# the tokenizer has the text as one added token (see loom/server/tool_calls.py `lark_literal`).
LarkLiteral = Callable[[str], str]


def quoted(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


@dataclass(slots=True, frozen=True)
class ParsedCall:
    """One call read out of generated text."""

    name: str  # the function's name
    arguments: dict[str, Any]  # the arguments object


@dataclass(slots=True)
class Scan:
    """A generated text (or a prefix of one) as a parser reads it: pieces[0] calls[0] pieces[1] ... pending."""

    pieces: list[str] = field(default_factory=lambda: [""])  # content around the calls; len(calls) + 1 of them
    calls: list[ParsedCall] = field(default_factory=list)  # the calls complete in the text, in order
    pending: str = ""  # the tail that may still become (part of) a call: neither content nor a call yet

    def content(self, text: str) -> None:
        self.pieces[-1] += text

    def call(self, call: ParsedCall) -> None:
        self.calls.append(call)
        self.pieces.append("")


class ToolCallParser(Protocol):
    """One tool-call format. `names`: the functions offered (a call of another one stays content)."""

    name: str  # the --tool-call-parser name
    marker: str  # the text that begins calls; when the tokenizer has it as a special token, the server keeps
    # special tokens in the output text (else detokenizing would drop it)
    arguments_key: str  # "arguments" or "parameters": the key of a call's arguments object in this format

    def scan(self, text: str, names: set[str] | None) -> Scan:
        """Read `text` so far: every complete call, the content around them, and a pending tail that more text
        could still turn into a call (held back from the stream)."""
        ...

    def close(self, pending: str, names: set[str] | None) -> ParsedCall | None:
        """The call a pending tail holds when generation has ended there (a block cut before its closing tag
        whose JSON is complete), or None."""
        ...

    def grammar(self, call_schema: dict[str, Any], most: int, literal: LarkLiteral = quoted) -> str:
        """A Lark grammar (llguidance) of 1..`most` calls in this format; `call_schema` is a JSON schema of one
        call object whose arguments key is `arguments_key`; `literal` writes the format's markers."""
        ...

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tools and this format described for a chat template that does not render tools."""
        ...

    def render_calls(self, calls: list[ParsedCall]) -> str:
        """An assistant turn's calls as the model would have written them (history for such templates)."""
        ...

    def render_result(self, content: str) -> str:
        """A tool message's content as the model expects to read it."""
        ...

    def new_id(self) -> str:
        """A fresh call id in the form the model's templates accept."""
        ...


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def _held_back(text: str, marker: str) -> int:
    """Characters at the end of `text` that could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def call_of(obj: Any, names: set[str] | None, keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """The call a decoded JSON value is: an object with a string "name" (among `names` when given) and an
    object under one of `keys` (absent: no arguments); else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    return ParsedCall(obj["name"], args) if isinstance(args, dict) else None


def _decode_object(text: str, pos: int) -> tuple[Any, int] | None:
    """(value, end) of the JSON value at text[pos:], or None when it is incomplete or malformed."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (NousResearch's Hermes function
    calling, which Qwen 2.5's chat template uses). A block that holds no call stays content."""

    name = "hermes"
    arguments_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    marker = OPEN

    def scan(self, text: str, names: set[str] | None) -> Scan:
        scan, pos = Scan(), 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                keep = len(text) - _held_back(text, self.OPEN)
                scan.content(text[pos:keep])
                scan.pending = text[keep:]
                return scan
            end = text.find(self.CLOSE, start)
            if end < 0:
                scan.content(text[pos:start])
                scan.pending = text[start:]
                return scan
            stop = end + len(self.CLOSE)
            call = self._block(text[start + len(self.OPEN):end], names)
            if call is None:
                scan.content(text[pos:stop])
            else:
                scan.content(text[pos:start])
                scan.call(call)
            pos = stop

    def close(self, pending: str, names: set[str] | None) -> ParsedCall | None:
        return self._block(pending[len(self.OPEN):], names) if pending.startswith(self.OPEN) else None

    @staticmethod
    def _block(body: str, names: set[str] | None) -> ParsedCall | None:
        """The call a block's body is: one JSON object, spaces around it aside."""
        body = body.strip()
        decoded = _decode_object(body, 0)
        return call_of(decoded[0], names) if decoded is not None and decoded[1] == len(body) else None

    def grammar(self, call_schema: dict[str, Any], most: int, literal: LarkLiteral = quoted) -> str:
        return (f'start: (call "\\n"?) ~ 1..{most}\n'
                f'call: {literal(self.OPEN)} "\\n" args "\\n" {literal(self.CLOSE)}\n'
                f"args: %json {json.dumps(call_schema)}\n")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call one or more functions to assist with the user query. The functions are, one JSON "
                "signature per line:\n<tools>\n" + _tool_lines(tools) + "\n</tools>\nFor each function call, "
                "return a JSON object with the function name and its arguments within <tool_call></tool_call> "
                "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

    def render_calls(self, calls: list[ParsedCall]) -> str:
        return "\n".join(f"{self.OPEN}\n" + json.dumps({"name": c.name, "arguments": c.arguments},
                                                      ensure_ascii=False) + f"\n{self.CLOSE}" for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class Llama3JsonParser:
    """Llama 3.1's JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by ";", either the whole answer (leading spaces aside) or after `<|python_tag|>` (content may come
    before the tag). Anything after the last call stays content; an answer whose first object is no call is
    content throughout."""

    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"
    marker = TAG

    def scan(self, text: str, names: set[str] | None) -> Scan:
        scan = Scan()
        tag = text.find(self.TAG)
        first = _skip_space(text, 0)
        if first < len(text) and text[first] == "{" and (tag < 0 or first < tag):
            scan.content(text[:first])
            return self._calls(text, first, names, scan)
        if tag >= 0:
            scan.content(text[:tag])
            return self._calls(text, _skip_space(text, tag + len(self.TAG)), names, scan, start=tag)
        if first == len(text):  # nothing but spaces yet: a call may still begin
            scan.pending = text
            return scan
        keep = len(text) - _held_back(text, self.TAG)
        scan.content(text[:keep])
        scan.pending = text[keep:]
        return scan

    def _calls(self, text: str, pos: int, names: set[str] | None, scan: Scan, start: int | None = None) -> Scan:
        """Calls from text[pos:] on; `start`: where the markup began (content if no call follows)."""
        return _read_calls(text, pos, pos if start is None else start, names, scan, separator=";")

    def close(self, pending: str, names: set[str] | None) -> ParsedCall | None:
        return None  # a call is taken as soon as its JSON is complete: a pending tail is never one

    def grammar(self, call_schema: dict[str, Any], most: int, literal: LarkLiteral = quoted) -> str:
        return (f'start: call ("; " call) ~ 0..{most - 1}\n'
                f"call: %json {json.dumps(call_schema)}\n")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You have access to the functions below, one JSON signature per line:\n" + _tool_lines(tools) +
                "\nTo call a function, answer with nothing but a JSON object {\"name\": <function-name>, "
                "\"parameters\": <args-json-object>}; for several calls, separate the objects with \"; \". "
                "Answer in plain text when no function is needed.")

    def render_calls(self, calls: list[ParsedCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)

    def render_result(self, content: str) -> str:
        return content

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class MistralParser:
    """Mistral's (v0.3 tokenizer) tool calls: content, then `[TOOL_CALLS]` and a JSON array of
    `{"name": ..., "arguments": {...}}`; text after the array stays content. The marker is a special token in
    Mistral's tokenizers and plain text elsewhere: both read the same (the server keeps special tokens in the
    text when the marker is one). Ids are 9 letters or digits, as Mistral's templates require."""

    name = "mistral"
    arguments_key = "arguments"
    MARKER = "[TOOL_CALLS]"
    marker = MARKER

    def scan(self, text: str, names: set[str] | None) -> Scan:
        scan = Scan()
        start = text.find(self.MARKER)
        if start < 0:
            keep = len(text) - _held_back(text, self.MARKER)
            scan.content(text[:keep])
            scan.pending = text[keep:]
            return scan
        scan.content(text[:start])
        pos = _skip_space(text, start + len(self.MARKER))
        if pos >= len(text):
            scan.pending = text[start:]
            return scan
        if text[pos] != "[":
            scan.content(text[start:])
            return scan
        return _read_calls(text, _skip_space(text, pos + 1), start, names, scan, separator=",", end="]",
                           keys=("arguments",))

    def close(self, pending: str, names: set[str] | None) -> ParsedCall | None:
        return None  # each call is taken once its object is complete; a cut array's tail holds none

    def grammar(self, call_schema: dict[str, Any], most: int, literal: LarkLiteral = quoted) -> str:
        return (f'start: {literal(self.MARKER)} "[" call (", " call) ~ 0..{most - 1} "]"\n'
                f"call: %json {json.dumps(call_schema)}\n")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call the functions below, one JSON signature per line:\n" + _tool_lines(tools) +
                "\nTo call functions, write [TOOL_CALLS] followed by a JSON array of calls: "
                "[TOOL_CALLS][{\"name\": <function-name>, \"arguments\": <args-json-object>}, ...]. "
                "Answer in plain text when no function is needed.")

    def render_calls(self, calls: list[ParsedCall]) -> str:
        return self.MARKER + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls],
                                        ensure_ascii=False)

    def render_result(self, content: str) -> str:
        return "[TOOL_RESULTS]" + json.dumps({"content": content}, ensure_ascii=False) + "[/TOOL_RESULTS]"

    def new_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


def _read_calls(text: str, pos: int, begin: int, names: set[str] | None, scan: Scan, separator: str,
                end: str | None = None, keys: tuple[str, ...] = ("arguments", "parameters")) -> Scan:
    """Read a list of JSON call objects from text[pos:] into `scan`: objects joined by `separator` (markup,
    dropped) and, for a bracketed list, closed by `end` (text after it is content). `begin`: where the markup not
    yet taken begins; it becomes content if what follows is no call, and stays pending while a call may still be
    completing. `keys`: call_of's argument keys."""
    while True:
        if pos >= len(text):
            scan.pending = text[begin:]
            return scan
        if text[pos] != "{":
            scan.content(text[begin:])
            return scan
        decoded = _decode_object(text, pos)
        if decoded is None:  # incomplete (or malformed: known only at the end)
            scan.pending = text[begin:]
            return scan
        call = call_of(decoded[0], names, keys=keys)
        if call is None:
            scan.content(text[begin:])
            return scan
        scan.call(call)
        stop = decoded[1]
        after = _skip_space(text, stop)
        if after < len(text) and text[after] == separator:
            begin = pos = _skip_space(text, after + 1)
            continue
        if after < len(text) and end is not None and text[after] == end:
            scan.content(text[after + 1:])
        elif after < len(text):  # something else follows the calls: content
            scan.content(text[stop:])
        else:
            scan.pending = text[stop:]  # spaces: a separator may still come
        return scan


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser, Llama3JsonParser.name: Llama3JsonParser, MistralParser.name: MistralParser,
}
DEFAULT_TOOL_CALL_PARSER = HermesParser.name


def get_tool_call_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`.

    Raises:
        ValueError: no parser has that name (the message names tool_call_parser and the known names).
    """
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return TOOL_CALL_PARSERS[name]()


__all__ = ["ParsedCall", "Scan", "ToolCallParser", "HermesParser", "Llama3JsonParser", "MistralParser",
           "TOOL_CALL_PARSERS", "DEFAULT_TOOL_CALL_PARSER", "get_tool_call_parser", "call_of"]
