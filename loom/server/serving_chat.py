"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loom.engine.async_engine import RequestStream
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams
from loom.server.protocol import ChatCompletionRequest, ChatMessage, RequestError, to_sampling_params
from loom.server.tool_calls import (
    arguments_as_objects, check_tool_history, check_tools, fallback_messages, held_back, parse_hermes, template_takes_tools,
    tool_call_grammar,
)
from loom.server.serving_common import (
    SSE_DONE, EngineStreamingResponse, ServingContext, chat_logprobs, check_model, check_prompt_logprobs, check_room,
    check_structured_output, collect, prompt_logprobs_body, prompt_logprobs_done, new_request_id, now_unix, raise_if_failed, sse, submit_all, until_disconnected, usage,
)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain {"role", "content"} dicts for the chat template; text content parts are joined.

    Raises RequestError (param "messages") for non-text content parts.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text content parts are supported",
                                       "messages")
                texts.append(part["text"])
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


@dataclass(slots=True)
class _Tools:
    """The tools a chat request puts in the prompt and how its output is read."""

    tools: list[dict[str, Any]] | None  # in the prompt; None: no tools
    grammar: str | None  # tool_choice "required" or a named function: the calls the output must be
    parallel: bool  # more than one call allowed
    parse: bool = True  # read calls out of the output (False under tool_choice "none")

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}


def _tools_of(body: ChatCompletionRequest) -> _Tools:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        check_tools(tools or [])
    except ValueError as e:
        raise RequestError(str(e), "tools") from e
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (choice == "auto" and not tools):
        # "none": the model still sees the tools (as OpenAI and vLLM do) but nothing is parsed or forced
        return _Tools(tools, None, True, parse=False)
    if not tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        return _Tools(tools, None, parallel)
    only = None if choice == "required" else choice.function.name
    try:
        return _Tools(tools, tool_call_grammar(tools, only, parallel), parallel)
    except ValueError as e:
        raise RequestError(str(e), "tool_choice") from e


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage], body: Any = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the templated conversation, with the template options of `body` (a request with
    add_generation_prompt, continue_final_message, chat_template_kwargs) when given, and `tools` (through the
    template when it takes them, else tool_calls.fallback_messages). Raises RequestError when the options or
    the template refuse it."""
    dicts = messages_to_dicts(messages)
    try:
        dicts = arguments_as_objects(dicts)
        check_tool_history(dicts)
        if not template_takes_tools(ctx.engine.tokenizer) and (
                tools or any("tool_calls" in d or d["role"] == "tool" for d in dicts)):
            dicts, tools = fallback_messages(dicts, tools), None
    except ValueError as e:
        raise RequestError(str(e), "messages") from e
    options: dict[str, Any] = {}
    if body is not None:
        options = {"add_generation_prompt": body.add_generation_prompt,
                   "continue_final_message": body.continue_final_message,
                   "chat_template_kwargs": body.chat_template_kwargs}
        if body.continue_final_message and body.add_generation_prompt:
            raise RequestError("continue_final_message needs add_generation_prompt false", "continue_final_message")
        if body.continue_final_message and messages[-1].role != "assistant":
            raise RequestError("continue_final_message needs the last message to be an assistant turn",
                               "continue_final_message")
    if tools:
        options["tools"] = tools
    try:
        return ctx.engine.apply_chat_template(dicts, **options)
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError and friends: the conversation is bad
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise RequestError(f"messages could not be rendered by the chat template: {e}", param) from e


def _validate(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams, int | None,
                                                                      _Tools]:
    check_model(ctx, body.model)
    tools = _tools_of(body)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                               "top_logprobs")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 0:
        raise RequestError(f"{name} must be >= 0, got {max_tokens}", name)
    check_prompt_logprobs(body)
    params = to_sampling_params(body, max_tokens, ctx.engine.vocab_size, num_top, body.prompt_logprobs)
    check_structured_output(ctx, body, params)
    if tools.grammar is not None:  # tool_choice required / named: the grammar holds the output to valid calls
        if params.structured_output is not None:
            raise RequestError("tool_choice required or a named function cannot be combined with a response "
                               "format or another constraint", "tool_choice")
        params.structured_output = StructuredOutputParams(grammar=tools.grammar)
        try:
            params.verify()
            ctx.engine.check_structured_output(params)
        except ValueError as e:
            raise RequestError(str(e), "tools") from e
    prompt_ids = chat_prompt_ids(ctx, body.messages, body, tools.tools)
    check_room(ctx, len(prompt_ids), max_tokens, name, prompt_name="messages")
    return prompt_ids, params, num_top, tools


def _logprobs(ctx: ServingContext, c: CompletionOutput, start: int, num_top: int | None) -> dict[str, Any] | None:
    if num_top is None:
        return None
    return {"content": chat_logprobs(ctx.engine.tokenizer, c.token_ids[start:], (c.logprobs or [])[start:], num_top)}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    """Serve one /v1/chat/completions request. Raises RequestError for client errors (400/404/503)."""
    arrival = time.monotonic()
    # templating (and tokenizing) a long conversation is CPU work: off the event loop, as is rendering below
    prompt_ids, params, num_top, tools = await asyncio.to_thread(_validate, ctx, body)
    streams = await submit_all(ctx, "chatcmpl", [prompt_ids], params, arrival, body.cache_salt)
    response_id = f"chatcmpl-{body.request_id}" if body.request_id else new_request_id("chatcmpl")
    if body.stream:
        return EngineStreamingResponse(_stream(ctx, body, streams[0], response_id, num_top, tools), streams)
    try:
        gone, finals = await until_disconnected(raw, collect(streams), ctx.disconnect_poll_s)
    finally:
        streams[0].close()
    if gone:
        return Response(status_code=499)
    raise_if_failed(finals)
    return await asyncio.to_thread(_render, ctx, finals[0], response_id, num_top, body.prompt_logprobs, tools)


def _message(c: CompletionOutput, tools: _Tools | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a choice and its finish reason: tool calls parsed out when tools are on."""
    if tools is None or tools.tools is None or not tools.parse:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = parse_hermes(c.text, tools.names)
    if not calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    if not tools.parallel:
        calls = calls[:1]
    finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, finish


