"""Serving client against a tiny fake OpenAI SSE server on 127.0.0.1 (raw asyncio, no framework)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from loom.bench.datasets import SampleRequest
from loom.bench.metrics import latency_stats, parse_goodput, tpot_seconds
from loom.bench.plots import plot_serve
from loom.bench.serve import ServeConfig, arrival_offsets, first_model_id, run_serve_benchmark, summarize

FIRST_DELAY_S = 0.05  # fake prefill time before the first chunk
GAP_S = 0.01  # fake decode time between chunks


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET /v1/models"):
        data = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(data), data))
        await writer.drain()
        writer.close()
        return
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    body = json.loads(await reader.readexactly(length))
    if body["max_tokens"] == 999:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbad")
        await writer.drain()
        writer.close()
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    await asyncio.sleep(FIRST_DELAY_S)
    n = body["max_tokens"]
    for i in range(n):
        if i:
            await asyncio.sleep(GAP_S)
        chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
        writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await writer.drain()
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
    writer.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
    await writer.drain()
    writer.close()


async def _bench(cfg_kwargs: dict[str, object], requests: list[SampleRequest]) -> tuple[list, float]:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        base_url = f"http://127.0.0.1:{port}"
        cfg = ServeConfig(base_url=base_url, model=await first_model_id(base_url), **cfg_kwargs)
        assert cfg.model == "fake-model"
        return await run_serve_benchmark(cfg, requests, use_tqdm=False)
    finally:
        server.close()
        await server.wait_closed()


def test_streaming_metrics_against_fake_server(tmp_path: Path) -> None:
    reqs = [SampleRequest(prompt=[1, 2, 3], prompt_len=3, expected_output_len=5) for _ in range(4)]
    reqs.append(SampleRequest(prompt="bad", prompt_len=1, expected_output_len=999))
    results, duration = asyncio.run(_bench({"max_concurrency": 2}, reqs))
    ok = [r for r in results if r.success]
    assert len(ok) == 4 and "HTTP 400" in results[-1].error
    # Bounds the fake server guarantees whatever the host's load: it sleeps before each chunk, so times measured
    # by the client can only be longer; gaps measured from the wrong origin (the request's start, say) would sum
    # past e2e. No wall-clock upper bound: a loaded 2-core host delays any chunk by a scheduling slice or more.
    for r in ok:
        assert r.output_tokens == 5 and len(r.itl_s) == 4
        assert r.ttft_s >= FIRST_DELAY_S * 0.9
        assert r.e2e_s >= FIRST_DELAY_S + 4 * GAP_S
        assert all(g >= 0 for g in r.itl_s)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    # one delayed read can shorten the gap after it, not most of them
    assert sorted(g for r in ok for g in r.itl_s)[8] >= GAP_S * 0.5
    summary = summarize(results, duration, parse_goodput(["ttft:10000", "tpot:0.001"]))
    assert summary.completed == 4 and summary.failed == 1
    assert summary.total_output_tokens == 20 and summary.output_throughput == pytest.approx(20 / duration)
    assert summary.goodput == 0.0  # nobody meets a 1 µs TPOT
    assert summarize(results, duration, parse_goodput(["ttft:10000"])).goodput == pytest.approx(4 / duration)
    assert summary.tpot.mean_ms >= GAP_S * 1e3 * 0.5
    png = plot_serve(results, "fake", tmp_path / "serve.png")
    assert png.stat().st_size > 1000


def test_poisson_arrivals_are_seeded_and_spread() -> None:
    a = arrival_offsets(200, request_rate=10.0, seed=1)
    assert a == arrival_offsets(200, request_rate=10.0, seed=1) and a[0] == 0.0
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / 199 == pytest.approx(0.1, rel=0.25)  # mean gap 1/rate
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        ServeConfig(base_url="http://x", model="m", request_rate=0)


def test_metric_helpers() -> None:
    assert tpot_seconds(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot_seconds(1.0, 0.1, 1) is None
    st = latency_stats([0.001 * i for i in range(1, 101)])
    assert st.median_ms == pytest.approx(50.5) and st.p99_ms == pytest.approx(99.01) and st.count == 100
    assert parse_goodput(["ttft:200", "e2e:1000"]) == {"ttft": 0.2, "e2e": 1.0}
    for bad in (["ttft"], ["foo:1"], ["tpot:-1"], ["tpot:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
