"""`loom router`'s HTTP app: the OpenAI routes forwarded through a Router, health, models, metrics, admin.

The routing itself (model, replica, failover, result cache, disaggregation) is loom/router/router.py.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loom.router.policy import ReplicaState, RouteRequest
from loom.router.result_cache import tenant_of
from loom.router.router import Router, error_response
from loom.server.content_type import is_json_content_type, not_json_message
from loom.server.security import SecurityConfig, install_security

_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one text, for prefix matching: a completion's prompt (strings joined; token-id prompts give
    their ids as text), or the chat messages' roles and text contents in order."""
    if "messages" in body and isinstance(body["messages"], list):
        parts: list[str] = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            parts.append(str(m.get("role", "")))
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p if isinstance(p, str) else json.dumps(p) for p in prompt)
    return ""


def _forwarded_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "content-type", "accept", "x-request-id", "cache-control")
    headers = {k: v for k, v in request.headers.items() if k.lower() in keep or k.lower().startswith("x-loom-")}
    headers["content-type"] = "application/json"
    return headers


def build_router_app(router: Router, security: SecurityConfig | None = None,
                     admin_api_key: str | None = None) -> FastAPI:
    """The router's FastAPI app. Its lifespan starts and stops `router` (health checks, HTTP client).

    The /router/* admin routes (add, remove, drain a replica) need `Authorization: Bearer <admin_api_key>`, or,
    without an admin key, a client on this machine: adding a replica hands it other clients' prompts and
    Authorization headers, so it must not be open to every API client."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="loom router", description="OpenAI-compatible router over loom serve replicas",
                  lifespan=lifespan)
    app.state.router = router
    install_security(app, security or SecurityConfig())

    async def on_http(_: Request, exc: Exception) -> Response:  # unknown routes and methods: OpenAI's error shape
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    app.add_exception_handler(StarletteHTTPException, on_http)

    async def routed(raw: Request) -> Response:
        if not is_json_content_type(raw.headers.get("content-type")):  # as `loom serve` answers: a form-encoded body
            # (curl -d) reached the replicas as JSON
            return error_response(415, not_json_message(raw.headers.get("content-type")))
        try:
            body = json.loads(await raw.body())
        except (ValueError, RecursionError) as e:
            return error_response(400, f"Malformed JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.")
        if "kv_transfer_params" in body:  # set by the router between its own replicas, never by a client
            return error_response(400, "kv_transfer_params: set by the router for prefill/decode disaggregation "
                                  "(--prefill-replica); a client may not send it", param="kv_transfer_params")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return error_response(400, f"model must be a string, got {model!r}", param="model")
        salt = body.get("cache_salt")
        request = RouteRequest(raw.url.path, model, prompt_text(body), body,
                               tenant_of(raw.headers.get("authorization"), salt if isinstance(salt, str) else None))
        return await router.forward(request, _forwarded_headers(raw), raw.is_disconnected)

    for path in _ROUTED_PATHS:
        app.add_api_route(path, routed, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if not router.replicas.eligible(None):
            return error_response(503, "No healthy replica.", code="no_replica")
        return JSONResponse({"status": "ok"})

    def model_ids() -> list[str]:
        ids = router.replicas.models()
        alias = router.config.routing_alias
        if router.selector is not None and ids and alias not in ids:
            ids = [alias, *ids]
        return ids

    def model_card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": router.created, "owned_by": "loom"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in model_ids()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:  # the openai client's models.retrieve
        if model_id not in model_ids():
            return error_response(404, f"The model '{model_id}' does not exist: the fleet serves {model_ids()}.",
                                  code="model_not_found", param="model")
        return JSONResponse(model_card(model_id))

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.observe_replicas(router._all_replicas())
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/replicas")
    async def list_replicas() -> dict[str, Any]:
        def card(r: ReplicaState, role: str) -> dict[str, Any]:
            return {"url": r.url, "role": role, "models": list(r.models), "identity": r.identity,
                    "healthy": r.healthy, "draining": r.draining, "in_flight": r.in_flight,
                    "num_requests_running": r.num_running, "num_requests_waiting": r.num_waiting,
                    "kv_cache_usage": r.kv_cache_usage}

        role = "decode" if len(router.prefill_replicas) else "serve"
        return {"policy": router.policy.name,
                "replicas": [card(r, role) for r in router.replicas]
                + [card(r, "prefill") for r in router.prefill_replicas]}

    async def _admin_body(raw: Request) -> tuple[str, str]:
        """(url, role) of an admin request's body {"url": ..., "role": "serve" | "prefill"}."""
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise ValueError(f"Malformed JSON: {e}") from e
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ValueError("url: give the replica's base URL as {\"url\": \"http://host:port\"}")
        unknown = sorted(set(body) - {"url", "role"})
        if unknown:
            raise ValueError(f"url: unknown fields {unknown}; the body is {{\"url\": ..., \"role\": ...}}")
        role = body.get("role", "serve")
        if not isinstance(role, str):
            raise ValueError(f"role must be serve, decode or prefill, got {role!r}")
        return str(body["url"]), role

    async def admin(raw: Request, action: str) -> Response:
        if admin_api_key is not None:
            given = raw.headers.get("x-loom-admin-key") or raw.headers.get("authorization", "")
            if not hmac.compare_digest(given.removeprefix("Bearer ").encode(), admin_api_key.encode()):
                return error_response(401, "The admin routes need the admin key (--admin-api-key), as "
                                      "'X-Loom-Admin-Key: KEY' or 'Authorization: Bearer KEY'.", code="invalid_api_key")
        elif raw.client is None or raw.client.host not in ("127.0.0.1", "::1", "localhost"):
            return error_response(403, "The admin routes answer clients on the router's machine only; start the "
                                  "router with --admin-api-key to administer it from elsewhere.", code="forbidden")
        try:
            url, role = await _admin_body(raw)
            if action == "add":
                state = router.add_replica(url, role)
                assert router.client is not None
                owner = router.prefill_replicas if role == "prefill" else router.replicas
                await owner.check(router.client, state, router.config.health_timeout_s)
            elif action == "remove":
                state = router.remove_replica(url)
            else:
                state = router.drain(url, action == "drain")
        except ValueError as e:
            return error_response(400, str(e), param="role" if str(e).startswith("role") else "url")
        return JSONResponse({"url": state.url, "healthy": state.healthy, "draining": state.draining,
                             "in_flight": state.in_flight})

    def admin_route(action: str) -> Any:
        async def handler(raw: Request) -> Response:
            return await admin(raw, action)
        return handler

    for action in ("add", "remove", "drain", "undrain"):
        app.add_api_route(f"/router/{action}", admin_route(action), methods=["POST"])

    return app


__all__ = ["build_router_app", "prompt_text"]
