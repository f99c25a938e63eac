"""Server-sent events as the router passes them on: splitting a replica's stream into events, telling a
stream's first output event from its opening role chunk, and replaying a stored stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from starlette.responses import Response, StreamingResponse

from loom.router.result_cache import CachedResponse

ROUTER_CACHE_HEADER = "x-loom-router-result-cache"  # the router's own result cache: hit | miss | bypass


async def sse_events(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The SSE events of a response, each with its terminating blank line, as bytes."""
    buffer = b""
    async for chunk in upstream.aiter_raw():
        buffer += chunk
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            yield buffer[:end + 2]
            buffer = buffer[end + 2:]
    if buffer.strip():
        raise httpx.RemoteProtocolError("the stream ended inside an event")



def has_output(event: bytes) -> bool:
    """Whether one SSE event carries output (text, a tool call, a finish reason, an error, or [DONE]), as opposed
    to a chat stream's opening role-only chunk: once such an event is forwarded, the request cannot move."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return True
        if not isinstance(payload, dict) or "error" in payload or not isinstance(payload.get("choices"), list) \
                or not payload["choices"]:
            return True
        for choice in payload["choices"]:
            if not isinstance(choice, dict):
                return True  # not ours to judge: pass it on as output
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if (choice.get("text") or choice.get("finish_reason") or delta.get("content")
                    or delta.get("tool_calls") or delta.get("reasoning_content") or choice.get("logprobs")):
                return True
    return False



def replay(found: CachedResponse, response_id: str, created: int, headers: dict[str, str],
           stream_headers: dict[str, str]) -> Response:
    """A stored response with `response_id` and `created` filled in: a JSON body, or its SSE events replayed as a
    stream (with `stream_headers` too). Used by the router's and loom serve's result caches."""
    if not found.streamed:
        return Response(found.render_body(response_id, created), media_type=found.media_type, headers=headers)
    events = found.render_events(response_id, created)

    async def events_again() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    return StreamingResponse(events_again(), media_type=found.media_type, headers={**stream_headers, **headers})


def replay_response(found: CachedResponse, path: str) -> Response:
    """A router result-cache hit: the stored bytes with a fresh id and created."""
    prefix = "chatcmpl" if path.endswith("/chat/completions") else "cmpl"
    return replay(found, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), {ROUTER_CACHE_HEADER: "hit"},
                  {"Cache-Control": "no-cache"})

__all__ = ["ROUTER_CACHE_HEADER", "has_output", "replay", "replay_response", "sse_events"]
