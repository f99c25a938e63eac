"""Latency of a result-cache hit (issue 15 target: p99 under 5 ms at the router).

Two figures, same run:
- `lookup`: what a router does per hit, without HTTP: request_key over the body + ResultCache.get + render.
- `serve`: a whole hit through `loom serve`'s ASGI app on the bundled model, in process (httpx ASGITransport):
  body validation, chat templating / tokenizing, key, lookup, replay; chat and completion, streamed and not.
- `router` (--router): a whole hit through a running `loom router --result-cache-size` over real HTTP on
  loopback (one keep-alive connection, the client in this process), in front of one `loom serve` replica.

    .venv/bin/python benchmarks/result_cache_latency.py --requests 2000
    .venv/bin/python benchmarks/result_cache_latency.py --requests 2000 --router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from loom.router.cli import wait_until_healthy
from loom.router.result_cache import CachedResponse, ResultCache, request_key, tenant_of

BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                   {"role": "user", "content": "Name three colours of the rainbow."}],
                                      "temperature": 0, "max_tokens": 32}),
    "chat-stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                                             "temperature": 0, "max_tokens": 32, "stream": True}),
    "completion": ("/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 32}),
    "completion-stream": ("/v1/completions", {"prompt": "Once upon a time", "seed": 7, "max_tokens": 32,
                                              "stream": True}),
}


def percentiles(samples_s: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples_s)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return f"p50 {statistics.median(ms):.3f} ms, p99 {p(0.99):.3f} ms, max {ms[-1]:.3f} ms (n={len(ms)})"


def lookup_bench(n: int) -> None:
    cache = ResultCache(max_entries=1024)
    body = BODIES["chat"][1]
    stored = {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "red " * 32},
                           "finish_reason": "length"}]}
    events = [f"data: {json.dumps({**stored, 'choices': [{'index': 0, 'delta': {'content': 'red '}}]})}\n\n".encode()
              for _ in range(33)] + [b"data: [DONE]\n\n"]
    key_args = {"model_identity": "m" * 64, "route": "/v1/chat/completions", "tenant": tenant_of("Bearer k", None)}
    cache.put(request_key(body=body, **key_args), CachedResponse.of_body(json.dumps(stored).encode()))
    cache.put(request_key(body={**body, "stream": True}, **key_args), CachedResponse.of_events(events))
    for name, b in (("json", body), ("stream (34 events)", {**body, "stream": True})):
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            found = cache.get(request_key(body=b, **key_args))
            assert found is not None
            found.render_events(f"chatcmpl-{i:032x}", 2) if found.streamed else found.render_body("x", 2)
            samples.append(time.perf_counter() - t0)
        print(f"lookup {name}: {percentiles(samples)}")


async def serve_bench(n: int) -> None:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.server.api_server import build_app

    front = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=512))
    try:
        app = build_app(front, result_cache=ResultCache(max_entries=64))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=60) as c:
            for name, (route, body) in BODIES.items():
                assert (await c.post(route, json=body)).headers["x-loom-result-cache"] == "miss"
                samples = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    r = await c.post(route, json=body)
                    samples.append(time.perf_counter() - t0)
                    assert r.headers["x-loom-result-cache"] == "hit"
                print(f"serve {name}: {percentiles(samples)}")
    finally:
        front.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def router_bench(n: int) -> None:
    replica_port, router_port = _free_port(), _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "loom.cli", "--log-level", "WARNING", "serve", "--port",
                               str(replica_port), "--max-model-len", "512"], start_new_session=True)]
    try:
        wait_until_healthy([f"http://127.0.0.1:{replica_port}"], procs, 300.0)
        procs.append(subprocess.Popen([sys.executable, "-m", "loom.router", "--log-level", "WARNING", "--port",
                                       str(router_port), "--replica", f"http://127.0.0.1:{replica_port}",
                                       "--result-cache-size", "64"], start_new_session=True))
        url = f"http://127.0.0.1:{router_port}"
        wait_until_healthy([url], procs, 300.0)
        with httpx.Client(base_url=url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for name, (route, body) in BODIES.items():
                body = {**body, "model": model}
                assert c.post(route, json=body).headers["x-loom-router-result-cache"] == "miss"
                samples = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    r = c.post(route, json=body)
                    r.read()
                    samples.append(time.perf_counter() - t0)
                    assert r.headers["x-loom-router-result-cache"] == "hit"
                print(f"router {name}: {percentiles(samples)}")
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="hits timed per case")
    parser.add_argument("--router", action="store_true", help="time hits through a live loom router instead")
    ns = parser.parse_args()
    if ns.router:
        router_bench(ns.requests)
        return
    lookup_bench(ns.requests)
    asyncio.run(serve_bench(ns.requests))


if __name__ == "__main__":
    main()
