"""Pieces shared by the completion and chat handlers: submission, disconnects, SSE, logprobs."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loom.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from loom.kv_transfer.base import parse_kv_transfer_request
from loom.outputs import PositionLogprobs, RequestOutput
from loom.router.result_cache import ResultCache
from loom.sampling_params import MAX_LOGPROBS, SamplingParams
from loom.server.protocol import RequestError, param_of, structured_output_error
from loom.server.tool_parsers import HermesParser, ToolCallParser

NEG_INF_LOGPROB = -9999.0  # what -inf (and NaN) logprobs become: JSON has no infinities
RETRY_AFTER_S = 1  # Retry-After of a 503 when the waiting queue is full, seconds


@dataclass(slots=True)
class ServingContext:
    """What every handler needs; one per app."""

    engine: AsyncLLMEngine  # the shared async engine front
    model_name: str  # served model name (the `model` field of requests and responses)
    disconnect_poll_s: float  # how often a non-streaming handler checks for a gone client, seconds
    tool_parser: ToolCallParser = field(default_factory=HermesParser)  # the tool-call format (--tool-call-parser)
    result_cache: ResultCache | None = None  # whole responses of deterministic requests (--result-cache-size)
    model_identity: str = ""  # ModelIdentity.digest of the served model (the result cache's key part)


def check_model(ctx: ServingContext, model: str | None) -> None:
    """Raise RequestError (404) unless `model` is None or the served model."""
    if model is not None and model != ctx.model_name:
        raise RequestError(f"The model `{model}` does not exist.", "model", 404, "model_not_found")


def check_beam_width(ctx: ServingContext, params: Any, param: str) -> None:
    """A beam search wider than the engine's running seats is a 400 naming `param` (n or best_of)."""
    seats = ctx.engine.max_num_seqs
    if seats is not None and params.beam_width > seats:
        raise RequestError(f"the beam width ({param} = {params.beam_width}) must be <= the server's max_num_seqs "
                           f"({seats}): each beam takes a running seat", param)


def check_structured_output(ctx: ServingContext, body: Any, params: SamplingParams) -> None:
    """Compile the request's structured-output constraint now (in the handler's worker thread), so a bad
    schema, regex or grammar is a 400 naming the field that carried it."""
    if params.structured_output is None:
        return
    try:
        ctx.engine.check_structured_output(params)
    except ValueError as e:
        raise structured_output_error(e, body) from e


def check_room(ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, name: str,
               prompt_name: str = "prompt", default: bool = False) -> None:
    """vLLM's rule: a request may not ask for more tokens than the context has room for after its prompt.

    Args:
        name: the field of max_tokens (max_tokens or max_completion_tokens); default: it was not sent.
        prompt_name: the field of the prompt (prompt, or messages for chat).

    Raises:
        RequestError: naming the prompt when it alone leaves no room, else `name`.
    """
    limit = ctx.engine.max_model_len
    if num_prompt_tokens > limit or (num_prompt_tokens == limit and max_tokens != 0):
        raise RequestError(f"{prompt_name} of {num_prompt_tokens} tokens leaves no room to generate within "
                           f"max_model_len={limit}", prompt_name)
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        asked = f"{max_tokens} in the completion" + (f" ({name}'s default)" if default else "")
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_name}, "
                           f"{asked}). Reduce the {prompt_name} or {name}.", name)


def new_request_id(prefix: str) -> str:
    """A fresh engine-unique id; client-supplied ids are never used inside the engine."""
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def now_unix() -> int:
    return int(time.time())


def check_kv_transfer(body: Any, num_prompts: int = 1) -> None:
    """Validate kv_transfer_params at the edge (disaggregation): its shape and one prompt. Raises RequestError."""
    if not body.kv_transfer_params:
        return
    try:
        parse_kv_transfer_request(body.kv_transfer_params)
    except ValueError as e:
        raise RequestError(str(e), "kv_transfer_params") from e
    if num_prompts != 1:
        raise RequestError("kv_transfer_params needs a single prompt", "kv_transfer_params")


async def submit_all(ctx: ServingContext, prefix: str, prompts: Sequence[str | list[int]],
                     params: SamplingParams, arrival_time: float,
                     cache_salt: str | None, kv_transfer_params: dict[str, Any] | None = None) -> list[RequestStream]:
    """Add one engine request per prompt. All or nothing: on error, those added are aborted.

    Raises RequestError: 400 for bad prompts, 503 when the waiting queue is full or the engine is down.
    """
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            transfer = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {}
            streams.append(await ctx.engine.add_request(new_request_id(prefix), prompt, params,
                                                        arrival_time=arrival_time, cache_salt=cache_salt, **transfer))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, QueueFullError):
            raise RequestError("The server is overloaded: too many requests waiting. Retry later.",
                               None, 503, "queue_full") from e
        if isinstance(e, EngineDeadError):
            raise RequestError("The engine is not running.", None, 503, "engine_not_running") from e
        if isinstance(e, ValueError) and not isinstance(e, RequestError):
            raise RequestError(str(e), param_of(str(e)) or "prompt") from e
        raise
    return streams


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item[1], BaseException):
                raise item[1]
            yield item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The final RequestOutput of each stream, in stream order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


