"""Access and exposure of the HTTP server: API key, CORS, trusted hosts and a request body limit.

Pure ASGI middleware (no per-request Python beyond a header lookup), installed by `install_security`:

| option                      | what it does                                                                    |
|-----------------------------|---------------------------------------------------------------------------------|
| api_key (`--api-key`, env   | every route but /health and / needs `Authorization: Bearer <key>`, compared in  |
| LOOM_API_KEY)               | constant time (hmac.compare_digest); else 401 in OpenAI's error shape           |
| allowed_origins             | CORS: browsers at these origins may call the API (preflight answered); none by  |
| (`--allowed-origins`)       | default, so a web page elsewhere cannot read responses                          |
| allowed_hosts               | Host-header allow-list (DNS-rebinding guard); None = any                        |
| (`--allowed-hosts`)         |                                                                                 |
| max_request_bytes           | a body larger than this is refused with 413 before it is read in full           |
| (`--max-request-bytes`)     |                                                                                 |
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_KEY_ENV = "LOOM_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # 32 MiB: a max_model_len prompt is ~100x smaller; batches of prompts fit
OPEN_PATHS = frozenset({"/health", "/"})  # reachable without the API key: liveness probes, and the chat page
# (static; it asks for the key and sends it with its API calls)


@dataclass(slots=True)
class SecurityConfig:
    api_key: str | None = None  # None: no authentication
    allowed_origins: list[str] = field(default_factory=list)  # CORS origins ("*" = any); empty: no CORS
    allowed_hosts: list[str] | None = None  # accepted Host headers (Starlette patterns); None = any
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.allowed_hosts is not None and not self.allowed_hosts:
            raise ValueError("allowed_hosts must name at least one host (or be None for any)")


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time), on every path but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
                break
        if not hmac.compare_digest(given, self._key):
            await _send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once from Content-Length, else as soon as the stream passes it
    (the body is buffered up to the limit, then handed to the app)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.limit:
                    await self._refuse(send)
                    return
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the app expects

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await _send_error(send, 413, f"Request body is larger than the server's limit of {self.limit} bytes.",
                          "request_too_large", [(b"connection", b"close")])


def install_security(app: ASGIApp, config: SecurityConfig) -> None:
    """Add the middleware to a FastAPI/Starlette `app` (outermost first: hosts, CORS, API key, body limit)."""
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes)  # type: ignore[attr-defined]
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)  # type: ignore[attr-defined]
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,  # type: ignore[attr-defined]
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    if config.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=config.allowed_hosts)  # type: ignore[attr-defined]
