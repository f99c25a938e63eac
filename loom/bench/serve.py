"""Serving benchmark: an async streaming client for any OpenAI-compatible /v1/completions endpoint.

Requests arrive as a Poisson process at `request_rate` requests/s (exponential gaps, seeded), or all at
once when the rate is infinite; `max_concurrency` bounds requests in flight either way. Each request
streams (SSE) with ignore_eos and max_tokens = its expected output length, so both loom and llama-server
generate exactly that many tokens. Metric definitions: loom.bench.metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from loom.bench.datasets import SampleRequest
from loom.bench.metrics import LatencyStats, latency_stats, meets_slo, tpot_seconds


@dataclass(slots=True)
class RequestResult:
    prompt_len: int  # prompt tokens
    expected_output_len: int  # tokens asked for (max_tokens)
    success: bool = False
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else non-empty chunks
    ttft_s: float = 0.0  # seconds from send to the first non-empty chunk
    itl_s: list[float] = field(default_factory=list)  # seconds between consecutive non-empty chunks
    e2e_s: float = 0.0  # seconds from send to the end of the stream
    start_s: float = 0.0  # send time, seconds after the benchmark started
    error: str = ""  # why it failed


@dataclass(frozen=True, slots=True)
class ServeConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1/completions path is appended)
    model: str  # "model" field of each request
    request_rate: float = math.inf  # mean arrivals per second (Poisson); inf = all at t=0
    max_concurrency: int | None = None  # most requests in flight; None = unbounded
    seed: int = 0  # seed of the arrival process
    temperature: float = 0.0  # sampling temperature sent with every request
    timeout_s: float = 600.0  # per-request HTTP timeout, seconds

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True, slots=True)
class ServeSummary:
    completed: int  # requests that succeeded
    failed: int  # requests that errored
    duration_s: float  # wall time from the first send to the last response, seconds
    total_input_tokens: int  # prompt tokens of completed requests
    total_output_tokens: int  # output tokens of completed requests
    request_throughput: float  # completed requests / duration, requests/s
    output_throughput: float  # output tokens / duration, tokens/s
    total_token_throughput: float  # (input + output tokens) / duration, tokens/s
    goodput: float | None  # completed requests meeting every SLO / duration, requests/s; None without SLOs
    ttft: LatencyStats  # time to first token
    tpot: LatencyStats  # time per output token (requests with >= 2 tokens)
    itl: LatencyStats  # inter-token (inter-chunk) latency, all gaps of all requests
    e2e: LatencyStats  # end-to-end request latency


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: cumulative Exp(request_rate) gaps; all 0 when the rate is inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id listed by GET /v1/models (loom and llama-server both serve it).

    Raises:
        ValueError: naming base_url when the server lists no model or cannot be reached.
    """
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{base_url.rstrip('/')}/v1/models")
            response.raise_for_status()
            models = response.json().get("data") or []
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        raise ValueError(f"base_url {base_url!r}: GET /v1/models failed: {exc}") from None
    if not models:
        raise ValueError(f"base_url {base_url!r} lists no model")
    return str(models[0]["id"])


async def _sse_payloads(response: httpx.Response) -> AsyncIterator[dict[str, object]]:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client: httpx.AsyncClient, cfg: ServeConfig, req: SampleRequest,
                       bench_start: float) -> RequestResult:
    """Stream one completion and time it. Never raises for server errors: they are recorded in `error`."""
    result = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.expected_output_len)
    body = {"model": cfg.model, "prompt": req.prompt, "max_tokens": req.expected_output_len,
            "temperature": cfg.temperature, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result.start_s = sent - bench_start
    last, chunks, usage_tokens = sent, 0, None
    try:
        async with client.stream("POST", f"{cfg.base_url.rstrip('/')}/v1/completions", json=body,
                                 timeout=cfg.timeout_s) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return result
            async for payload in _sse_payloads(response):
                now = time.perf_counter()
                usage = payload.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = payload.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                if chunks == 0:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last, chunks = now, chunks + 1
        result.e2e_s = time.perf_counter() - sent
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_serve_benchmark(cfg: ServeConfig, requests: list[SampleRequest],
                              use_tqdm: bool = True) -> tuple[list[RequestResult], float]:
    """Send `requests` per cfg's arrival process; returns (results in request order, duration seconds)."""
    if not requests:
        raise ValueError("requests must not be empty")
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=not use_tqdm, desc="requests")
    limits = httpx.Limits(max_connections=cfg.max_concurrency or len(requests), max_keepalive_connections=None)

    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:
        start = time.perf_counter()

        async def one(offset: float, req: SampleRequest) -> RequestResult:
            delay = offset - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                res = await send_request(client, cfg, req, start)
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float]) -> ServeSummary:
    """Aggregate per-request results; `slo` maps ttft/tpot/e2e to seconds (empty = no goodput)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    tpots = [t for r in ok if (t := tpot_seconds(r.e2e_s, r.ttft_s, r.output_tokens)) is not None]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    goodput = None
    if slo:
        good = sum(meets_slo(slo, r.ttft_s, tpot_seconds(r.e2e_s, r.ttft_s, r.output_tokens), r.e2e_s) for r in ok)
        goodput = good / duration_s
    return ServeSummary(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / duration_s, output_throughput=n_out / duration_s,
        total_token_throughput=(n_in + n_out) / duration_s, goodput=goodput,
        ttft=latency_stats([r.ttft_s for r in ok]), tpot=latency_stats(tpots),
        itl=latency_stats([g for r in ok for g in r.itl_s]), e2e=latency_stats([r.e2e_s for r in ok]),
    )


def format_summary(s: ServeSummary) -> str:
    """Human-readable table of a ServeSummary."""
    lines = [
        f"completed / failed        {s.completed} / {s.failed}",
        f"duration                  {s.duration_s:.2f} s",
        f"input / output tokens     {s.total_input_tokens} / {s.total_output_tokens}",
        f"request throughput        {s.request_throughput:.3f} req/s",
        f"output token throughput   {s.output_throughput:.2f} tok/s",
        f"total token throughput    {s.total_token_throughput:.2f} tok/s",
    ]
    if s.goodput is not None:
        lines.append(f"goodput                   {s.goodput:.3f} req/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        st: LatencyStats = getattr(s, name)
        lines.append(f"{name.upper():<5} mean/median/p99      {st.mean_ms:.2f} / {st.median_ms:.2f} / {st.p99_ms:.2f} ms")
    return "\n".join(lines)
