"""An exact cache of whole responses: a deterministic request asked again gets the stored answer.

Used by `loom serve --result-cache-size N` (loom/server/serving_result_cache.py) and by the router, which keys
on the request body where it has no tokenizer. Torch-free, like loom.core.

What makes it exact (docs/serving.md, "Result cache"):
- the key (`request_key`) is a sha256 over the model identity (weights, quantization, dtypes, tokenizer and
  template hashes: loom/engine/model_identity.py), the route, the tenant (`tenant_of`: the Authorization
  header's hash and the cache_salt), the prompt's token ids after templating where the caller has them, the
  canonical SamplingParams, and the whole request body (anything else that changes the response's bytes:
  stream, stream_options, echo, logprobs, tools, n, user, ...);
- only deterministic requests are cached (`body_is_deterministic`: temperature 0 or a seed);
- only whole successful responses are stored (`body_is_complete`, `events_are_complete`): never an error, a
  choice that ended in "error" or "abort", or a stream cut short;
- a hit is the stored bytes with a fresh `id` and `created` (`CachedResponse.render_body` / `render_events`); a
  stream replays as the same SSE events.

Standard HTTP request directives (RFC 9111 section 5.2.1) opt out (`parse_cache_control`): `no-cache` (or
`max-age=0`) skips the lookup and stores the fresh answer; `no-store` neither looks up nor stores.
"""

from __future__ import annotations

import array
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RESULT_CACHE_HEADER = "x-loom-result-cache"  # response header: hit | miss | bypass
KEY_VERSION = "loom-result-cache-1"  # bump when the key's layout changes
FAILED_FINISH_REASONS = frozenset({"error", "abort"})
_ENTRY_OVERHEAD_BYTES = 256  # bookkeeping per entry (key, node, tuples), counted against max_bytes
# the head every loom response and stream event starts with: {"id": ..., "object": ..., "created": N
_HEAD = re.compile(rb'(?:data: )?\{"id": ?"((?:[^"\\]|\\.)*)", ?"object": ?"[^"\\]*", ?"created": ?(\d+)')
_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class CacheControl:
    """What a request's Cache-Control header allows."""

    lookup: bool = True  # a stored answer may be served
    store: bool = True  # the fresh answer may be stored


def parse_cache_control(header: str | None) -> CacheControl:
    """The request directives of a Cache-Control header (RFC 9111 5.2.1), case-insensitive: `no-store` -> no
    lookup and no store; `no-cache` or `max-age=0` -> no lookup, the fresh answer is stored. Anything else (or
    None) -> both allowed."""
    if not header:
        return CacheControl()
    directives = {d.strip().lower().replace(" ", "") for d in header.split(",")}
    if "no-store" in directives:
        return CacheControl(lookup=False, store=False)
    if "no-cache" in directives or "max-age=0" in directives:
        return CacheControl(lookup=False, store=True)
    return CacheControl()