def _render(ctx: ServingContext, out: RequestOutput, response_id: str, num_top: int | None,
            num_prompt_top: int | None = None, tools: _Tools | None = None) -> JSONResponse:
    """The non-streamed chat.completion body (logprobs decoded, JSON encoded): run in a worker thread."""
    choices = []
    for c in out.outputs:
        message, finish = _message(c, tools)
        choices.append({"index": c.index, "message": message, "logprobs": _logprobs(ctx, c, 0, num_top),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": now_unix(), "model": ctx.model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
        **({} if num_prompt_top is None else {"prompt_logprobs": prompt_logprobs_body(
            ctx.engine.tokenizer, out.prompt_token_ids, out.prompt_logprobs, num_prompt_top)}),
    })


@dataclass(slots=True)
class _Sent:
    chars: int = 0  # characters of the cumulative text sent
    tokens: int = 0  # generated tokens whose logprobs were sent
    started: bool = False  # the role chunk went out
    finished: bool = False


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, stream: RequestStream, response_id: str,
                  num_top: int | None, tools: _Tools | None = None) -> AsyncIterator[str]:
    """SSE chunks. With tools on, content streams until a "<tool_call>" could begin (a possible start is held
    back); the calls go out parsed, whole, in the choice's last chunk (one delta per call, OpenAI's shape)."""
    reading_tools = tools is not None and tools.tools is not None and tools.parse
    created = now_unix()
    sent: dict[int, _Sent] = {}
    last = None
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    null_usage = {"usage": None} if with_usage else {}  # OpenAI: every chunk but the last carries usage null

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None,
              extra: dict[str, Any] | None = None) -> str:
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": ctx.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **null_usage, **(extra or {})})

    # prompt_logprobs: in the stream's first chunk, top-level as in the non-streamed body; that chunk waits
    # until all of them have arrived (chunked prefill delivers them over several steps)
    prompt_top = body.prompt_logprobs
    try:
        async for out in stream:
            last = out
            for c in out.outputs:
                s = sent.setdefault(c.index, _Sent())
                if s.finished:
                    continue
                if not s.started:
                    if prompt_top is not None and not prompt_logprobs_done(out) and c.finish_reason is None:
                        continue  # nothing sent for this choice yet, so nothing is lost by waiting
                    s.started = True
                    extra = None
                    if prompt_top is not None:
                        extra = {"prompt_logprobs": await asyncio.to_thread(
                            prompt_logprobs_body, ctx.engine.tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                            prompt_top)}
                        prompt_top = None
                    yield chunk(c.index, {"role": "assistant", "content": ""}, None, None, extra)
                finished = c.finish_reason is not None
                delta: dict[str, Any] = {}
                finish = c.finish_reason
                if reading_tools:
                    if not finished:
                        cut = c.text.find("<tool_call>")
                        end = cut if cut >= 0 else len(c.text) - held_back(c.text)
                        text = c.text[s.chars:max(end, s.chars)]
                        s.chars += len(text)
                    else:  # the rest, with the calls parsed out of it
                        rest, calls = parse_hermes(c.text[s.chars:], tools.names)
                        text = rest or ""
                        if calls:
                            calls = calls if tools.parallel else calls[:1]
                            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                            finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
                        s.chars = len(c.text)
                else:
                    text = c.text[s.chars:]
                    s.chars = len(c.text)
                logprobs = _logprobs(ctx, c, s.tokens, num_top)
                s.tokens = len(c.token_ids)
                s.finished = finished
                if text:
                    delta = {"content": text, **delta}
                if delta or s.finished or (logprobs and logprobs["content"]):
                    yield chunk(c.index, delta, logprobs, finish)
        if with_usage and last is not None:
            yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": ctx.model_name, "choices": [],
                       "usage": usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                      last.num_cached_tokens)})
        yield SSE_DONE
    finally:
        stream.close()


__all__ = ["create_chat_completion", "chat_prompt_ids", "messages_to_dicts"]
