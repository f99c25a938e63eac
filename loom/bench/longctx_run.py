"""`loom bench longctx`: retrieval accuracy, KV bytes, decode tok/s and TTFT of KV policies at long context.

For each task (loom/bench/longctx.py), length and sample, the prompt is sent alone (concurrency 1, greedy, few
max_tokens), first with full attention and then under each lossy KV retention policy and budget as a
per-request override (`SamplingParams.kv_retention`, loom/core/kv_retention.py), all in one engine with the
prefix cache as the engine options say (on by default): a policy that starts from an exact prefill can take it
from the cache the full-attention request left. Block-sparse decode attention (`--sparse-attention topk-blocks`)
is an engine-wide option, so each of its top-k values runs in an engine of its own, in a spawned process.

Per (task, length, policy, budget): accuracy (exact match of the number), KV tokens and bytes kept at the end of
the request (median), decode tok/s = (output tokens - 1) / (E2E - TTFT) (median over requests with >= 2 output
tokens), TTFT (median, seconds from add_request to the first generated token).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from loom.bench.longctx import LongCtxSample, score

LOSSY_POLICIES = ("sinks", "h2o", "snapkv")
SPARSE_POLICY = "topk-blocks"
POLICIES = ("full", *LOSSY_POLICIES, SPARSE_POLICY)


@dataclass(slots=True)
class RequestMeasure:
    correct: bool  # the first number of the output is the answer
    output_text: str  # generated text (up to EOS or max_tokens)
    output_tokens: int  # generated tokens
    ttft_s: float  # seconds from add_request to the first generated token
    e2e_s: float  # seconds from add_request to the last token
    kv_tokens: int  # KV tokens the request holds (or reads per decode step, topk-blocks) at its end
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class LongCtxRow:
    task: str  # passkey | multidoc
    length: int  # nominal prompt length, tokens (2048, 4096, 8192)
    prompt_tokens: int  # actual prompt tokens (the nominal length, less the answer tokens where the context ends)
    policy: str  # full | sinks | h2o | snapkv | topk-blocks
    budget: float | None  # the policy's budget: fraction of the prompt (<= 1) or tokens (> 1); topk-blocks: K
    budget_fraction: float  # KV tokens kept (topk-blocks: read per decode step) / prompt tokens, median
    num_samples: int
    accuracy: float  # 0..1
    kv_tokens_median: float  # tokens of KV kept at the end of the request
    kv_bytes_median: float  # bytes of KV kept at the end of the request (all layers, K and V)
    decode_tok_s_median: float | None  # tokens/s after the first token; None if no request made 2 tokens
    ttft_s_median: float  # seconds
    cached_tokens_median: float  # prompt tokens that came from the prefix cache
    answers: list[str]  # [num_samples] the generated texts, for inspection


def retention_kept_tokens(prompt_tokens: int, output_tokens: int, budget: float, block_size: int,
                          sink_tokens: int, window: int) -> int:
    """KV tokens a lossy retention policy keeps at the end of a request (loom/core/kv_retention.py's rule): at
    most the budget (fraction of the prompt, rounded up, or tokens), but never fewer than the protected sink
    blocks, the newest (partial) block and the recent window's blocks, nor more than the context.

    Used when the engine does not report the request's kept KV itself."""
    context = prompt_tokens + output_tokens - 1  # the last token's KV is never written
    budget_tokens = max(1, math.ceil(budget * prompt_tokens)) if budget <= 1 else int(budget)
    protected = (-(-sink_tokens // block_size) + 1 + -(-window // block_size)) * block_size
    return min(context, max(budget_tokens, protected))


def sparse_read_tokens(context: int, topk: int, block_size: int, sink_blocks: int, recent_blocks: int) -> int:
    """KV tokens a topk-blocks decode query reads: top-k + sink + recent blocks, at most the context."""
    return min(context, (topk + sink_blocks + recent_blocks) * block_size)


def topk_for_fraction(fraction: float, length: int, block_size: int, sink_blocks: int, recent_blocks: int) -> int:
    """The top-k whose blocks read (with sinks and recent ones) are `fraction` of `length` tokens (>= 1)."""
    return max(1, math.ceil(fraction * length / block_size) - sink_blocks - recent_blocks)


def run_request(engine: Any, request_id: str, prompt_token_ids: list[int],
                params: Any) -> tuple[str, int, float, float, int, Any]:
    """Send one request alone through an LLMEngine and step it to the end.

    Returns (text, output tokens, TTFT s, E2E s, cached prompt tokens, the final RequestOutput)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt_token_ids, params)
    first: float | None = None
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if out.finished:
                final = out
    e2e = time.perf_counter() - t0
    comp = final.outputs[0]
    return comp.text, len(comp.token_ids), first if first is not None else e2e, e2e, final.num_cached_tokens, final


def _kv_tokens(dropped_blocks: int | None, prompt_tokens: int, output_tokens: int, policy: str,
               budget: float | None, block_size: int, sink_tokens: int, window: int) -> int:
    """KV tokens of the finished request: its context less the blocks the engine reports dropped while it ran
    alone (EngineStats.kv_retention_blocks_dropped), else (an engine without the counter) the policy's rule."""
    context = prompt_tokens + output_tokens - 1  # the last token's KV is never written
    if dropped_blocks is not None:
        return context - dropped_blocks * block_size
    if policy == "full" or budget is None:
        return context
    return retention_kept_tokens(prompt_tokens, output_tokens, budget, block_size, sink_tokens, window)


def _dropped_blocks(engine: Any) -> int | None:
    return getattr(engine.get_stats(), "kv_retention_blocks_dropped", None)


def measure(engine: Any, sample: LongCtxSample, policy: str, budget: float | None, max_tokens: int,
            request_id: str, engine_args: Any) -> RequestMeasure:
    """One sample under one policy (full, or a lossy retention policy with its budget) in `engine`, built from
    `engine_args` (EngineArgs: its retention sink/window and sparse-attention settings give the KV kept or read).

    Raises:
        ValueError: an unknown policy, or a budget the engine refuses.
    """
    from loom.sampling_params import SamplingParams

    extra: dict[str, Any] = {}
    if policy in LOSSY_POLICIES:
        extra = {"kv_retention": policy, "kv_retention_budget": budget}
    elif policy in ("full", SPARSE_POLICY):
        extra = {"kv_retention": "full"}
    else:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)
    dropped_before = _dropped_blocks(engine)
    text, n_out, ttft, e2e, cached, final = run_request(engine, request_id, sample.prompt_token_ids, params)
    dropped_after = _dropped_blocks(engine)
    dropped = None if dropped_before is None or dropped_after is None else dropped_after - dropped_before
    a = engine_args
    if policy == SPARSE_POLICY:
        kv = sparse_read_tokens(sample.num_tokens + n_out - 1, a.sparse_attention_topk, engine.block_size,
                                a.sparse_attention_sink_blocks, a.sparse_attention_recent_blocks)
    else:
        kv = _kv_tokens(dropped, sample.num_tokens, n_out, policy, budget, engine.block_size,
                        a.kv_retention_sink_tokens, a.kv_retention_window)
    return RequestMeasure(score(text, sample.answer), text, n_out, ttft, e2e, kv, cached)


def summarize(task: str, length: int, policy: str, budget: float | None, samples: list[LongCtxSample],
              measures: list[RequestMeasure], kv_bytes_per_token: float) -> LongCtxRow:
    """One row of the table from the measures of one (task, length, policy, budget)."""
    decode = [(m.output_tokens - 1) / (m.e2e_s - m.ttft_s) for m in measures
              if m.output_tokens >= 2 and m.e2e_s > m.ttft_s]
    kv = statistics.median(m.kv_tokens for m in measures)
    prompt = statistics.median(s.num_tokens for s in samples)
    return LongCtxRow(
        task=task, length=length, prompt_tokens=int(prompt), policy=policy, budget=budget,
        budget_fraction=statistics.median(m.kv_tokens / s.num_tokens for m, s in zip(measures, samples)),
        num_samples=len(measures), accuracy=sum(m.correct for m in measures) / len(measures),
        kv_tokens_median=kv, kv_bytes_median=kv * kv_bytes_per_token,
        decode_tok_s_median=statistics.median(decode) if decode else None,
        ttft_s_median=statistics.median(m.ttft_s for m in measures),
        cached_tokens_median=statistics.median(m.cached_tokens for m in measures),
        answers=[m.output_text for m in measures],
    )  # fmt: skip


def warm_up(engine: Any) -> None:
    """One short request: first-call overheads (kernel compilation, allocation) stay out of the timed runs."""
    from loom.sampling_params import SamplingParams

    ids = [engine.vocab_size - 1 - i for i in range(40)]
    run_request(engine, "longctx-warmup", ids, SamplingParams(temperature=0.0, max_tokens=2))


def run_policies(engine: Any, engine_args: Any, workload: dict[tuple[str, int], list[LongCtxSample]],
                 policies: list[str], budgets: list[float], max_tokens: int, progress: Any = None) -> list[LongCtxRow]:
    """Every sample of `workload` ((task, length) -> samples) under full attention first, then each lossy policy
    at each budget (prompt by prompt, so a policy may reuse the full request's cached prefill).

    Args:
        policies: names from POLICIES except topk-blocks ("full" is always run, first).
        progress: a callable(str) told of each finished request, or None.
    """
    configs: list[tuple[str, float | None]] = [("full", None)]
    configs += [(p, b) for p in policies if p in LOSSY_POLICIES for b in budgets]
    rows = []
    for (task, length), samples in workload.items():
        per: dict[tuple[str, float | None], list[RequestMeasure]] = {c: [] for c in configs}
        for sample in samples:
            for policy, budget in configs:
                rid = f"{task}-{length}-{sample.index}-{policy}-{budget}"
                m = measure(engine, sample, policy, budget, max_tokens, rid, engine_args)
                per[(policy, budget)].append(m)
                if progress is not None:
                    progress(f"{rid}: {'ok ' if m.correct else 'bad'} {m.output_text!r} ttft {m.ttft_s:.2f}s")
        rows += [summarize(task, length, p, b, samples, per[(p, b)], engine.kv_bytes_per_token) for p, b in configs]
    return rows


def run_sparse(engine_args: Any, workload: dict[tuple[str, int], list[LongCtxSample]], topk: int,
               max_tokens: int) -> list[LongCtxRow]:
    """The workload with full retention in an engine of its own under topk-blocks sparse decode attention with
    `topk` blocks (run it in a spawned process: the engine-wide option applies to every request)."""
    from loom.engine.llm_engine import LLMEngine

    args = dataclasses.replace(engine_args, sparse_attention=SPARSE_POLICY, sparse_attention_topk=topk)
    engine = LLMEngine(args)
    warm_up(engine)
    rows = []
    for (task, length), samples in workload.items():
        ms = [measure(engine, s, SPARSE_POLICY, float(topk), max_tokens, f"{task}-{length}-{s.index}-sparse{topk}",
                      args) for s in samples]
        rows.append(summarize(task, length, SPARSE_POLICY, float(topk), samples, ms, engine.kv_bytes_per_token))
    engine.shutdown()
    return rows


def run_sparse_in_process(engine_args: Any, workload: dict[tuple[str, int], list[LongCtxSample]], topk: int,
                          max_tokens: int) -> list[LongCtxRow]:
    """run_sparse in a spawned child process (its engine's memory and threads go when it ends)."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(run_sparse, engine_args, workload, topk, max_tokens).result()


def format_table(rows: list[LongCtxRow]) -> str:
    """A Markdown table of the rows."""
    lines = ["| task | length | prompt tok | policy | budget | KV kept frac | accuracy | KV MB kept | decode tok/s "
             "| TTFT s | cached tok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "-" if r.budget is None else f"{r.budget:g}"
        dec = "-" if r.decode_tok_s_median is None else f"{r.decode_tok_s_median:.1f}"
        lines.append(f"| {r.task} | {r.length} | {r.prompt_tokens} | {r.policy} | {budget} | {r.budget_fraction:.3f} "
                     f"| {100 * r.accuracy:.0f}% ({round(r.accuracy * r.num_samples)}/{r.num_samples}) "
                     f"| {r.kv_bytes_median / 1e6:.1f} | {dec} | {r.ttft_s_median:.2f} "
                     f"| {r.cached_tokens_median:.0f} |")
    if any(r.policy == SPARSE_POLICY for r in rows):
        lines.append("topk-blocks keeps all the KV: its budget is k and its KV columns are the tokens read per decode "
                     "step (k + sink + recent blocks)")
    return "\n".join(lines)


__all__ = ["POLICIES", "LongCtxRow", "RequestMeasure", "format_table", "measure", "retention_kept_tokens",
           "run_policies", "run_sparse", "run_sparse_in_process", "summarize", "topk_for_fraction", "warm_up"]
