"""The result cache in front of the engine (`loom serve --result-cache-size N`): look up before submitting,
store after a whole, successful response, replay hits as the same bytes with a fresh id and created.

The cache and its key are loom/router/result_cache.py's; this module ties them to a request: the key covers the
model identity, the token ids the engine would run, the canonical SamplingParams, the tenant and the whole body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from loom.router.result_cache import (
    RESULT_CACHE_HEADER, CachedResponse, ResultCache, body_is_complete, events_are_complete, parse_cache_control,
    request_key, tenant_of,
)
from loom.router.sse import replay
from loom.sampling_params import SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # as EngineStreamingResponse sends


@dataclass(slots=True)
class CacheLookup:
    """One request's dealings with the result cache: its key, what was found, whether to store."""

    cache: ResultCache | None  # None: the server has no result cache
    key: str | None  # None: this request bypasses the cache
    store: bool  # the fresh response may be stored
    looked_up: bool  # the cache was asked (False: bypassed, or Cache-Control no-cache)
    found: CachedResponse | None  # the stored response on a hit

    @property
    def status(self) -> str:
        """The x-loom-result-cache header's value: hit, miss (looked up, not found) or bypass."""
        if self.found is not None:
            return "hit"
        return "miss" if self.looked_up else "bypass"

    def hit_response(self, response_id: str, created: int) -> Response:
        """The stored response with `response_id` and `created` filled in: a JSON body or a replayed stream."""
        assert self.found is not None
        return replay(self.found, response_id, created, {RESULT_CACHE_HEADER: "hit"}, SSE_HEADERS)

    def finish(self, response: Response) -> Response:
        """Mark a fresh response with the cache status; store its body when it is whole and successful."""
        if self.cache is not None:
            response.headers[RESULT_CACHE_HEADER] = self.status
        if self._storing and response.status_code == 200 and isinstance(response.body, bytes) \
                and body_is_complete(response.body):
            assert self.cache is not None and self.key is not None
            self.cache.put(self.key, CachedResponse.of_body(response.body, "application/json"))
        return response

    def finish_stream(self, response: StreamingResponse) -> StreamingResponse:
        """Mark a fresh stream with the cache status (its events are stored by `record`)."""
        if self.cache is not None:
            response.headers[RESULT_CACHE_HEADER] = self.status
        return response

    async def record(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pass a fresh stream's events through and store them once the last was sent, when the stream is whole
        and successful. A client that leaves closes this generator at a `yield`, so nothing is stored."""
        if not self._storing:
            async for event in events:
                yield event
            return
        kept: list[bytes] = []
        async for event in events:
            kept.append(event.encode("utf-8"))
            yield event
        if events_are_complete(kept):
            assert self.cache is not None and self.key is not None
            self.cache.put(self.key, CachedResponse.of_events(kept))

    @property
    def _storing(self) -> bool:
        return self.cache is not None and self.key is not None and self.store


def params_key(params: Any) -> str:
    """The canonical text of the engine's parameters: SamplingParams.cache_key(), or a beam search's fields."""
    if isinstance(params, SamplingParams):
        return params.cache_key()
    return repr(sorted(dataclasses.asdict(params).items()))


def deterministic(params: Any) -> bool:
    """The request's answer is reproducible: greedy, seeded, or a beam search (which does not sample)."""
    return params.deterministic if isinstance(params, SamplingParams) else True


def look_up(cache: ResultCache | None, model_identity: str, raw: Request, body: Any,
            prompt_token_ids: Sequence[Sequence[int]], params: Any) -> CacheLookup:
    """Key the request and look it up. Bypassed (key None) when the server has no cache, the request is not
    deterministic, or its Cache-Control says no-cache / no-store (no-cache still stores the fresh answer)."""
    if cache is None:
        return CacheLookup(None, None, False, False, None)
    if getattr(body, "kv_transfer_params", None):  # a disaggregation step: a prefill's answer names blocks freed
        cache.note_bypass()  # once pulled, so it is never replayed
        return CacheLookup(cache, None, False, False, None)
    control = parse_cache_control(raw.headers.get("cache-control"))
    if not deterministic(params) or not (control.lookup or control.store):
        cache.note_bypass()
        return CacheLookup(cache, None, False, False, None)
    key = request_key(model_identity=model_identity, route=raw.url.path,
                      body=body.model_dump(mode="json"), tenant=tenant_of(raw.headers.get("authorization"),
                                                                           body.cache_salt),
                      prompt_token_ids=prompt_token_ids, sampling_key=params_key(params))
    if not control.lookup:
        cache.note_bypass()
        return CacheLookup(cache, key, True, False, None)
    return CacheLookup(cache, key, True, True, cache.get(key))


class ResultCacheCollector(Collector):
    """The cache's counters and size as `loom:result_cache_*` Prometheus metrics, read at scrape time."""

    def __init__(self, cache: ResultCache, model_name: str) -> None:
        self._cache = cache
        self._model_name = model_name

    def collect(self) -> Iterator[Any]:
        s = self._cache.stats()
        labels = ["model_name"]
        for name, doc, value in (
                ("hits", "Requests answered from the result cache.", s.hits),
                ("misses", "Deterministic requests looked up and not found in the result cache.", s.misses),
                ("bypasses", "Requests that skipped the result cache (not deterministic, or Cache-Control).",
                 s.bypasses),
                ("stores", "Responses stored in the result cache.", s.stores),
                ("evictions", "Result cache entries evicted to stay within its bounds (LRU).", s.evictions),
                ("expirations", "Result cache entries dropped after their TTL.", s.expirations)):
            counter = CounterMetricFamily(f"loom:result_cache_{name}", doc, labels=labels)
            counter.add_metric([self._model_name], value)
            yield counter
        for name, doc, value in (("entries", "Responses held in the result cache.", s.entries),
                                 ("bytes", "Bytes held by the result cache.", s.bytes)):
            gauge = GaugeMetricFamily(f"loom:result_cache_{name}", doc, labels=labels)
            gauge.add_metric([self._model_name], value)
            yield gauge


__all__ = ["CacheLookup", "look_up", "params_key", "deterministic", "ResultCacheCollector", "SSE_HEADERS"]
