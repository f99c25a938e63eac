"""Tool calling: tools into the prompt, tool calls out of the generated text, and a grammar for tool_choice.

Format: Hermes / Qwen 2.5 (NousResearch's Hermes function calling, which Qwen2.5's chat template uses): the
model writes each call as

    <tool_call>
    {"name": "<function name>", "arguments": {<JSON arguments>}}
    </tool_call>

| piece            | what it does                                                                                |
|------------------|---------------------------------------------------------------------------------------------|
| prompt           | a chat template that takes `tools` (it mentions them) gets them as they are; for one that   |
|                  | does not (SmolLM2's), a system message lists the tools and the format above, and the        |
|                  | history's assistant tool calls and tool results are rendered as that text                   |
| parse_hermes     | the generated text -> (content outside the calls or None, the calls in OpenAI's shape)      |
| tool_call_grammar| tool_choice "required" or a named function: a Lark grammar (llguidance, with its %json     |
|                  | schema rules) that only lets the model write well-formed calls of the allowed functions     |

tool_choice "none" leaves the tools out of the prompt and parses nothing; "auto" (the default with tools) puts them
in and parses what the model writes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from loom.server.protocol import check_unicode

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument (it names the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _tool_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For a template that knows nothing of tools: the tools described in a system message (merged into the
    conversation's own system message if it has one), assistant tool calls and tool results as Hermes text.
    The calls' arguments are objects (arguments_as_objects first), as the model is told to write them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            text = "\n".join(f"{_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": c["function"]["arguments"]},  # an object
                                                       ensure_ascii=False) + "\n</tool_call>" for c in calls)
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("role") == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if tools:
        system = ("You may call one or more functions to assist with the user query. The functions are, one "
                  "JSON signature per line:\n<tools>\n" + _tool_json(tools) + "\n</tools>\nFor each function "
                  "call, return a JSON object with the function name and its arguments within <tool_call></tool_call> "
                  "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
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


def parse_hermes(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a generated text. A call is a <tool_call> block holding a JSON object with a string
    "name" and an object "arguments"; a block that is not is left in the content. A last block cut before its
    closing tag counts when its JSON is complete. Calls get fresh ids, arguments as a JSON string (OpenAI's shape).
    With `names`, a call of a function not among them stays content too (the model made it up).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    blocks = [(m.start(), m.end(), m.group(1)) for m in _CALL.finditer(text)]
    tail = text.rfind(_OPEN)
    if tail >= 0 and (not blocks or tail >= blocks[-1][1]):
        blocks.append((tail, len(text), text[tail + len(_OPEN):].strip()))
    for start, end, body in blocks:
        call = _call_of(body)
        if call is None or (names is not None and call["function"]["name"] not in names):
            continue
        kept.append(text[pos:start])
        calls.append(call)
        pos = end
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call_of(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


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
    rule)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or []:
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


def tool_call_grammar(tools: list[dict[str, Any]], only: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance) of one call, or up to one per function when `parallel`, of the tools (or only
    the named one):
    each `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` with the arguments held to the function's
    JSON schema.

    Raises:
        ValueError: `only` names no tool.
    """
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not functions:
        raise ValueError(f"tool_choice names {only!r}, which is not among the tools")
    defs: dict[str, Any] = {}
    options = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": _hoist_defs(f.get("parameters") or {"type": "object"}, defs, f["name"])},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_pattern": r"[\x20]{0,1}"}}
    if defs:  # the schema's own refs say #/$defs/... or #/definitions/...: both point here
        schema["$defs"] = defs
        schema["definitions"] = defs
    # at most one call per function: a small model, free to add calls, repeats one until max_tokens
    most = len(functions) if parallel else 1
    return (f'start: (call "\\n"?) ~ 1..{most}\ncall: "<tool_call>\\n" args "\\n</tool_call>"\n'
            f"args: %json {json.dumps(schema)}\n")


def held_back(text: str) -> int:
    """Characters at the end of a streamed text that could begin "<tool_call>" (not sent until they cannot)."""
    for size in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-size:]):
            return size
    return 0


__all__ = ["template_takes_tools", "fallback_messages", "arguments_as_objects", "parse_hermes",
           "check_tools", "check_tool_history", "tool_call_grammar", "held_back"]
