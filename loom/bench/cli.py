"""`loom bench latency|throughput|serve` and `loom analyze`. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from loom.engine.arg_utils import add_engine_args

DEFAULT_RESULT_DIR = Path("benchmarks/results")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` (latency, throughput, serve) and `analyze` to the top-level `loom` parser."""
    bench = subparsers.add_parser("bench", help="latency, throughput and serving benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    lat = bench_sub.add_parser("latency", help="one request of --input-len/--output-len tokens, median of runs")
    lat.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    lat.add_argument("--output-len", type=int, default=128, help="generated tokens, ignore_eos (default: %(default)s)")
    lat.add_argument("--num-warmup", type=int, default=1, help="untimed runs (default: %(default)s)")
    lat.add_argument("--num-runs", type=int, default=5, help="timed runs (default: %(default)s)")
    lat.add_argument("--bandwidth-gbs", type=float, default=None,
                     help="memory read bandwidth (GB/s) for the weight-read floor of a decode step (loom analyze "
                          "probes it); printed beside loom's TPOT")
    _add_backend_args(lat)
    _add_output_args(lat)
    add_engine_args(lat)
    from loom.bench.cli_run import cmd_latency, cmd_serve, cmd_throughput  # light: no torch at import

    lat.set_defaults(func=cmd_latency)

    thr = bench_sub.add_parser("throughput", help="N requests at once: requests/s, output and total tok/s")
    _add_dataset_args(thr, default_num_prompts=32)
    _add_backend_args(thr)
    thr.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the hf backend (default: %(default)s)")
    thr.add_argument("--hf-num-prompts", type=int, default=None,
                     help="the hf backend runs only the first N of the same requests (its static batches are slow; "
                          "rates stay comparable, totals do not) (default: all)")
    _add_output_args(thr)
    add_engine_args(thr)
    thr.set_defaults(func=cmd_throughput)

    srv = bench_sub.add_parser("serve", help="stream requests to an OpenAI-compatible server (loom or llama-server)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    srv.add_argument("--model", default=None, help="'model' field of each request (default: the first of GET /v1/models)")
    srv.add_argument("--tokenizer", default=None,
                     help="GGUF or HF directory whose tokenizer counts prompt tokens and whose vocab the synthetic "
                          "prompts use (default: the bundled SmolLM2-135M-Instruct)")
    srv.add_argument("--request-rate", type=float, default=math.inf,
                     help="mean requests/s of a Poisson arrival process; inf = all at once (default: %(default)s)")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: unbounded)")
    srv.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, e2e)")
    srv.add_argument("--label", default="server", help="name of the server in the result files (default: %(default)s)")
    _add_dataset_args(srv, default_num_prompts=64)
    _add_output_args(srv)
    srv.set_defaults(func=cmd_serve)
    from loom.bench.prefix import register_prefix  # light: no torch at import

    register_prefix(bench_sub)
    from loom.bench.cli_quality import register_quality  # light: no torch at import

    register_quality(bench_sub)
    from loom.bench.cli_quant import register_quant  # light: no torch at import

    register_quant(bench_sub)
    from loom.bench.cli_longctx import register_longctx  # light: no torch at import

    register_longctx(bench_sub)

    ana = subparsers.add_parser("analyze", help="roofline floors of a model on this machine (compute the floor first)")
    _add_analyze_args(ana)
    ana.set_defaults(func=_cmd_analyze)


def _cmd_analyze(ns: argparse.Namespace) -> int:
    if ns.model is not None:  # a wrong path is refused before the machine probe imports torch
        from loom.bench.model_arch import check_model_arch_path

        check_model_arch_path(ns.model)
    from loom.bench.cli_analyze import cmd_analyze  # the roofline's machine probe imports torch

    return cmd_analyze(ns)


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", nargs="+", choices=("loom", "hf"), default=["loom"],
                   help="engines to measure in this run, e.g. --backend loom hf (default: loom)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--result-dir", type=Path, default=DEFAULT_RESULT_DIR,
                   help="where the JSON and PNG go (default: %(default)s)")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")


