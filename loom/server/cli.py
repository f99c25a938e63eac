"""`loom serve`: the OpenAI-compatible server under uvicorn, with clean SIGINT/SIGTERM shutdown."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from loom.engine.arg_utils import add_engine_args, add_kv_transfer_args, engine_args_from_namespace
from loom.router.result_cache import ResultCache
from loom.server.header_timeout import DEFAULT_TIMEOUT_HEADER_S, http_protocol
from loom.server.security import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES, SecurityConfig
from loom.server.tool_parsers import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS, get_tool_call_parser

if TYPE_CHECKING:  # the engine (torch) is imported when `loom serve` runs, not for `loom --help`
    from loom.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("loom.server")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand (engine options plus --host/--port) to the loom CLI."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use in the `model` field (default: the model file name)")
    p.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} "
                   "when set, else no key)")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="CORS: origins whose web pages may call the API, e.g. http://localhost:3000, or '*' "
                   "(default: none)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="accepted Host headers, e.g. localhost 127.0.0.1 (default: any)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted, bytes (default: %(default)s)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_CALL_PARSER, metavar="NAME",
                   help="how the model writes tool calls: " + ", ".join(TOOL_CALL_PARSERS) +
                   " (default: %(default)s; docs/serving.md)")
    p.add_argument("--timeout-header", type=float, default=DEFAULT_TIMEOUT_HEADER_S, metavar="SECONDS",
                   help="seconds a client has to send a request's line and headers, from the connection's opening "
                   "or the request's first byte; then 408 and the connection is closed (default: %(default)s)")
    p.add_argument("--result-cache-size", type=int, default=0, metavar="N",
                   help="keep the whole responses of up to N deterministic requests (temperature 0 or a seed) and "
                   "answer the same request again from them; 0 = off (default: %(default)s; docs/serving.md)")
    p.add_argument("--result-cache-ttl", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a result cache entry lives (default: %(default)s)")
    p.add_argument("--result-cache-max-bytes", type=int, default=256 << 20, metavar="BYTES",
                   help="most bytes the result cache holds (default: %(default)s)")
    add_engine_args(p)
    add_kv_transfer_args(p)
    p.set_defaults(func=run_serve)


class _Server(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests on SIGINT/SIGTERM instead of waiting for them."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        logger.info("signal %d: aborting in-flight requests and shutting down", sig)
        self._engine.begin_shutdown()  # their streams end with finish_reason "abort"
        super().handle_exit(sig, frame)


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down."""


def _raise_terminated(sig: int, frame: FrameType | None) -> None:
    raise _Terminated()


def _run_until_signal(server: uvicorn.Server) -> None:
    """Run uvicorn; the SIGINT/SIGTERM it re-raises after its graceful shutdown ends the call normally."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_listen_address(host: str, port: int) -> None:
    """Bind host:port once and let go, so a busy port or a bad host fails in a second, not after loading.

    Raises:
        ValueError: the address cannot be resolved or bound (the OS reason is in the message).
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def security_config(ns: argparse.Namespace, environ: Mapping[str, str]) -> SecurityConfig:
    """The server's SecurityConfig from `loom serve` options; the API key from LOOM_API_KEY when --api-key is
    not given.

    Raises:
        ValueError: an empty key, a body limit < 1, or a keep-alive timeout <= 0.
    """
    if not ns.timeout_keep_alive > 0:
        raise ValueError(f"timeout_keep_alive must be > 0, got {ns.timeout_keep_alive}")
    api_key = ns.api_key if ns.api_key is not None else environ.get(API_KEY_ENV) or None
    return SecurityConfig(api_key=api_key, allowed_origins=list(ns.allowed_origins), allowed_hosts=ns.allowed_hosts,
                          max_request_bytes=ns.max_request_bytes)


def result_cache_of(ns: argparse.Namespace) -> ResultCache | None:
    """The server's result cache from `loom serve` options; None when --result-cache-size is 0.

    Raises:
        ValueError: a negative size, a TTL <= 0 or a byte bound < 1 (naming the option).
    """
    if ns.result_cache_size < 0:
        raise ValueError(f"result_cache_size must be >= 0 (0 = off), got {ns.result_cache_size}")
    if not ns.result_cache_ttl > 0:
        raise ValueError(f"result_cache_ttl must be > 0 seconds, got {ns.result_cache_ttl}")
    if ns.result_cache_max_bytes < 1:
        raise ValueError(f"result_cache_max_bytes must be >= 1, got {ns.result_cache_max_bytes}")
    if ns.result_cache_size == 0:
        return None
    return ResultCache(ns.result_cache_size, ns.result_cache_max_bytes, ns.result_cache_ttl)


def run_serve(ns: argparse.Namespace) -> int:
    """Start the engine, serve until a signal, then free everything. Returns the exit code.

    Raises ValueError for bad engine options (the CLI prints it).
    """
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {ns.port}")
    security = security_config(ns, os.environ)
    result_cache = result_cache_of(ns)
    get_tool_call_parser(ns.tool_call_parser)  # an unknown name fails here, before the model loads
    http = http_protocol(ns.timeout_header)
    args = engine_args_from_namespace(ns)
    check_listen_address(ns.host, ns.port)  # before the model loads, not after
    t0 = time.monotonic()
    from loom.engine.async_engine import AsyncLLMEngine  # torch and the engine: after the cheap checks
    from loom.server.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(args)
    try:
        app = build_app(engine, served_model_name=ns.served_model_name, security=security,
                        tool_call_parser=ns.tool_call_parser, result_cache=result_cache)
        inner = engine.engine
        kv_tokens = inner.kv_capacity_tokens  # of every layer (a hybrid cache holds long requests better)
        if security.api_key is None and ns.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("serving on %s without an API key: anyone who can reach it may use it (--api-key)",
                           ns.host)
        logger.info(
            "serving %s on http://%s:%d (ready in %.1f s); KV cache %d blocks x %d tokens = %d tokens "
            "(%.1f MiB, %.1f requests of max_model_len=%d)",
            app.state.ctx.model_name, ns.host, ns.port, time.monotonic() - t0, inner.num_kv_blocks,
            inner.block_size, kv_tokens, kv_tokens * inner.kv_bytes_per_token / (1 << 20),
            kv_tokens / inner.max_model_len, inner.max_model_len)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=ns.timeout_keep_alive, http=http)
        _run_until_signal(_Server(config, engine))
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0


__all__ = ["register", "run_serve", "security_config", "result_cache_of"]
