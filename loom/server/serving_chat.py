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
from loom.engine.llm import join_text_parts
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams
from loom.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    RequestError,
    to_beam_search_params,
    to_sampling_params,
)
from loom.server.tool_calls import (
    CallStream, arguments_as_objects, check_tool_history, check_tools, fallback_messages, is_special_token,
    openai_call, read_calls, template_takes_tools, tool_call_grammar,
)
from loom.server.tool_parsers import ToolCallParser
from loom.server.serving_result_cache import look_up
from loom.server.serving_common import (
    SSE_DONE, SSE_ENGINE_ERROR, EngineStreamingResponse, ServingContext, chat_logprobs, check_beam_width,
    check_kv_transfer, check_model, check_prompt_logprobs, check_room, check_structured_output, collect, failed,
    new_request_id, now_unix, prompt_logprobs_body, prompt_logprobs_done, raise_if_failed, sse, submit_all,
    until_disconnected, usage,
)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain {"role", "content"} dicts for the chat template; text content parts are joined.

    Raises RequestError (param "messages") for non-text content parts.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = join_text_parts(content)
            if content is None:
                raise RequestError(f"messages[{i}].content: only text content parts are supported", "messages")
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

    @property
    def reading(self) -> bool:
        """Calls are read out of the output."""
        return self.tools is not None and self.parse

    @property
    def forced(self) -> bool:
        """The grammar makes the whole output calls (tool_choice required or named)."""
        return self.grammar is not None


def _tools_of(body: ChatCompletionRequest, parser: ToolCallParser, tokenizer: Any) -> _Tools:
    tools = tool_dicts(body.tools)
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
        return _Tools(tools, tool_call_grammar(tools, parser, only, parallel, tokenizer), parallel)
    except ValueError as e:
        raise RequestError(str(e), "tool_choice") from e


