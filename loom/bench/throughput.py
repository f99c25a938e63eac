"""Offline throughput benchmark: N requests submitted at once; requests/s, output tok/s and total tok/s.

Output tokens are forced to each request's expected length (ignore_eos, greedy), so every backend does
the same work. loom schedules them with continuous batching; the hf peer runs static batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from loom.bench.datasets import SampleRequest


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    backend: str  # "loom" or "hf"
    num_requests: int  # requests completed
    elapsed_s: float  # wall time of the whole set, seconds
    input_tokens: int  # prompt tokens processed
    output_tokens: int  # tokens generated

    @property
    def requests_per_s(self) -> float:
        """Completed requests / elapsed, requests/s."""
        return self.num_requests / self.elapsed_s

    @property
    def output_tok_s(self) -> float:
        """Generated tokens / elapsed, tokens/s."""
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        """(input + output tokens) / elapsed, tokens/s."""
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def summary(self) -> dict[str, float]:
        """Counts, seconds and the three rates, for printing and JSON."""
        return {"requests": self.num_requests, "elapsed_s": self.elapsed_s, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "requests_per_s": self.requests_per_s,
                "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


WARMUP_PROMPT = list(range(1000, 1016))  # token ids of the untimed warm-up request


def run_loom_throughput(llm: Any, requests: list[SampleRequest], use_tqdm: bool = True) -> ThroughputResult:
    """All requests through loom.LLM.generate at once; token counts taken from the outputs."""
    from loom import SamplingParams

    if not requests:
        raise ValueError("requests must not be empty")
    params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in requests]
    # warm-up, untimed, as llama-batched-bench's 16-token decode before its runs: the first step of a process
    # pays one-off costs (thread pools, first-touch pages); 16 fixed token ids that no request's prompt starts
    # with, so the prefix cache gives the timed requests nothing
    llm.generate([WARMUP_PROMPT], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return ThroughputResult("loom", len(outputs), elapsed, n_in, n_out)


def run_hf_throughput(runner: Any, requests: list[SampleRequest], batch_size: int) -> ThroughputResult:
    """The same requests through transformers in static batches of `batch_size`."""
    from loom.bench.hf_backend import hf_throughput

    elapsed, n_in, n_out = hf_throughput(runner, requests, batch_size)
    return ThroughputResult("hf", len(requests), elapsed, n_in, n_out)
