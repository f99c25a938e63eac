"""`loom serve`: the OpenAI-compatible server under uvicorn, with clean SIGINT/SIGTERM shutdown."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from loom.engine.arg_utils import add_engine_args, engine_args_from_namespace
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
    add_engine_args(p)
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


def run_serve(ns: argparse.Namespace) -> int:
    """Start the engine, serve until a signal, then free everything. Returns the exit code.

    Raises ValueError for bad engine options (the CLI prints it).
    """
    from loom.server.api_server import build_app

    if not 0 <= ns.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {ns.port}")
    args = engine_args_from_namespace(ns)
    check_listen_address(ns.host, ns.port)  # before the model loads, not after
    t0 = time.monotonic()
    engine = AsyncLLMEngine.from_engine_args(args)
    try:
        app = build_app(engine, served_model_name=ns.served_model_name)
        inner = engine.engine
        kv_tokens = inner.num_kv_blocks * inner.block_size
        logger.info(
            "serving %s on http://%s:%d (ready in %.1f s); KV cache %d blocks x %d tokens = %d tokens "
            "(%.1f MiB, %.1f requests of max_model_len=%d)",
            app.state.ctx.model_name, ns.host, ns.port, time.monotonic() - t0, inner.num_kv_blocks,
            inner.block_size, kv_tokens, kv_tokens * inner.kv_bytes_per_token / (1 << 20),
            kv_tokens / inner.max_model_len, inner.max_model_len)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                lifespan="off", timeout_graceful_shutdown=5)
        _run_until_signal(_Server(config, engine))
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0


__all__ = ["register", "run_serve"]
