"""Offline latency benchmark: one request of P prompt tokens and O output tokens (ignore_eos), timed end to end.

Every run uses a fresh seeded synthetic prompt, so the prefix cache never turns a run into a cache hit.
Reported per backend: median over runs (after warmup) of TTFT, TPOT = (E2E − TTFT)/(O − 1), E2E, and
decode tok/s = 1/TPOT.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from loom.bench.datasets import synthetic_requests
from loom.bench.metrics import tpot_seconds


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    input_len: int = 128  # P, prompt tokens
    output_len: int = 128  # O, generated tokens
    num_warmup: int = 1  # untimed runs first
    num_runs: int = 5  # timed runs
    seed: int = 0  # seed of the synthetic prompts

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")


@dataclass(slots=True)
class LatencyResult:
    backend: str  # "loom" or "hf"
    ttft_s: list[float] = field(default_factory=list)  # per timed run, seconds
    e2e_s: list[float] = field(default_factory=list)  # per timed run, seconds
    tpot_s: list[float] = field(default_factory=list)  # per timed run, seconds

    def summary(self) -> dict[str, float]:
        """Medians in milliseconds, plus decode tokens/s = 1000 / median TPOT ms."""
        tpot_ms = statistics.median(self.tpot_s) * 1e3 if self.tpot_s else float("nan")
        return {"ttft_ms": statistics.median(self.ttft_s) * 1e3, "tpot_ms": tpot_ms,
                "e2e_ms": statistics.median(self.e2e_s) * 1e3, "decode_tok_s": 1e3 / tpot_ms}


def latency_prompts(cfg: LatencyConfig, vocab_size: int) -> list[list[int]]:
    """num_warmup + num_runs distinct seeded token-id prompts of input_len tokens."""
    reqs = synthetic_requests(cfg.num_warmup + cfg.num_runs, cfg.input_len, cfg.output_len, vocab_size, cfg.seed)
    return [list(r.prompt) for r in reqs]  # type: ignore[arg-type]


def run_loom_latency(llm: Any, cfg: LatencyConfig, vocab_size: int) -> LatencyResult:
    """Time `llm.stream` (loom.LLM): TTFT at the first output carrying tokens, E2E at the finished one."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cfg.output_len, ignore_eos=True)
    result = LatencyResult(backend="loom")
    for i, prompt in enumerate(latency_prompts(cfg, vocab_size)):
        start = time.perf_counter()
        first: float | None = None
        n_out = 0
        for out in llm.stream(prompt, params):
            completion = out.outputs[0]
            if first is None and completion.delta_token_ids:
                first = time.perf_counter()
            n_out = len(completion.token_ids)
        end = time.perf_counter()
        if n_out != cfg.output_len:
            raise RuntimeError(f"loom generated {n_out} tokens, expected {cfg.output_len}")
        if i >= cfg.num_warmup:
            _record(result, first if first is not None else end, start, end, n_out)
    return result


def run_hf_latency(runner: Any, cfg: LatencyConfig, vocab_size: int) -> LatencyResult:
    """Time loom.bench.hf_backend.HFRunner.generate_timed on the same prompts."""
    result = LatencyResult(backend="hf")
    for i, prompt in enumerate(latency_prompts(cfg, vocab_size)):
        ttft, e2e = runner.generate_timed(prompt, cfg.output_len)
        if i >= cfg.num_warmup:
            _record(result, ttft, 0.0, e2e, cfg.output_len)
    return result


def _record(result: LatencyResult, first: float, start: float, end: float, n_out: int) -> None:
    ttft, e2e = first - start, end - start
    result.ttft_s.append(ttft)
    result.e2e_s.append(e2e)
    tpot = tpot_seconds(e2e, ttft, n_out)
    if tpot is not None:
        result.tpot_s.append(tpot)