def _add_dataset_args(p: argparse.ArgumentParser, default_num_prompts: int) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=("synthetic", "sharegpt", "file"), default="synthetic",
                   help="synthetic token ids, ShareGPT (pip install 'loom[bench]'), or --dataset-path (default: %(default)s)")
    g.add_argument("--dataset-path", default=None, help="prompt file: text lines or JSONL (for --dataset file)")
    g.add_argument("--num-prompts", type=int, default=default_num_prompts, help="requests (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=128,
                   help="tokens per request for synthetic and file prompts (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="synthetic lengths uniform in len·[1−r, 1+r] (default: %(default)s)")
    g.add_argument("--fixed-output-len", type=int, default=None,
                   help="ShareGPT: use this output length instead of the recorded reply's")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the sampling of requests (default: %(default)s)")


def _add_analyze_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto",
                   help="weight dtype: auto (what the engine runs: 'packed' for a GGUF file, else bfloat16 where "
                        "the CPU multiplies it natively, else float32), float32, bfloat16, float16, int8, q8_0, "
                        "q4_1, q4_0, 'packed' (loom's layouts for the GGUF file's types, what quantization gguf "
                        "reads) or 'stored' (the GGUF's own bytes) (default: %(default)s)")
    p.add_argument("--kv-dtype", default=None,
                   help="KV cache dtype (default: what the engine stores: float16 under packed weights, else the "
                        "compute dtype)")
    p.add_argument("--compute-dtype", default=None,
                   help="matmul dtype of the FLOP/s probe (default: --dtype if a float type, else float32)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth in GB/s (default: probe)")
    p.add_argument("--gflops", type=float, default=None, help="matmul rate in GFLOP/s (default: probe)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the probe (default: torch's)")
    p.add_argument("--batch", type=int, default=1, help="B, decode batch (default: %(default)s)")
    p.add_argument("--context", type=int, default=0, help="C, context tokens per sequence (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="N, prompt tokens of the prefill floor (default: %(default)s)")
    p.add_argument("--kv-budget-gb", type=float, default=0.5, help="KV cache budget in GiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request (default: the model's context length, as the engine uses)")
    p.add_argument("--measured-tpot-ms", type=float, default=None, help="measured TPOT at (B, C), ms")
    p.add_argument("--measured-ttft-ms", type=float, default=None, help="measured TTFT for --prompt-len, ms")
    p.add_argument("--measured-output-tok-s", type=float, default=None, help="measured decode tok/s at (B, C)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    par = p.add_argument_group("parallel layout (issue 14: roofline of a rank's shard plus communication)")
    # dests unlike the engine's: loom.cli treats a namespace with tensor_parallel_size under torchrun as a worker's
    par.add_argument("--tensor-parallel-size", "-tp", dest="tp_size", type=int, default=1,
                     help="N, ranks splitting every layer; > 1 adds the predicted step time (default: %(default)s)")
    par.add_argument("--pipeline-parallel-size", "-pp", dest="pp_size", type=int, default=1,
                     help="M, stages of consecutive layers; > 1 adds the predicted step time (default: %(default)s)")
    par.add_argument("--pipeline-microbatches", "--pipeline-micro-batches", dest="pp_micro_batches", type=int,
                     default=None,
                     help="m, decode micro-batches in flight over the stages (default: min(M, --batch))")
    par.add_argument("--interconnect", default="loopback",
                     help="link between ranks: nvlink, pcie, 25gbe, 100gbe, or loopback (this machine's gloo, "
                          "from --link-profile) (default: %(default)s)")
    par.add_argument("--link-bandwidth-gbs", type=float, default=None,
                     help="link bandwidth in GB/s per direction per rank, replacing the interconnect's")
    par.add_argument("--link-latency-us", type=float, default=None,
                     help="link latency in microseconds per message hop, replacing the interconnect's")
    par.add_argument("--link-profile", type=Path, default=None,
                     help="benchmarks/comm_bench.py JSON for --interconnect loopback (default: "
                          "benchmarks/results/comm_loopback.json if present, else built-in figures)")


def result_path(result_dir: Path, kind: str, label: str, suffix: str) -> Path:
    """benchmarks/results/<kind>-<label>-<YYYYmmdd-HHMMSS>.<suffix>."""
    return result_dir / f"{kind}-{label}-{time.strftime('%Y%m%d-%H%M%S')}.{suffix}"
