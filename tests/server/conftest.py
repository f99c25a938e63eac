"""Server test fixtures: a live uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from loom.engine.async_engine import AsyncLLMEngine
from loom.server.api_server import build_app
from tests.server.fake_engine import FakeEngine


@dataclass(slots=True)
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine
    app: Any  # the FastAPI app

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(engine: AsyncLLMEngine, uvicorn_kwargs: dict[str, Any] | None = None,
          **app_kwargs: Any) -> Iterator[LiveServer]:
    """Run build_app(engine) under uvicorn (with `uvicorn_kwargs` for its Config) in a thread; stop it (and the
    engine) afterwards."""
    try:
        with serve_app(engine, uvicorn_kwargs, **app_kwargs) as live:
            yield live
    finally:
        engine.shutdown()


@contextlib.contextmanager
def serve_app(engine: AsyncLLMEngine, uvicorn_kwargs: dict[str, Any] | None = None,
              **app_kwargs: Any) -> Iterator[LiveServer]:
    """Run build_app(engine) under uvicorn (with `uvicorn_kwargs` for its Config) in a thread; stop it afterwards,
    leaving the engine running (several apps may share one engine)."""
    app = build_app(engine, **app_kwargs)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            **(uvicorn_kwargs or {}))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def serve_disagg_trio(model: str, num_kv_blocks: int = 96) -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    """Three live `loom serve` apps of `model` (float32, 4-token blocks): a prefill replica (producer), a decode
    replica (consumer) and a plain co-located one, for disaggregation tests."""
    from loom.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    def front(role: str | None) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=model, dtype="float32", block_size=4,
                                                     num_kv_blocks=num_kv_blocks, kv_transfer_role=role)),
                                idle_poll_s=0.05)
        engine.start()
        return engine

    with serve(front("producer")) as p, serve(front("consumer")) as d, serve(front(None)) as c:
        yield p, d, c


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def make_fake_front(**kwargs: Any) -> tuple[AsyncLLMEngine, FakeEngine]:
    fake = FakeEngine(**kwargs)
    front = AsyncLLMEngine(fake, idle_poll_s=0.05)
    front.start()
    return front, fake


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    front, _ = make_fake_front(step_delay_s=0.002, max_waiting_requests=64)
    with serve(front) as live:
        yield live


@pytest.fixture()
def client(fake_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.base_url, timeout=30) as c:
        yield c