async def until_disconnected(raw: Request, work: Awaitable[Any], poll_s: float) -> tuple[bool, Any]:
    """Run `work` while watching the client; returns (True, None) as soon as the client is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return False, task.result()
            if await raw.is_disconnected():
                return True, None
    finally:
        if not task.done():
            task.cancel()


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event; raises ValueError rather than emit a non-finite float."""
    return f"data: {json.dumps(obj, allow_nan=False, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# after a choice ended with finish_reason "error" (the engine failed mid-stream): why, in the shape of a non-streamed
# error, so a client (or loom router) sees a message, not just a truncated answer
SSE_ENGINE_ERROR = sse({"error": {"message": "The engine failed while serving this request; the output is "
                                  "incomplete.", "type": "internal_server_error", "param": None,
                                  "code": "engine_error"}})


def failed(outputs: Sequence[RequestOutput]) -> bool:
    """Whether any choice of these outputs ended because the engine failed."""
    return any(c.finish_reason == "error" for out in outputs for c in out.outputs)


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its engine streams however the response ends.

    The body generator's own `finally` does not run if the client leaves before the first chunk,
    so the streams are closed here too (closing twice is harmless).
    """

    def __init__(self, content: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = list(streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def token_text(tokenizer: Any, token_id: int, entry: PositionLogprobs | None) -> str:
    lp = entry.get(token_id) if entry else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def top_entries(entry: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """(token id, logprob) of the `num_top` best-ranked tokens, best first."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return [(t, clamp_logprob(lp.logprob)) for t, lp in ranked if lp.rank <= num_top][:num_top]


def prompt_logprobs_body(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None] | None,
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (as a string):
    {"logprob", "rank", "decoded_token"}} for the prompt's own token and the `num_top` best."""
    entries = list(entries or [None] * len(token_ids))
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        keep = {t for t, _ in top_entries(entry, num_top)} | {token_id}
        out.append({str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                             "decoded_token": token_text(tokenizer, t, entry)}
                    for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if t in keep})
    return out


def check_prompt_logprobs(body: Any) -> None:
    """Raise RequestError unless `prompt_logprobs` is in range. Streamed requests get them in their first chunk
    (`prompt_logprobs_done`); vLLM refuses prompt_logprobs > 0 with stream=true."""
    if body.prompt_logprobs is None:
        return
    if not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
        raise RequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {body.prompt_logprobs}",
                           "prompt_logprobs")


def prompt_logprobs_done(out: RequestOutput) -> bool:
    """Every prompt position's logprobs has arrived (a chunked prefill delivers them over several steps; the
    first generated token comes with the last of them)."""
    return out.prompt_logprobs is not None and len(out.prompt_logprobs) >= len(out.prompt_token_ids)


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int],
                        entries: Sequence[PositionLogprobs | None], num_top: int,
                        first_offset: int) -> dict[str, Any]:
    """The /v1/completions `logprobs` object for `token_ids` (entries[i] belongs to token_ids[i])."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = first_offset
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id, entry)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        chosen = entry.get(token_id)
        token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        top = {token_text(tokenizer, t, entry): lp for t, lp in top_entries(entry, num_top)}
        if chosen is not None:
            top.setdefault(text, clamp_logprob(chosen.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None],
                  num_top: int) -> list[dict[str, Any]]:
    """The chat `logprobs.content` list for `token_ids`."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id, entry)
        chosen = entry.get(token_id) if entry else None
        top = [] if entry is None else [
            {"token": (t_text := token_text(tokenizer, t, entry)), "logprob": lp,
             "bytes": list(t_text.encode("utf-8"))}
            for t, lp in top_entries(entry, num_top)]
        content.append({
            "token": text,
            "logprob": clamp_logprob(chosen.logprob) if chosen is not None else NEG_INF_LOGPROB,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": top,
        })
    return content


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def raise_if_failed(finals: Sequence[RequestOutput]) -> None:
    reasons = {c.finish_reason for o in finals for c in o.outputs}
    if "error" in reasons:
        raise RequestError("The engine failed while serving this request.", None, 500, "engine_error")
    if "abort" in reasons:
        raise RequestError("The request was aborted (the server is shutting down).", None, 503, "aborted")
