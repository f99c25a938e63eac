"""Cache-aware routing vs round robin on a multi-tenant workload of shared system prompts (issue 15).

Workload: S system prompts of ~L tokens (ShareGPT answers joined, so real text), U users each, every request
= one system prompt + a short distinct user question (a ShareGPT first turn), asking for O tokens (ignore_eos),
shuffled with a fixed seed and sent closed-loop at concurrency C through `loom router`. Two `loom serve`
replicas with one thread each and a KV cache of B blocks each (sized so one replica holds about half the
system prompts: the point of cache-aware routing is to split the working set between replicas).

For each policy, fresh replicas and a fresh router (separate processes, one policy at a time); the prefix
hit rate is the replicas' own (prefix_cache_hits / prefix_cache_queries from /load, in tokens), TTFT and
output throughput are the client's (loom.bench.serve).

    .venv/bin/python benchmarks/router_prefix.py --policies round_robin cache_aware \
        --out benchmarks/results/router_prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from loom.bench.datasets import SampleRequest, iter_sharegpt_pairs, load_bench_tokenizer
from loom.bench.serve import ServeConfig, run_serve_benchmark, summarize
from loom.router.cli import wait_until_healthy

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_workload(num_systems: int, users: int, system_tokens: int, question_tokens: int, output_len: int,
                   seed: int) -> list[SampleRequest]:
    """num_systems x users requests of real text; lengths measured with the bundled model's tokenizer."""
    tok = load_bench_tokenizer(None)
    pairs = iter_sharegpt_pairs()
    systems: list[str] = []
    questions: list[str] = []
    buffer = ""
    for question, answer in pairs:
        n_q = len(tok.encode(question, add_special_tokens=False))
        if 8 <= n_q <= question_tokens and len(questions) < num_systems * users:
            questions.append(question)
        if len(systems) < num_systems:
            buffer += answer + "\n\n"
            ids = tok.encode(buffer, add_special_tokens=False)
            if len(ids) >= system_tokens:
                systems.append(f"System prompt {len(systems)}. " + tok.decode(ids[:system_tokens]))
                buffer = ""
        if len(systems) == num_systems and len(questions) == num_systems * users:
            break
    if len(systems) < num_systems or len(questions) < num_systems * users:
        raise RuntimeError("not enough ShareGPT text for this workload")
    requests = []
    for s, system in enumerate(systems):
        for u in range(users):
            prompt = f"{system}\n\nUser: {questions[s * users + u]}\nAssistant:"
            requests.append(SampleRequest(prompt, len(tok.encode(prompt)), output_len))
    random.Random(seed).shuffle(requests)
    return requests


def run_policy(policy: str, requests: list[SampleRequest], args: argparse.Namespace) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        replica_urls = []
        for _ in range(args.replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "loom.cli", "--log-level", "WARNING", "serve", "--port", str(port),
                   "--num-threads", "1", "--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs",
                   str(args.max_num_seqs)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True))
            replica_urls.append(f"http://127.0.0.1:{port}")
        for url in replica_urls:
            wait_until_healthy([url], procs, 300.0)
        router_port = free_port()
        cmd = [sys.executable, "-m", "loom.router", "--log-level", "WARNING", "--port", str(router_port),
               "--policy", policy, *[a for u in replica_urls for a in ("--replica", u)]]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True))
        router_url = f"http://127.0.0.1:{router_port}"
        wait_until_healthy([router_url], procs, 300.0)
        model = httpx.get(router_url + "/v1/models").json()["data"][0]["id"]
        cfg = ServeConfig(base_url=router_url, model=model, max_concurrency=args.concurrency)
        results, duration = asyncio.run(run_serve_benchmark(cfg, requests, use_tqdm=False))
        loads = [httpx.get(u + "/load").json() for u in replica_urls]
        queries = sum(int(x["prefix_cache_queries"]) for x in loads)
        hits = sum(int(x["prefix_cache_hits"]) for x in loads)
        summary = summarize(results, duration, {})
        failed = [r.error for r in results if not r.success]
        return {"policy": policy, "prefix_hit_rate": hits / queries if queries else 0.0,
                "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                "per_replica_hit_rate": [int(x["prefix_cache_hits"]) / max(1, int(x["prefix_cache_queries"]))
                                         for x in loads],
                "ttft_median_ms": summary.ttft.median_ms, "ttft_p99_ms": summary.ttft.p99_ms,
                "tpot_median_ms": summary.tpot.median_ms, "output_throughput": summary.output_throughput,
                "duration_s": duration, "completed": summary.completed, "failed": len(failed),
                "errors": failed[:3]}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--systems", type=int, default=8, help="shared system prompts")
    ap.add_argument("--users", type=int, default=12, help="requests per system prompt")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=48, help="longest user question, tokens")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=320, help="KV blocks of 16 tokens per replica")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    requests = build_workload(args.systems, args.users, args.system_tokens, args.question_tokens, args.output_len,
                              args.seed)
    print(f"{len(requests)} requests, prompt tokens median "
          f"{sorted(r.prompt_len for r in requests)[len(requests) // 2]}", flush=True)
    rows = []
    for policy in args.policies:
        row = run_policy(policy, requests, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
