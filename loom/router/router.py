"""The router's work per request: choose a model and a replica, forward, fail over, cache.

Per request: parse the body, pick the model (the one named, or a model selector's choice for the routing
alias), filter the replicas that can serve it (healthy, not draining, serving that model), let the policy
pick one, and forward the request, streaming the answer through as it comes.

Failover: a replica that fails before the client has seen a token (connection refused or reset, a 503, a
stream cut before its first token) is marked and the request is sent to another replica, up to
`max_attempts` replicas; a stream cut after tokens were forwarded ends with an SSE error event naming the
replica, then `data: [DONE]`, never a hang (an upstream that stops answering is cut after
`upstream_timeout_s`). A client that disconnects closes the upstream request, which aborts it at the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from loom.router.disagg import prefill_then_decode
from loom.router.metrics import RouterMetrics
from loom.router.policy import (
    ModelSelector, PolicyOptions, ReplicaState, RouteRequest, RoutingPolicy, make_model_selector, make_policy,
)
from loom.router.replica import ReplicaSet
from loom.router.result_cache import (
    CachedResponse, ResultCache, body_is_complete, body_is_deterministic, events_are_complete, parse_cache_control,
    request_key,
)
from loom.router.sse import ROUTER_CACHE_HEADER, has_output, replay_response, sse_events

logger = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[bool]]  # starlette's Request.is_disconnected
_CLIENT_GONE = 499  # nginx's "client closed request": a status nobody receives, for the metrics

# response headers passed back to the client as the replica sent them
_PASSED_HEADERS = ("content-type", "retry-after", "x-request-id", "x-loom-result-cache", "x-loom-model-identity")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router routes and how long it waits. Bad values raise ValueError naming the field."""

    policy: str = "cache_aware"  # a registered RoutingPolicy (round_robin, least_load, cache_aware)
    policy_options: PolicyOptions = field(default_factory=PolicyOptions)
    model_selector: str | None = None  # a registered ModelSelector for `routing_alias`; None: no alias
    model_selector_options: dict[str, Any] = field(default_factory=dict)
    routing_alias: str = "auto"  # the model name that asks the model selector to choose
    health_interval_s: float = 1.0  # seconds between health checks of every replica
    health_timeout_s: float = 2.0  # seconds a health check may take
    connect_timeout_s: float = 5.0  # seconds to open a connection to a replica
    upstream_timeout_s: float = 600.0  # seconds a replica may stay silent mid-response before it is cut
    max_attempts: int = 3  # replicas one request may be tried on (failover)
    max_failures: int = 2  # failed checks or connections in a row before a replica is unhealthy
    disconnect_poll_s: float = 0.05  # how often a non-streamed request checks that its client is still there
    result_cache_size: int = 0  # whole responses kept by the router's result cache (0: no cache)
    result_cache_ttl_s: float = 600.0  # an entry's lifetime, seconds
    result_cache_max_bytes: int = 256 << 20  # bytes the router's result cache may hold

    def __post_init__(self) -> None:
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "upstream_timeout_s",
                     "disconnect_poll_s", "result_cache_ttl_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")
        if not self.routing_alias:
            raise ValueError("routing_alias must not be empty")
        if self.result_cache_size < 0:
            raise ValueError(f"result_cache_size must be >= 0, got {self.result_cache_size}")
        if self.result_cache_max_bytes < 1:
            raise ValueError(f"result_cache_max_bytes must be >= 1, got {self.result_cache_max_bytes}")


