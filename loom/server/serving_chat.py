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
from loom.sampling_params import MAX_LOGPROBS, SamplingParams
from loom.server.protocol import ChatCompletionRequest, ChatMessage, RequestError, to_sampling_params
from loom.server.serving_common import (
    SSE_DONE, EngineStreamingResponse, ServingContext, chat_logprobs, check_model, check_prompt_logprobs, check_room,
    check_structured_output, collect, prompt_logprobs_body, new_request_id, now_unix, raise_if_failed, sse, submit_all, until_disconnected, usage,
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
        out.append(d)
    return out


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage], body: Any = None) -> list[int]:
    """Token ids of the templated conversation, with the template options of `body` (a request with
    add_generation_prompt, continue_final_message, chat_template_kwargs) when given. Raises RequestError when
    the options or the template refuse it."""
    dicts = messages_to_dicts(messages)
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
    try:
        return ctx.engine.apply_chat_template(dicts, **options)
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError and friends: the conversation is bad
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise RequestError(f"messages could not be rendered by the chat template: {e}", param) from e


def _validate(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams, int | None]:
    check_model(ctx, body.model)
    if body.tools:
        raise RequestError("tools are not supported", "tools")
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
    prompt_ids = chat_prompt_ids(ctx, body.messages, body)
    check_room(ctx, len(prompt_ids), max_tokens, name)
    return prompt_ids, params, num_top


def _logprobs(ctx: ServingContext, c: CompletionOutput, start: int, num_top: int | None) -> dict[str, Any] | None:
    if num_top is None:
        return None
    return {"content": chat_logprobs(ctx.engine.tokenizer, c.token_ids[start:], (c.logprobs or [])[start:], num_top)}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    """Serve one /v1/chat/completions request. Raises RequestError for client errors (400/404/503)."""
    arrival = time.monotonic()
    # templating (and tokenizing) a long conversation is CPU work: off the event loop, as is rendering below
    prompt_ids, params, num_top = await asyncio.to_thread(_validate, ctx, body)
    streams = await submit_all(ctx, "chatcmpl", [prompt_ids], params, arrival, body.cache_salt)
    response_id = f"chatcmpl-{body.request_id}" if body.request_id else new_request_id("chatcmpl")
    if body.stream:
        return EngineStreamingResponse(_stream(ctx, body, streams[0], response_id, num_top), streams)
    try:
        gone, finals = await until_disconnected(raw, collect(streams), ctx.disconnect_poll_s)
    finally:
        streams[0].close()
    if gone:
        return Response(status_code=499)
    raise_if_failed(finals)
    return await asyncio.to_thread(_render, ctx, finals[0], response_id, num_top, body.prompt_logprobs)


def _render(ctx: ServingContext, out: RequestOutput, response_id: str, num_top: int | None,
            num_prompt_top: int | None = None) -> JSONResponse:
    """The non-streamed chat.completion body (logprobs decoded, JSON encoded): run in a worker thread."""
    choices = [{
        "index": c.index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": _logprobs(ctx, c, 0, num_top),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    } for c in out.outputs]
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
                  num_top: int | None) -> AsyncIterator[str]:
    created = now_unix()
    sent: dict[int, _Sent] = {}
    last = None
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    null_usage = {"usage": None} if with_usage else {}  # OpenAI: every chunk but the last carries usage null

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> str:
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": ctx.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **null_usage})

    try:
        async for out in stream:
            last = out
            for c in out.outputs:
                s = sent.setdefault(c.index, _Sent())
                if s.finished:
                    continue
                if not s.started:
                    s.started = True
                    yield chunk(c.index, {"role": "assistant", "content": ""}, None, None)
                text = c.text[s.chars:]
                logprobs = _logprobs(ctx, c, s.tokens, num_top)
                s.chars, s.tokens = len(c.text), len(c.token_ids)
                s.finished = c.finish_reason is not None
                if text or s.finished or (logprobs and logprobs["content"]):
                    yield chunk(c.index, {"content": text} if text else {}, logprobs, c.finish_reason)
        if with_usage and last is not None:
            yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": ctx.model_name, "choices": [],
                       "usage": usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                      last.num_cached_tokens)})
        yield SSE_DONE
    finally:
        stream.close()


__all__ = ["create_chat_completion", "chat_prompt_ids", "messages_to_dicts"]
