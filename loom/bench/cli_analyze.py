"""Handler of `loom analyze`: roofline floors of a model on this machine, and measured figures against them."""

from __future__ import annotations

import argparse

from loom.bench.analyze import (
    GIB,
    MeasuredFigures,
    Workload,
    efficiencies,
    floor_summary,
    format_comm,
    format_efficiencies,
    format_summary,
    parallel_summary,
    to_json,
)
from loom.bench.comm import ParallelPrediction, interconnect, predict
from loom.bench.model_arch import load_model_arch
from loom.bench.roofline import BYTES_PER_WEIGHT, Roofline, kv_bytes_per_element

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def build_roofline(ns: argparse.Namespace) -> Roofline:
    """Model arch + machine (probed unless both --bandwidth-gbs and --gflops are given) + dtypes.

    Raises:
        ValueError: unknown --dtype, --kv-dtype or --compute-dtype, or 'stored' for a model without stored bytes.
    """
    from loom.bench.probe import DTYPES, MachineSpec, probe_machine

    arch = load_model_arch(ns.model)
    if ns.dtype == "auto":  # what the engine runs: a GGUF file packed (quantization gguf), else its dtype
        ns.dtype = "packed" if arch.packed_decode_bytes is not None else _engine_dtype()
    compute = ns.compute_dtype or (ns.dtype if ns.dtype in FLOAT_DTYPES else "float32")
    if compute not in DTYPES:
        raise ValueError(f"--compute-dtype must be one of {tuple(DTYPES)}, got {compute!r}")
    # the engine's --kv-cache-dtype auto: float16 under packed weights (llama.cpp's KV type), else the compute dtype
    kv = ns.kv_dtype if ns.kv_dtype is not None else (  # packed weight formats run a float32 model
        "float16" if ns.dtype not in FLOAT_DTYPES and compute == "float32" else compute)
    kv_bytes = kv_bytes_per_element(kv, arch.head_dim, "--kv-dtype")
    if ns.dtype not in ("stored", "packed") and ns.dtype not in BYTES_PER_WEIGHT:
        raise ValueError(f"--dtype must be 'stored', 'packed' or one of {tuple(BYTES_PER_WEIGHT)}, got {ns.dtype!r}")
    if ns.dtype == "packed":
        if arch.packed_decode_bytes is None:
            raise ValueError("--dtype packed needs a GGUF model")
        b = arch.packed_decode_bytes / arch.num_decode_params
    elif ns.dtype == "stored":
        if arch.stored_weight_bytes is None:
            raise ValueError("--dtype stored needs a GGUF model")
        b = arch.stored_weight_bytes / arch.num_params
    else:
        b = BYTES_PER_WEIGHT[ns.dtype]
    if ns.bandwidth_gbs is not None and ns.gflops is not None:
        machine = MachineSpec(ns.bandwidth_gbs * 1e9, ns.gflops * 1e9, compute, ns.threads or 0, "given")
    else:
        probed = probe_machine(compute, ns.threads)
        machine = MachineSpec(ns.bandwidth_gbs * 1e9 if ns.bandwidth_gbs else probed.bandwidth,
                              ns.gflops * 1e9 if ns.gflops else probed.flops, compute, probed.threads, "probe")
    return Roofline(arch, machine, b, kv_bytes)


def _engine_dtype() -> str:
    """The dtype the engine's "auto" picks on this machine's CPU."""
    import torch

    from loom.worker.model_runner import bf16_is_fast

    return "bfloat16" if bf16_is_fast(torch.device("cpu")) else "float32"


def check_parallel_args(ns: argparse.Namespace) -> None:
    """Validate the parallel-layout flags before the (slow) machine probe.

    Raises:
        ValueError: a size < 1, an unknown --interconnect, a --link-bandwidth-gbs <= 0 or --link-latency-us < 0,
            naming the flag.
    """
    for dest, flag in (("tp_size", "--tensor-parallel-size"), ("pp_size", "--pipeline-parallel-size"),
                       ("pp_micro_batches", "--pipeline-microbatches")):
        v = getattr(ns, dest)
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if ns.link_profile is not None and ns.interconnect != "loopback":
        raise ValueError(f"--link-profile is a loopback measurement: it has no effect with --interconnect "
                         f"{ns.interconnect}")
    interconnect(ns.interconnect, ns.link_bandwidth_gbs, ns.link_latency_us, ns.link_profile)


def parallel_prediction(roof: Roofline, work: Workload, ns: argparse.Namespace,
                        compute_dtype: str) -> tuple[ParallelPrediction, str]:
    """loom.bench.comm.predict for the flags; activations on the wire in the compute dtype. Returns it and where
    the link's figures came from.

    Raises:
        ValueError: what check_parallel_args and predict raise.
    """
    link, source = interconnect(ns.interconnect, ns.link_bandwidth_gbs, ns.link_latency_us, ns.link_profile)
    act = 4.0 if compute_dtype == "float32" else 2.0
    return predict(roof, work.batch, work.context, work.prompt_len, ns.tp_size, ns.pp_size, link, act,
                   ns.pp_micro_batches), source


def cmd_analyze(ns: argparse.Namespace) -> int:
    """Print the floors (and efficiencies when measured figures are given), and with a tensor- or pipeline-parallel
    size above 1 the predicted step time, TTFT and tokens/s; optionally write JSON."""
    check_parallel_args(ns)
    roof = build_roofline(ns)
    if ns.max_model_len is None:
        ns.max_model_len = roof.arch.max_position_embeddings
    work = Workload(ns.batch, ns.context, ns.prompt_len, ns.kv_budget_gb * GIB, ns.max_model_len)
    if work.batch < 1 or work.prompt_len < 1 or work.context < 0 or work.max_model_len < 1:
        raise ValueError("--batch, --prompt-len and --max-model-len must be >= 1 and --context >= 0")
    measured = MeasuredFigures(
        tpot_s=ns.measured_tpot_ms / 1e3 if ns.measured_tpot_ms else None,
        ttft_s=ns.measured_ttft_ms / 1e3 if ns.measured_ttft_ms else None,
        output_tok_s=ns.measured_output_tok_s,
    )
    summary = {"weight_dtype": ns.dtype, "weight_bytes_per_param": roof.weight_bytes_per_param,
               "kv_bytes_per_element": roof.kv_bytes_per_element, "machine_source": roof.machine.source,
               "threads": roof.machine.threads, **floor_summary(roof, work)}
    print(format_summary(summary))
    rows = efficiencies(roof, work, measured)
    if rows:
        print()
        print(format_efficiencies(rows))
    parallel = None
    if ns.tp_size > 1 or ns.pp_size > 1:
        pred, source = parallel_prediction(roof, work, ns, roof.machine.dtype)
        parallel = (parallel_summary(pred, work, source), pred)
        print()
        print(format_summary(parallel[0]))
        print()
        print(format_comm(pred.decode, f"decode step B={work.batch}"))
        print(format_comm(pred.prefill, f"prefill N={work.prompt_len}"))
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(to_json(summary, rows, parallel))
    return 0
