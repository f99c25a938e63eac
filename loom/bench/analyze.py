"""`loom analyze`: print the roofline floors of a model on this machine, and measured figures against them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from loom.bench.comm import ParallelPrediction, PhasePrediction
from loom.bench.roofline import Roofline

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int  # B, sequences decoded together
    context: int  # C, tokens of context per sequence during decode
    prompt_len: int  # N, prompt tokens for the prefill floor
    kv_budget_bytes: float  # memory given to the KV cache, bytes
    max_model_len: int  # tokens per request, for the "max concurrency" figure


@dataclass(frozen=True, slots=True)
class MeasuredFigures:
    tpot_s: float | None = None  # measured time per output token at (batch, context), seconds
    ttft_s: float | None = None  # measured time to first token for prompt_len tokens (no queueing), seconds
    output_tok_s: float | None = None  # measured decode throughput at (batch, context), tokens/s


@dataclass(frozen=True, slots=True)
class Efficiency:
    name: str  # what was measured
    measured: float  # in `unit`
    floor: float  # best physically possible value, in `unit`
    unit: str  # "s" or "tok/s"
    fraction: float  # share of the floor reached: floor/measured for times, measured/ceiling for rates (1 = at the roofline)


def floor_summary(roof: Roofline, work: Workload) -> dict[str, float | str]:
    """Every floor and derived figure for `work`, keyed by a name that includes its unit."""
    a, m = roof.arch, roof.machine
    kv_tokens = roof.kv_capacity_tokens(work.kv_budget_bytes)
    return {
        "model": a.name,
        "params": a.num_params,
        "params_per_decoded_token": a.num_decode_params,
        "weight_bytes_per_step": roof.weight_bytes,
        "stored_weight_bytes": a.stored_weight_bytes or 0,
        "kv_bytes_per_token": roof.kv_bytes_per_token,
        "kv_capacity_tokens": kv_tokens,
        # a request at max_model_len holds every layer's KV, or (sliding-window layers under loom's hybrid KV
        # cache) only their window's
        "max_concurrency_at_max_model_len": kv_tokens / work.max_model_len if not a.num_sliding_layers else
        work.kv_budget_bytes / (roof.kv_bytes_per_token * a.attended_context(work.max_model_len)),
        "bandwidth_GBps": m.bandwidth / 1e9,
        "matmul_GFLOPs": m.flops / 1e9,
        "ridge_FLOP_per_byte": m.ridge,
        "decode_step_floor_ms_B1_C0": roof.decode_step_floor(1, 0) * 1e3,
        f"decode_step_floor_ms_B{work.batch}_C{work.context}": roof.decode_step_floor(work.batch, work.context) * 1e3,
        f"decode_bound_B{work.batch}_C{work.context}": roof.decode_bound(work.batch, work.context),
        f"prefill_floor_ms_N{work.prompt_len}": roof.prefill_floor(work.prompt_len) * 1e3,
        "saturation_batch_C0": roof.saturation_batch(0),
        f"saturation_batch_C{work.context}": roof.saturation_batch(work.context),
        "single_stream_ceiling_tok_s_C0": roof.single_stream_ceiling(0),
        f"single_stream_ceiling_tok_s_C{work.context}": roof.single_stream_ceiling(work.context),
        f"decode_throughput_ceiling_tok_s_B{work.batch}_C{work.context}":
            roof.decode_throughput_ceiling(work.batch, work.context),
    }


def efficiencies(roof: Roofline, work: Workload, measured: MeasuredFigures) -> list[Efficiency]:
    """Each measured figure as a fraction of its roofline floor (1.0 = at the physical limit)."""
    out: list[Efficiency] = []
    if measured.tpot_s is not None:
        floor = roof.decode_step_floor(work.batch, work.context)
        out.append(Efficiency(f"TPOT B={work.batch} C={work.context}", measured.tpot_s, floor, "s",
                              floor / measured.tpot_s))
        achieved_bw = roof.decode_bytes(work.batch, work.context) / measured.tpot_s
        out.append(Efficiency("achieved bandwidth", achieved_bw, roof.machine.bandwidth, "B/s",
                              achieved_bw / roof.machine.bandwidth))
    if measured.ttft_s is not None:
        floor = roof.prefill_floor(work.prompt_len)
        out.append(Efficiency(f"TTFT N={work.prompt_len}", measured.ttft_s, floor, "s", floor / measured.ttft_s))
    if measured.output_tok_s is not None:
        ceiling = roof.decode_throughput_ceiling(work.batch, work.context)
        out.append(Efficiency(f"output tok/s B={work.batch} C={work.context}", measured.output_tok_s, ceiling,
                              "tok/s", measured.output_tok_s / ceiling))
    return out


def format_summary(summary: dict[str, float | str]) -> str:
    """Two-column text table of floor_summary()."""
    width = max(len(k) for k in summary)
    lines = []
    for key, value in summary.items():
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        shown = f"{value:,.4g}" if isinstance(value, float) else (f"{value:,}" if isinstance(value, int) else value)
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


def format_efficiencies(rows: list[Efficiency]) -> str:
    """One line per measured figure: measured, floor, fraction of the floor."""
    return "\n".join(f"{r.name:<32} measured {r.measured:.4g} {r.unit}  floor {r.floor:.4g} {r.unit}  "
                     f"-> {100 * r.fraction:.1f}% of roofline" for r in rows)


def parallel_summary(pred: ParallelPrediction, work: Workload, link_source: str) -> dict[str, float | str]:
    """Predicted figures of a tensor- and pipeline-parallel layout (loom.bench.comm.predict), keyed with units."""
    b, c, n = work.batch, work.context, work.prompt_len
    d, p = pred.decode, pred.prefill
    return {
        "tensor_parallel_size": pred.tensor_parallel_size,
        "pipeline_parallel_size": pred.pipeline_parallel_size,
        "pipeline_micro_batches_decode": d.micro_batches,
        "interconnect": pred.link.name,
        "interconnect_source": link_source,
        "link_bandwidth_GBps": pred.link.bandwidth / 1e9,
        "link_latency_us": pred.link.latency * 1e6,
        **{f"link_{o.op}_bandwidth_GBps": o.bandwidth / 1e9 for o in pred.link.per_op},
        **{f"link_{o.op}_latency_us": o.latency * 1e6 for o in pred.link.per_op},
        "activation_bytes_on_wire": pred.activation_bytes,
        "params_per_decoded_token_per_rank_all_layers": pred.shard.num_decode_params,
        f"decode_comm_bytes_B{b}": d.comm.bytes,
        f"decode_comm_ms_B{b}": d.comm.time_s * 1e3,
        f"decode_compute_ms_B{b}_C{c}": d.compute_s * 1e3,
        "decode_bubble_fraction": d.bubble_fraction,
        f"predicted_tpot_ms_B{b}_C{c}": d.time_s * 1e3,
        f"predicted_decode_tok_s_B{b}_C{c}": pred.decode_tok_s,
        f"decode_comm_share_B{b}_C{c}": d.comm.time_s / d.time_s,
        f"prefill_comm_bytes_N{n}": p.comm.bytes,
        f"prefill_comm_ms_N{n}": p.comm.time_s * 1e3,
        f"prefill_compute_ms_N{n}": p.compute_s * 1e3,
        "prefill_bubble_fraction": p.bubble_fraction,
        f"predicted_ttft_ms_N{n}": p.time_s * 1e3,
    }


def format_comm(phase: PhasePrediction, label: str) -> str:
    """One line per kind of message of a phase: count, bytes, time."""
    lines = [f"{label}: {len(phase.comm.items)} kinds of message, {phase.comm.bytes:,.0f} bytes, "
             f"{phase.comm.time_s * 1e3:.4g} ms on the critical path"]
    lines += [f"  {i.op:<10} x{i.messages:<5} {i.message_bytes:>14,.0f} B  p={i.ranks}  {i.time_s * 1e3:>9.4g} ms  "
              f"{i.what}" for i in phase.comm.items]
    return "\n".join(lines)


def _comm_json(phase: PhasePrediction) -> list[dict[str, object]]:
    return [{**asdict(i), "bytes": i.bytes} for i in phase.comm.items]


def to_json(summary: dict[str, float | str], rows: list[Efficiency],
            parallel: tuple[dict[str, float | str], ParallelPrediction] | None = None) -> str:
    """Summary and efficiencies as one JSON document (inf becomes null); with `parallel` (its summary and
    prediction) also "parallel" and "communication" (each message kind of a decode step and of a prefill)."""
    clean = {k: (None if isinstance(v, float) and v == float("inf") else v) for k, v in summary.items()}
    doc: dict[str, object] = {"floors": clean, "efficiency": [asdict(r) for r in rows]}
    if parallel is not None:
        psum, pred = parallel
        doc["parallel"] = psum
        doc["communication"] = {"decode": _comm_json(pred.decode), "prefill": _comm_json(pred.prefill)}
    return json.dumps(doc, indent=2)