class _ReplicaFailed(Exception):
    """The replica failed before the client saw a token: the request may go to another one."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause  # metric label: "connect", "read", "status_503", "stream_cut"


class _ClientGone(Exception):
    """The client disconnected while the router waited on the replica."""


async def _unless_disconnected(awaitable: Awaitable[Any], is_disconnected: Disconnected | None,
                               poll_s: float) -> Any:
    """The result of `awaitable`; raises _ClientGone (cancelling it) as soon as the client has gone, checked
    every `poll_s` seconds. A replica answers a non-streamed request only when it is done, so without this a
    client that left would keep its request running there to the end."""
    if is_disconnected is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await is_disconnected():
                raise _ClientGone()
    except _ClientGone:
        if task.done() and not task.cancelled() and task.exception() is None:
            await _close_result(task.result())  # it finished while the client was being checked: close it
        raise
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task


async def _close_result(result: Any) -> None:
    """Close an opened upstream response (alone, or first in a tuple) that nobody will read."""
    response = result[0] if isinstance(result, tuple) else result
    if isinstance(response, httpx.Response):
        await response.aclose()


class _StreamingWithCleanup(StreamingResponse):
    """A StreamingResponse that runs `cleanup` however it ends: a client gone before the body's first chunk
    cancels the response before its generator ever runs, so the generator's own `finally` cannot be relied on
    (that would leave the replica's request running and the router's in-flight count up)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def error_body(message: str, status: int, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    kind = ("invalid_request_error" if 400 <= status < 500 else
            "service_unavailable" if status == 503 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """The error as a JSON response (503s say Retry-After); code and param by keyword, never by position."""
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(message, status, code=code, param=param), status_code=status, headers=headers)


class Router:
    """The router's state: the replica set, the policy, the HTTP client and the health-check task."""

    def __init__(self, replicas: ReplicaSet, config: RouterConfig, prefill_replicas: ReplicaSet | None = None) -> None:
        """`replicas` answer requests; with `prefill_replicas` (loom serve --kv-transfer-role producer), each
        request is prefilled on one of those first and `replicas` (consumers) pull its KV blocks and decode
        (prefill/decode disaggregation, docs/disaggregation.md)."""
        self.replicas = replicas
        # (empty: no disaggregation; POST /router/add with "role": "prefill" adds to it at run time)
        self.prefill_replicas = prefill_replicas if prefill_replicas is not None else ReplicaSet([])
        self.config = config
        self.policy: RoutingPolicy = make_policy(config.policy, config.policy_options)
        # prefill replicas have prefix caches of their own: the same policy, its own memory
        self.prefill_policy: RoutingPolicy = make_policy(config.policy, config.policy_options)
        self.selector: ModelSelector | None = (make_model_selector(config.model_selector,
                                                                   config.model_selector_options)
                                               if config.model_selector else None)
        self.cache: ResultCache | None = (ResultCache(config.result_cache_size, config.result_cache_max_bytes,
                                                      config.result_cache_ttl_s)
                                          if config.result_cache_size else None)
        self.metrics = RouterMetrics(self.cache)
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.created = int(time.time())

    # -- lifecycle --
    async def start(self) -> None:
        """Open the client, run a first health check of every replica, then keep checking in the background."""
        timeout = httpx.Timeout(self.config.upstream_timeout_s, connect=self.config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                              max_keepalive_connections=256))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="loom-router-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    async def check_health(self) -> None:
        assert self.client is not None
        await self.replicas.check_all(self.client, self.config.health_timeout_s)
        await self.prefill_replicas.check_all(self.client, self.config.health_timeout_s)
        self.metrics.observe_replicas(self._all_replicas())

    def _all_replicas(self) -> list[ReplicaState]:
        return [*self.replicas, *self.prefill_replicas]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad check
                logger.exception("health check round failed")

    # -- fleet administration --
    def add_replica(self, url: str, role: str = "serve") -> ReplicaState:
        """Add a replica that answers requests (role "serve"/"decode") or prefills them ("prefill").
        Raises ValueError for a bad role, a bad URL or one already in the fleet."""
        if role not in ("serve", "decode", "prefill"):
            raise ValueError(f"role must be serve, decode or prefill, got {role!r}")
        if self._find(url) is not None:
            raise ValueError(f"replica {url} is already in the fleet")
        return (self.prefill_replicas if role == "prefill" else self.replicas).add(url)

    def remove_replica(self, url: str) -> ReplicaState:
        """Take a replica (of either role) out of the fleet. Raises ValueError for an unknown URL."""
        state = self._find(url)
        if state is None:
            raise ValueError(f"replica {url} is not in the fleet")
        owner = self.replicas if self.replicas.get(state.url) is state else self.prefill_replicas
        owner.remove(state.url)
        self.policy.on_removed(state.url)
        self.prefill_policy.on_removed(state.url)
        self.metrics.forget(state.url)
        return state

    def drain(self, url: str, draining: bool = True) -> ReplicaState:
        """Stop (or resume) routing new requests to a replica of either role. Raises ValueError for an unknown
        URL."""
        state = self._find(url)
        if state is None:
            raise ValueError(f"replica {url} is not in the fleet")
        state.draining = draining
        self.metrics.observe_replicas(self._all_replicas())
        return state

    def _find(self, url: str) -> ReplicaState | None:
        """The replica at `url` in either set. Raises ValueError for a malformed URL."""
        return self.replicas.get(url) or self.prefill_replicas.get(url)

    # -- routing --
    def resolve_model(self, request: RouteRequest) -> tuple[str | None, str]:
        """(model, version) to serve `request` with. The model selector decides for the routing alias;
        `name@version` pins the replicas whose model identity digest starts with `version` (>= 8 hex digits:
        during a rolling upgrade a client can stay on one version).

        Raises:
            KeyError: no replica has reported this model (HTTP 404).
            LookupError: no replica can serve it now (HTTP 503), with the reason.
            ValueError: a malformed version (HTTP 400).
        """
        known = self.replicas.known_models()
        alias = self.config.routing_alias
        # a replica's real model of the alias's name wins: a request naming a model is never re-routed
        if request.model == alias and self.selector is not None and alias not in known:
            models = self.replicas.models()
            if not models:
                raise LookupError("no healthy replica")
            chosen = self.selector.select(request, models)
            self.metrics.model_selections.labels(self.selector.name, chosen).inc()
            return chosen, ""
        if not len(self.replicas):
            raise LookupError("the fleet has no replicas (POST /router/add)")
        if not known:
            raise LookupError("no replica has answered a health check yet")
        model, version = request.model, ""
        if model is not None and model not in known and "@" in model:
            model, _, version = model.rpartition("@")
            if len(version) < 8 or any(c not in "0123456789abcdef" for c in version):
                raise ValueError(f"model: the version after '@' must be >= 8 lowercase hex digits of a model "
                                 f"identity digest (GET /router/replicas lists them), got {version!r}")
            if model == alias and self.selector is not None:
                raise ValueError(f"model: the routing alias {alias!r} chooses the model itself and takes no version")
        if model is not None and model not in known:
            raise KeyError(f"The model '{model}' does not exist: the fleet serves {sorted(known)}.")
        if version and not any(model in r.models and r.identity.startswith(version) for r in self.replicas):
            raise KeyError(f"No replica has served the model '{model}' at version {version}: GET /router/replicas "
                           "lists the identities.")
        return model, version

    async def forward(self, request: RouteRequest, raw_headers: dict[str, str],
                      is_disconnected: Disconnected | None = None) -> Response:
        """Route and forward one request, with failover before its first token. `is_disconnected` tells whether
        the client has gone (a non-streamed answer is then abandoned, which aborts it at the replica)."""
        assert self.client is not None
        try:
            model, version = self.resolve_model(request)
        except KeyError as e:
            return error_response(404, str(e.args[0]), code="model_not_found", param="model")
        except ValueError as e:
            return error_response(400, str(e), param="model")
        except LookupError as e:
            return error_response(503, f"No replica can serve this request: {e}.", code="no_replica")
        body = dict(request.body)
        if model is not None:
            body["model"] = model
        payload = json.dumps(body).encode()
        stream = body.get("stream") is True
        control = parse_cache_control(raw_headers.get("cache-control"))
        cacheable = (self.cache is not None and body_is_deterministic(body) and not body.get("kv_transfer_params")
                     and (control.lookup or control.store))
        if self.cache is not None and not (cacheable and control.lookup):  # not looked up: a bypass
            self.cache.note_bypass()
        tried: set[str] = set()
        last_error = (f"no replica serving {model or 'it'}" + (f" at version {version}" if version else "")
                      + " is healthy and not draining")
        for _ in range(self.config.max_attempts):
            candidates = self.replicas.eligible(model, tried, version)
            if not candidates:
                break
            decision = self.policy.choose(request, candidates)
            replica = decision.replica
            key = None
            if cacheable and replica.identity:  # the key holds the identity of the model that would answer
                assert self.cache is not None
                try:
                    key = request_key(model_identity=replica.identity, route=request.path, body=body,
                                      tenant=request.tenant)
                except ValueError:
                    key = None
                found = self.cache.get(key) if key is not None and control.lookup else None
                if found is not None:
                    return replay_response(found, request.path)
            tried.add(replica.url)
            self.metrics.record_decision(self.policy.name, decision.reason, len(request.text),
                                         decision.matched_chars)
            self.policy.on_routed(request, replica)
            prefill = self._choose_prefill(request, model, version, replica)
            try:
                response = await self._send(replica, request.path, payload, raw_headers, stream,
                                            key if control.store else None, prefill, body, is_disconnected)
                if self.cache is not None:
                    response.headers[ROUTER_CACHE_HEADER] = "miss" if key is not None and control.lookup else "bypass"
                return response
            except _ReplicaFailed as e:
                last_error = f"replica {replica.url} failed ({e.cause})"
                self.metrics.retries.labels(e.cause).inc()
                logger.warning("%s before the first token; trying another replica", last_error)
        return error_response(503, f"No replica could serve this request: {last_error}.", code="no_replica")

    def _choose_prefill(self, request: RouteRequest, model: str | None, version: str,
                        decode: ReplicaState) -> ReplicaState | None:
        """The prefill replica for a request `decode` will decode (None: not disaggregated: no healthy producer,
        or `decode` is not a consumer). Roles come from each replica's /load."""
        if not len(self.prefill_replicas) or decode.kv_transfer_role not in ("consumer", "both"):
            return None
        # the same model identity as the decode replica: K/V of another build would decode into garbage
        candidates = [r for r in self.prefill_replicas.eligible(model, version=decode.identity or version)
                      if r.kv_transfer_role in ("producer", "both") and r.identity == decode.identity]
        if not candidates:
            return None  # the decode replica computes the prompt itself: slower, the same answer
        decision = self.prefill_policy.choose(request, candidates)
        self.prefill_policy.on_routed(request, decision.replica)
        self.metrics.record_decision(f"prefill_{self.prefill_policy.name}", decision.reason, 0, 0)
        return decision.replica

    async def _open(self, replica: ReplicaState, path: str, payload: bytes, headers: dict[str, str],
                    prefill: ReplicaState | None, body: dict[str, Any]) -> tuple[httpx.Response, bool]:
        """The replica's response, opened as a stream; with `prefill`, after that replica prefilled it. The flag
        says whether the replica was given prefilled blocks to pull."""
        assert self.client is not None
        if prefill is None:
            return await self.client.send(self.client.build_request("POST", replica.url + path, content=payload,
                                                                    headers=headers), stream=True), False
        prefill.in_flight += 1
        try:
            return await prefill_then_decode(self.client, prefill.url, replica.url, path, body, headers)
        finally:
            prefill.in_flight -= 1

    async def _send(self, replica: ReplicaState, path: str, payload: bytes, headers: dict[str, str],
                    stream: bool, store_key: str | None, prefill: ReplicaState | None = None,
                    body: dict[str, Any] | None = None, is_disconnected: Disconnected | None = None) -> Response:
        """Send to one replica (after `prefill` when disaggregated); store its whole, successful answer under
        `store_key` (None: do not store). Raises _ReplicaFailed when nothing has reached the client yet."""
        assert self.client is not None
        start = time.monotonic()
        replica.in_flight += 1
        released = False

        def release(status: int) -> None:
            nonlocal released
            if not released:
                released = True
                replica.in_flight -= 1
                self.metrics.requests.labels(replica.url, str(status)).inc()
                self.metrics.latency.labels(replica.url).observe(time.monotonic() - start)

        try:
            upstream, prefilled = await _unless_disconnected(
                self._open(replica, path, payload, headers, prefill, body or {}), is_disconnected,
                self.config.disconnect_poll_s)
        except _ClientGone:  # cancelling the send closed its connection: the replica aborts the request
            release(_CLIENT_GONE)
            return Response(status_code=_CLIENT_GONE)  # nobody reads it
        except httpx.HTTPError as e:
            release(0)
            self.replicas.mark_failed(replica)
            raise _ReplicaFailed("connect") from e
        except Exception as e:  # noqa: BLE001 - a replica that answers garbage must not become a 500 here
            release(0)
            self.replicas.mark_failed(replica)
            logger.warning("replica %s answered something unreadable: %r", replica.url, e)
            raise _ReplicaFailed("protocol") from e
        if upstream.status_code == 503:  # its engine is not running or its queue is full: another may serve
            await upstream.aclose()
            release(503)
            raise _ReplicaFailed("status_503")
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() in _PASSED_HEADERS}
        out_headers["x-loom-replica"] = replica.url
        if prefill is not None and prefilled:
            out_headers["x-loom-prefill-replica"] = prefill.url
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if store_key is not None and upstream.headers.get("x-loom-model-identity") != replica.identity:
            store_key = None  # the replica now runs another model than its last health check said: do not store
        if not (stream and is_sse):
            try:
                content = await _unless_disconnected(upstream.aread(), is_disconnected,
                                                     self.config.disconnect_poll_s)
            except httpx.HTTPError as e:
                release(0)
                self.replicas.mark_failed(replica)
                raise _ReplicaFailed("read") from e
            except _ClientGone:
                release(_CLIENT_GONE)
                return Response(status_code=_CLIENT_GONE)
            finally:
                await upstream.aclose()  # a client that left: closing aborts the request at the replica
            self.metrics.ttfb.labels(replica.url).observe(time.monotonic() - start)
            release(upstream.status_code)
            if store_key is not None and upstream.status_code == 200 and body_is_complete(content):
                assert self.cache is not None
                self.cache.put(store_key, CachedResponse.of_body(content, upstream.headers.get(
                    "content-type", "application/json")))
            return Response(content, status_code=upstream.status_code, headers=out_headers)

        # a stream: hold events back until one carries a token, so a failure before it can still move
        events = sse_events(upstream)
        held: list[bytes] = []

        async def until_first_output() -> None:
            async for event in events:
                held.append(event)
                if has_output(event):
                    return
            raise httpx.RemoteProtocolError("the stream ended before its first token")

        try:
            await _unless_disconnected(until_first_output(), is_disconnected, self.config.disconnect_poll_s)
        except _ClientGone:
            await upstream.aclose()
            release(_CLIENT_GONE)
            return Response(status_code=_CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - httpx errors, and anything a malformed stream raises
            await upstream.aclose()
            release(0)
            self.replicas.mark_failed(replica)
            raise _ReplicaFailed("stream_cut" if isinstance(e, httpx.HTTPError) else "protocol") from e
        self.metrics.ttfb.labels(replica.url).observe(time.monotonic() - start)

        async def rest() -> AsyncIterator[bytes]:
            status = upstream.status_code
            kept: list[bytes] | None = [] if store_key is not None and status == 200 else None
            try:
                for event in held:
                    if kept is not None:
                        kept.append(event)
                    yield event
                async for event in events:
                    if kept is not None:
                        kept.append(event)
                    yield event
                if kept is not None and events_are_complete(kept):  # a client that left never gets here
                    assert self.cache is not None and store_key is not None
                    self.cache.put(store_key, CachedResponse.of_events(kept))
            except httpx.HTTPError as e:
                status = 0
                self.metrics.failed_streams.inc()
                self.replicas.mark_failed(replica)
                message = (f"replica {replica.url} failed after the stream had started "
                           f"({type(e).__name__}); the response is incomplete")
                logger.warning(message)
                yield b"data: " + json.dumps(error_body(message, 503, code="replica_failed")).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                await upstream.aclose()  # a client that left: closes the replica's request, which aborts it
                release(status)

        async def cleanup() -> None:  # idempotent: release() and aclose() both are
            await upstream.aclose()
            release(0)

        return _StreamingWithCleanup(rest(), cleanup, status_code=upstream.status_code, headers=out_headers)


__all__ = ["Router", "RouterConfig", "error_response"]
