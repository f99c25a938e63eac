"""Prefill/decode disaggregation vs co-located replicas (issue 15): TTFT and TPOT under long prompts and long outputs.

Starts two `loom serve` processes with one thread each, twice: co-located (both plain replicas, requests
alternated) and disaggregated (one --kv-transfer-role producer, one consumer; every request prefilled on the
first and decoded on the second through loom.router.disagg.prefill_then_decode). One client sends the same
requests at a fixed rate to both set-ups: prompts of --prompt-tokens random token ids, --output-tokens greedy
tokens each (ignore_eos), streamed. TTFT = first streamed token; TPOT = (E2E - TTFT) / (tokens - 1).

    .venv/bin/python benchmarks/pd_disagg.py --requests 12 --rate 0.25 --prompt-tokens 1000 --output-tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loom.router.cli import wait_until_healthy
from loom.router.disagg import prefill_then_decode

REPO = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class Result:
    ttft_s: float  # seconds from send to the first streamed token
    tpot_s: float  # seconds per output token after the first
    num_tokens: int  # output tokens


def start(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--port", str(port), "--num-threads", "1", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def one(client: httpx.AsyncClient, send, body: dict) -> Result:
    started = time.perf_counter()
    first = None
    num_tokens = 0
    response = await send(client, body)
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter()
    finally:
        await response.aclose()
    end = time.perf_counter()
    assert first is not None and num_tokens > 1, f"no tokens ({response.status_code})"
    return Result(first - started, (end - first) / (num_tokens - 1), num_tokens)


async def run_load(send, bodies: list[dict], rate: float) -> list[Result]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        tasks = []
        for i, body in enumerate(bodies):
            tasks.append(asyncio.create_task(one(client, lambda c, b, i=i: send(c, b, i), body)))
            await asyncio.sleep(1.0 / rate)
        return list(await asyncio.gather(*tasks))


def summary(results: list[Result]) -> dict[str, float]:
    def p99(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]

    ttft = [r.ttft_s * 1000 for r in results]
    tpot = [r.tpot_s * 1000 for r in results]
    return {"ttft_median_ms": statistics.median(ttft), "ttft_p99_ms": p99(ttft),
            "tpot_median_ms": statistics.median(tpot), "tpot_p99_ms": p99(tpot),
            "output_tokens": sum(r.num_tokens for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rate", type=float, default=0.25, help="requests per second (fixed interval)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=200)
    ap.add_argument("--base-port", type=int, default=8310)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bodies = [{"prompt": [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)],
               "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(args.requests)]
    logs = REPO / "benchmarks" / "results"  # server logs (git-ignored)
    logs.mkdir(exist_ok=True)
    a, b = args.base_port, args.base_port + 1
    urls = [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"]
    figures: dict[str, dict[str, float]] = {}
    for mode, extras in (("colocated", ([], [])),
                         ("disaggregated", (["--kv-transfer-role", "producer"], ["--kv-transfer-role", "consumer"]))):
        procs = [start(a, extras[0], logs / f"pd_{mode}_0.log"), start(b, extras[1], logs / f"pd_{mode}_1.log")]
        try:
            for url, proc in zip(urls, procs):
                wait_until_healthy([url], [proc], 300.0)
            if mode == "colocated":
                def send(client, body, i):
                    request = client.build_request("POST", urls[i % 2] + "/v1/completions", json=body)
                    return client.send(request, stream=True)
            else:
                async def send(client, body, i):
                    response, _ = await prefill_then_decode(client, urls[0], urls[1], "/v1/completions", body, {})
                    return response
            # one warm-up request per replica path, not counted
            asyncio.run(run_load(send, [dict(bodies[0], max_tokens=4)] * 2, 100.0))
            results = asyncio.run(run_load(send, bodies, args.rate))
            figures[mode] = summary(results)
            print(mode, json.dumps(figures[mode]), flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **figures}, indent=2))


if __name__ == "__main__":
    main()
