"""`loom bench prefix`: requests sharing a long system prompt, with the prefix cache off and on.

Workload: N requests, each an S-token shared "system prompt" followed by a distinct Q-token question,
asking for O tokens (ignore_eos). Requests are sent one after another (closed loop, concurrency 1), so
TTFT is the time to prefill what the cache does not already hold. Both runs use the same engine options
in the same process; the peer is the engine with --no-prefix-caching. Token ids are drawn from a seeded
generator over the model's vocabulary (no tokenizer involved), so both runs see identical inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class PrefixWorkload:
    num_requests: int  # N
    system_len: int  # S, tokens shared by every request
    question_len: int  # Q, tokens distinct per request
    output_len: int  # O, generated tokens per request (ignore_eos)
    seed: int  # seed of the token generator

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """N prompts of S + Q token ids in [100, vocab_size) (low ids hold special tokens in most vocabularies).

        Raises:
            ValueError: a length or count below 1 (names the option).
        """
        for name in ("num_requests", "system_len", "question_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        rng = random.Random(self.seed)
        system = [rng.randrange(100, vocab_size) for _ in range(self.system_len)]
        return [system + [rng.randrange(100, vocab_size) for _ in range(self.question_len)] for _ in range(self.num_requests)]


@dataclass(slots=True)
class PrefixRunResult:
    label: str  # "cache off" | "cache on"
    ttft_s: list[float]  # [N] seconds from add_request to the first generated token
    e2e_s: list[float]  # [N] seconds from add_request to the last token
    wall_s: float  # seconds for the whole run
    prompt_tokens: int  # total over requests
    output_tokens: int  # total over requests
    hit_rate: float  # prefix-cache hit tokens / looked-up tokens during the run, 0..1

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def total_tok_s(self) -> float:
        """(prompt + output tokens) / wall time, tokens per second."""
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_prefix(engine: Any, label: str, prompts: list[list[int]], output_len: int) -> PrefixRunResult:
    """Send the prompts one after another through an LLMEngine; time TTFT and E2E of each."""
    from loom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = engine.get_stats()
    ttft: list[float] = []
    e2e: list[float] = []
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"{label}-{i}", prompt, params)
        first: float | None = None
        finished = False
        while not finished:
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                finished = finished or out.finished
        ttft.append(first if first is not None else time.perf_counter() - t0)
        e2e.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    after = engine.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return PrefixRunResult(
        label=label, ttft_s=ttft, e2e_s=e2e, wall_s=wall,
        prompt_tokens=sum(len(p) for p in prompts), output_tokens=output_len * len(prompts),
        hit_rate=hits / queries if queries else 0.0,
    )  # fmt: skip


def _warm_up(engine: Any, vocab_size: int) -> None:
    """One short request with unrelated tokens: first-call overheads stay out of the timed runs."""
    from loom.sampling_params import SamplingParams

    engine.add_request("warmup", [vocab_size - 1 - i for i in range(32)], SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def cmd_prefix(ns: argparse.Namespace) -> int:
    """`loom bench prefix`: prints the cache-off and cache-on rows, the TTFT ratio, and writes JSON."""
    from loom.bench.cli import result_path
    from loom.bench.metrics import machine_info, write_json
    from loom.engine.arg_utils import engine_args_from_namespace
    from loom.engine.llm_engine import LLMEngine

    workload = PrefixWorkload(ns.num_requests, ns.system_len, ns.question_len, ns.output_len, ns.prompt_seed)
    base = engine_args_from_namespace(ns)
    results: list[PrefixRunResult] = []
    for label, caching in (("cache off", False), ("cache on", True)):
        engine = LLMEngine(dataclasses.replace(base, enable_prefix_caching=caching))
        prompts = workload.prompts(engine.vocab_size)
        _warm_up(engine, engine.vocab_size)
        results.append(run_prefix(engine, label, prompts, workload.output_len))
        del engine
    print(f"{'run':<10} {'median TTFT ms':>15} {'mean TTFT ms':>13} {'total tok/s':>12} {'output tok/s':>13} {'hit rate':>9}")
    for r in results:
        print(f"{r.label:<10} {r.median_ttft_s * 1e3:>15.1f} {statistics.mean(r.ttft_s) * 1e3:>13.1f} "
              f"{r.total_tok_s:>12.1f} {r.output_tok_s:>13.1f} {r.hit_rate:>9.3f}")  # fmt: skip
    ratio = results[0].median_ttft_s / results[1].median_ttft_s
    print(f"median TTFT cache off / cache on: {ratio:.1f}x")
    path = result_path(ns.result_dir, "prefix", f"S{workload.system_len}", "json")
    write_json(path, {"workload": workload, "machine": machine_info(), "ttft_ratio": ratio,
                      "runs": [dataclasses.asdict(r) | {"median_ttft_s": r.median_ttft_s, "total_tok_s": r.total_tok_s}
                               for r in results]})  # fmt: skip
    print(f"wrote {path}")
    return 0


def register_prefix(bench_sub: argparse._SubParsersAction) -> None:
    """Add `loom bench prefix` to the `loom bench` subcommands."""
    from loom.engine.arg_utils import add_engine_args

    p = bench_sub.add_parser("prefix", help="shared system prompt + distinct questions: TTFT with the prefix cache off vs on")
    p.add_argument("--num-requests", type=int, default=8, help="requests, sent one after another (default: %(default)s)")
    p.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt (default: %(default)s)")
    p.add_argument("--question-len", type=int, default=32, help="distinct tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt tokens (default: %(default)s)")
    p.add_argument("--result-dir", type=_path, default=_path("benchmarks/results"),
                   help="where the JSON goes (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=cmd_prefix)


def _path(value: str) -> Any:
    from pathlib import Path

    return Path(value)


__all__ = ["PrefixRunResult", "PrefixWorkload", "cmd_prefix", "register_prefix", "run_prefix"]
