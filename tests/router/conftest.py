"""Router test fixtures: fake-engine replicas (threads, or processes that can be killed) and a live router."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from loom.router.app import build_router_app
from loom.router.router import Router, RouterConfig
from loom.router.replica import ReplicaSet
from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def live_router(urls: list[str], prefill_urls: list[str] | None = None, replica_api_key: str | None = None,
                **config: Any) -> Iterator[tuple[str, Router]]:
    """Run a router over `urls` (and prefill replicas `prefill_urls`) under uvicorn in a thread (lifespan on:
    health checks run); yield its URL and the Router."""
    config.setdefault("health_interval_s", 0.2)
    router = Router(ReplicaSet(urls, api_key=replica_api_key), RouterConfig(**config), ReplicaSet(prefill_urls or []))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="test-router", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the router did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", router
    finally:
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def replica_processes(n: int, step_delay_s: float = 0.01) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """`n` fake-engine replicas as separate processes (so a test can SIGKILL one); waits until they are up."""
    procs = []
    try:
        for _ in range(n):
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "tests.router.fake_replica", str(port), str(step_delay_s)],
                                    cwd=REPO, start_new_session=True)
            procs.append((f"http://127.0.0.1:{port}", proc))
        deadline = time.monotonic() + 60
        for url, proc in procs:
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake replica {url} did not start")
                time.sleep(0.05)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