def tenant_of(authorization: str | None, cache_salt: str | None) -> str:
    """Who asks, as a hash: the Authorization header (the bearer token) and the request's cache_salt. Two
    requests share cache entries only when both agree."""
    text = json.dumps([authorization or "", cache_salt or ""], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def body_is_deterministic(body: Mapping[str, Any]) -> bool:
    """True when an OpenAI-style body asks for a reproducible answer: temperature 0, a seed, or beam search
    (which does not sample). A missing temperature means 1.0 (sampled)."""
    if body.get("use_beam_search") is True:
        return True
    temperature = body.get("temperature")
    seed = body.get("seed")
    return (temperature is not None and temperature == 0) or (seed is not None and not isinstance(seed, bool))


def canonical_body(body: Mapping[str, Any]) -> str:
    """The body as JSON with its top-level keys sorted (their order never matters); nested objects keep their
    order (a JSON schema's property order orders the output)."""
    return json.dumps({k: body[k] for k in sorted(body)}, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False)


def request_key(*, model_identity: str, route: str, body: Mapping[str, Any] | str, tenant: str,
                prompt_token_ids: Sequence[Sequence[int]] = (), sampling_key: str = "") -> str:
    """The cache key (sha256 hex) of one request.

    Args:
        model_identity: ModelIdentity.digest of the model that answers (the /v1/models card's
            loom_model_identity.digest at the router).
        route: the path, e.g. "/v1/chat/completions".
        body: the request body (a mapping, made canonical by canonical_body) or its canonical text.
        tenant: tenant_of(Authorization header, cache_salt).
        prompt_token_ids: the token ids the engine runs, one list per prompt (empty where the caller has no
            tokenizer: the body then stands for them).
        sampling_key: SamplingParams.cache_key() of the engine's parameters ("" where the caller has none).

    Raises:
        ValueError: the body holds a non-finite float (it cannot be a JSON request).
    """
    if not model_identity:
        raise ValueError("model_identity must be a non-empty digest")
    digest = hashlib.sha256()
    text = body if isinstance(body, str) else canonical_body(body)
    for part in (KEY_VERSION, model_identity, route, tenant, sampling_key, str(len(prompt_token_ids))):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    for ids in prompt_token_ids:  # lengths first, so [[1, 2], [3]] and [[1], [2, 3]] differ
        digest.update(f"{len(ids)}\0".encode())
        digest.update(array.array("q", ids).tobytes())
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _json_objects(chunks: Sequence[bytes]) -> list[dict[str, Any]] | None:
    out = []
    for chunk in chunks:
        try:
            obj = json.loads(chunk)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(obj, dict):
            return None
        out.append(obj)
    return out


def _choices_finished(objs: Sequence[Mapping[str, Any]]) -> bool:
    """Every choice that appears ends with a finish reason, and none ended in error or abort."""
    seen: set[Any] = set()
    finished: set[Any] = set()
    for obj in objs:
        if "error" in obj:
            return False
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                return False
            seen.add(choice.get("index"))
            reason = choice.get("finish_reason")
            if reason in FAILED_FINISH_REASONS:
                return False
            if reason is not None:
                finished.add(choice.get("index"))
    return bool(seen) and seen == finished


def body_is_complete(body: bytes) -> bool:
    """A non-streamed response body fit to store: a JSON object, no error, every choice finished and none in
    error or abort."""
    objs = _json_objects([body])
    return objs is not None and _choices_finished(objs)


def events_are_complete(events: Sequence[bytes]) -> bool:
    """A whole SSE stream fit to store: it ends with `data: [DONE]`, every other event is one JSON object with no
    error, every choice finished and none in error or abort."""
    if not events or events[-1].strip() != _DONE:
        return False
    datas = []
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return False
        datas.append(event[len(b"data: "):])
    objs = _json_objects(datas)
    return objs is not None and _choices_finished(objs)


def _template(chunk: bytes) -> tuple[bytes, ...]:
    """(before id, between id and created, after created), or (chunk,) when it has no such head."""
    m = _HEAD.match(chunk)
    if m is None:
        return (chunk,)
    return chunk[:m.start(1)], chunk[m.end(1):m.start(2)], chunk[m.end(2):]


def _render(parts: tuple[bytes, ...], response_id: bytes, created: bytes) -> bytes:
    if len(parts) == 1:
        return parts[0]
    return parts[0] + response_id + parts[1] + created + parts[2]


def _id_bytes(response_id: str) -> bytes:
    return json.dumps(response_id, ensure_ascii=False)[1:-1].encode()  # as the JSON encoder escapes it


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """One stored response, whole: a JSON body or the SSE events of a stream, each held as a template whose
    `id` and `created` are filled in per hit."""

    media_type: str  # "application/json" or "text/event-stream"
    body: tuple[bytes, ...] | None  # the JSON body's template (non-streamed), else None
    events: tuple[tuple[bytes, ...], ...] | None  # each SSE event's template, in order (streamed), else None
    nbytes: int  # bytes held (the templates' lengths)

    @property
    def streamed(self) -> bool:
        return self.events is not None

    @classmethod
    def of_body(cls, body: bytes, media_type: str = "application/json") -> "CachedResponse":
        """From a whole response body."""
        parts = _template(body)
        return cls(media_type, parts, None, sum(map(len, parts)))

    @classmethod
    def of_events(cls, events: Sequence[bytes]) -> "CachedResponse":
        """From the SSE events of a whole stream (each `data: ...\\n\\n`), the last one `data: [DONE]`."""
        templates = tuple(_template(e) for e in events)
        return cls("text/event-stream", None, templates, sum(len(p) for t in templates for p in t))

    def render_body(self, response_id: str, created: int) -> bytes:
        """The stored body with `response_id` and `created` (Unix seconds) in place of the stored ones."""
        assert self.body is not None, "a streamed response has events, not a body"
        return _render(self.body, _id_bytes(response_id), str(int(created)).encode())

    def render_events(self, response_id: str, created: int) -> list[bytes]:
        """The stored events with `response_id` and `created` in every event that had them."""
        assert self.events is not None, "a non-streamed response has a body, not events"
        rid, ts = _id_bytes(response_id), str(int(created)).encode()
        return [_render(t, rid, ts) for t in self.events]


@dataclass(slots=True)
class ResultCacheStats:
    """Counters since start-up plus the current size (a snapshot)."""

    hits: int = 0  # lookups served from the cache
    misses: int = 0  # lookups that found nothing (or an expired entry)
    bypasses: int = 0  # requests not looked up (not deterministic, or Cache-Control)
    stores: int = 0  # responses stored
    evictions: int = 0  # entries dropped to stay within max_entries / max_bytes (least recently used first)
    expirations: int = 0  # entries dropped because their TTL had passed
    entries: int = 0  # entries held now
    bytes: int = 0  # bytes held now (responses plus a fixed overhead per entry)


@dataclass(slots=True)
class _Entry:
    response: CachedResponse  # what is replayed
    expires_at: float  # clock() time after which it is dropped, seconds
    nbytes: int  # charged against max_bytes


@dataclass(slots=True)
class ResultCache:
    """An LRU map from request_key() to whole responses, bounded in entries and bytes, each entry living at most
    ttl_s seconds. Thread-safe (one lock); every operation is O(1) apart from evicting.

    Raises:
        ValueError: max_entries < 1, max_bytes < 1 or ttl_s <= 0 (naming the parameter).
    """

    max_entries: int  # most entries held
    max_bytes: int = 256 << 20  # most bytes held (CachedResponse.nbytes plus a fixed overhead per entry)
    ttl_s: float = 600.0  # an entry's lifetime from when it was stored, seconds
    clock: Callable[[], float] = time.monotonic  # seconds; tests inject a fake one
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)  # least recently used first
    _stats: ResultCacheStats = field(default_factory=ResultCacheStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if isinstance(self.max_entries, bool) or not isinstance(self.max_entries, int) or self.max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {self.max_entries!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {self.max_bytes!r}")
        if not (isinstance(self.ttl_s, (int, float)) and self.ttl_s > 0 and self.ttl_s != float("inf")):
            raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {self.ttl_s!r}")

    def get(self, key: str) -> CachedResponse | None:
        """The response stored under `key` (now the most recently used), or None; counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self.clock() >= entry.expires_at:
                self._drop(key)
                self._stats.expirations += 1
                entry = None
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return entry.response

    def put(self, key: str, response: CachedResponse) -> bool:
        """Store `response` under `key` (replacing any entry), evicting least recently used entries to fit.
        Returns False, storing nothing, when the response alone exceeds max_bytes."""
        nbytes = response.nbytes + len(key) + _ENTRY_OVERHEAD_BYTES
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = _Entry(response, self.clock() + self.ttl_s, nbytes)
            self._stats.bytes += nbytes
            self._stats.stores += 1
            while len(self._entries) > self.max_entries or self._stats.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self._stats.evictions += 1
            return True

    def note_bypass(self) -> None:
        """Count a request that was not looked up (not deterministic, or its Cache-Control)."""
        with self._lock:
            self._stats.bypasses += 1

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            self._entries.clear()
            self._stats.bytes = 0

    def stats(self) -> ResultCacheStats:
        """A snapshot of the counters and the current size."""
        with self._lock:
            s = self._stats
            return ResultCacheStats(s.hits, s.misses, s.bypasses, s.stores, s.evictions, s.expirations,
                                    len(self._entries), s.bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: str) -> None:
        self._stats.bytes -= self._entries.pop(key).nbytes


__all__ = [
    "RESULT_CACHE_HEADER", "CacheControl", "parse_cache_control", "tenant_of", "body_is_deterministic",
    "canonical_body", "request_key", "body_is_complete", "events_are_complete", "CachedResponse",
    "ResultCacheStats", "ResultCache",
]