def tool_dicts(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """A request's tool definitions as plain dicts, checked. Raises RequestError (param "tools")."""
    dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        check_tools(dicts or [])
    except ValueError as e:
        raise RequestError(str(e), "tools") from e
    return dicts


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage], body: Any = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the templated conversation, with the template options of `body` (a request with
    add_generation_prompt, continue_final_message, chat_template_kwargs) when given, and `tools` (through the
    template when it takes them, else tool_calls.fallback_messages in the server's tool-call format). Raises
    RequestError when the options or the template refuse it."""
    dicts = messages_to_dicts(messages)
    try:
        dicts = arguments_as_objects(dicts)
        check_tool_history(dicts)
        if not template_takes_tools(ctx.engine.tokenizer) and (
                tools or any("tool_calls" in d or d["role"] == "tool" for d in dicts)):
            dicts, tools = fallback_messages(dicts, tools, ctx.tool_parser), None
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
    tools = _tools_of(body, ctx.tool_parser, ctx.engine.tokenizer)
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
    beam = to_beam_search_params(body, max_tokens, ctx.engine.vocab_size)
    if beam is not None:  # tools, logprobs and streaming are refused with it
        check_beam_width(ctx, beam, "n")
        prompt_ids = chat_prompt_ids(ctx, body.messages, body, None)
        check_room(ctx, len(prompt_ids), max_tokens, name, prompt_name="messages")
        return prompt_ids, beam, None, tools
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
    if tools.reading and is_special_token(ctx.engine.tokenizer, ctx.tool_parser.marker):
        params.skip_special_tokens = False  # the marker that begins calls (Mistral's [TOOL_CALLS]) must stay
    prompt_ids = chat_prompt_ids(ctx, body.messages, body, tools.tools)
    check_room(ctx, len(prompt_ids), max_tokens, name, prompt_name="messages")
    check_kv_transfer(body)
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
    response_id = f"chatcmpl-{body.request_id}" if body.request_id else new_request_id("chatcmpl")
    cached = look_up(ctx.result_cache, ctx.model_identity, raw, body, [prompt_ids], params)
    if cached.found is not None:
        return cached.hit_response(response_id, now_unix())
    streams = await submit_all(ctx, "chatcmpl", [prompt_ids], params, arrival, body.cache_salt,
                               body.kv_transfer_params)
    if body.stream:
        return cached.finish_stream(EngineStreamingResponse(
            cached.record(_stream(ctx, body, streams[0], response_id, num_top, tools)), streams))
    try:
        gone, finals = await until_disconnected(raw, collect(streams), ctx.disconnect_poll_s)
    finally:
        streams[0].close()
    if gone:
        return Response(status_code=499)
    raise_if_failed(finals)
    return cached.finish(await asyncio.to_thread(_render, ctx, finals[0], response_id, num_top,
                                                 body.prompt_logprobs, tools))


def _message(ctx: ServingContext, c: CompletionOutput, tools: _Tools | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a choice and its finish reason: tool calls parsed out when tools are on."""
    if tools is None or not tools.reading:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = read_calls(ctx.tool_parser, c.text, tools.names, tools.forced)
    if not calls:
        return {"role": "assistant", "content": content}, c.finish_reason
    if not tools.parallel:
        calls = calls[:1]
    finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    return {"role": "assistant", "content": content,
            "tool_calls": [openai_call(ctx.tool_parser, call) for call in calls]}, finish


def _render(ctx: ServingContext, out: RequestOutput, response_id: str, num_top: int | None,
            num_prompt_top: int | None = None, tools: _Tools | None = None) -> JSONResponse:
    """The non-streamed chat.completion body (logprobs decoded, JSON encoded): run in a worker thread."""
    choices = []
    for c in out.outputs:
        message, finish = _message(ctx, c, tools)
        choices.append({"index": c.index, "message": message, "logprobs": _logprobs(ctx, c, 0, num_top),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": now_unix(), "model": ctx.model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
        **({} if num_prompt_top is None else {"prompt_logprobs": prompt_logprobs_body(
            ctx.engine.tokenizer, out.prompt_token_ids, out.prompt_logprobs, num_prompt_top)}),
        **({"kv_transfer_params": out.kv_transfer_params} if out.kv_transfer_params else {}),
    })


@dataclass(slots=True)
class _Sent:
    chars: int = 0  # characters of the cumulative text sent (without tools)
    tokens: int = 0  # generated tokens whose logprobs were sent
    started: bool = False  # the role chunk went out
    finished: bool = False
    calls: CallStream | None = None  # with tools: what of the content and calls went out


def _tool_delta(ctx: ServingContext, s: _Sent, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool call deltas) newly readable in a choice's text; each call whole, in OpenAI's delta shape
    (index, id, type, function name and arguments), as soon as it is complete."""
    assert s.calls is not None
    first = s.calls.calls_sent
    content, calls = (s.calls.finish if finished else s.calls.step)(text)
    return content, [{"index": first + k, **openai_call(ctx.tool_parser, call)} for k, call in enumerate(calls)]


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, stream: RequestStream, response_id: str,
                  num_top: int | None, tools: _Tools | None = None) -> AsyncIterator[str]:
    """SSE chunks. With tools on, content streams as soon as no later text can change it (never call markup; the
    whitespace before a possible call waits), and each call goes out whole as soon as it is complete; the
    content and calls add up to the non-streamed message (tool_calls.CallStream)."""
    reading = tools is not None and tools.reading
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
                    if reading:
                        assert tools is not None
                        s.calls = CallStream(ctx.tool_parser, tools.names, tools.parallel, tools.forced)
                    yield chunk(c.index, {"role": "assistant", "content": ""}, None, None, extra)
                finished = c.finish_reason is not None
                delta: dict[str, Any] = {}
                finish = c.finish_reason
                if s.calls is not None:
                    text, calls = _tool_delta(ctx, s, c.text, finished)
                    if calls:
                        delta["tool_calls"] = calls
                    if finished and s.calls.any_calls and c.finish_reason == "stop":
                        finish = "tool_calls"
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
        if last is not None and failed([last]):
            yield SSE_ENGINE_ERROR
        yield SSE_DONE
    finally:
        stream.close()


__all__ = ["create_chat_completion", "chat_prompt_ids", "messages_to_dicts", "tool_dicts"]
