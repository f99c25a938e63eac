"""`loom quantize --method awq`: an AutoAWQ "gemm" checkpoint (loom/quant/awq_format.py) from a GGUF file or a
Hugging Face directory, by AWQ (Lin et al. 2023, arXiv:2306.00978; loom/quant/awq_model.py). The norms and the
v / up rows that took 1/s are written with their new values; embeddings, norms and the LM head stay float32.
loom loads the output with `--quantization awq`, its default for such a checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.quant.awq_model import AWQReport, AWQSettings, quantize_model_awq
from loom.quant.gptq import GPTQWeight

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AWQResult:
    output: Path
    settings: AWQSettings
    calibration: str  # where the calibration tokens came from
    calibration_tokens: int
    seconds: float  # wall time of the whole run (loading, calibration, search, writing)
    quantization_config: dict[str, Any]  # what config.json's quantization_config says
    report: AWQReport
    bits_per_weight: float | None = None  # stored bits per linear weight (mixed precision; None: AWQ's own format)


def _folded_tensors(model: torch.nn.Module, arch: Any, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float tensors AWQ's folding changed, under their checkpoint names: both norms of every layer, and
    v_proj's bias when the checkpoint has one (o_proj's scales divide it)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer.input_layernorm.weight.detach().float().clone()
        out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach().float().clone()
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None and f"{p}.self_attn.v_proj.bias" in source:
            out[f"{p}.self_attn.v_proj.bias"] = bias.detach().float()[arch.q_size + arch.kv_size:].clone()
    return out


def checkpoint_tensors(source: dict[str, torch.Tensor], quantized: dict[str, GPTQWeight], model: torch.nn.Module,
                       arch: Any) -> dict[str, torch.Tensor]:
    """The output's tensors: each projection's AWQ tensors in place of its weight, the folded norms and biases,
    the rest of the source in float32.

    Raises:
        ValueError: the source lacks a projection's weight.
    """
    from loom.quant.awq_format import to_checkpoint
    from loom.quant.gptq_checkpoint import PROJECTIONS, split_rows

    tensors: dict[str, torch.Tensor] = {}
    replaced = set()
    for name, weight in quantized.items():
        lin = model.get_submodule(name)
        head, _, last = name.rpartition(".")
        for proj, part in zip(PROJECTIONS[last], split_rows(weight, lin.output_sizes), strict=True):
            for key, t in to_checkpoint(part).items():
                tensors[f"{head}.{proj}.{key}"] = t
            replaced.add(f"{head}.{proj}.weight")
    missing = replaced - set(source)
    if missing:
        raise ValueError(f"the source checkpoint lacks {sorted(missing)[:4]}")
    folded = _folded_tensors(model, arch, source)
    for name, t in source.items():
        if name not in replaced:
            tensors[name] = folded.get(name, t).float().contiguous()
    return tensors


def _load_source(model: str | None, output: str, settings: AWQSettings, windows: list[list[int]]) -> tuple:
    """The checks both AWQ writers make, then the source as a dense float32 loom model: (output directory, start
    time, source path, loaded model). ValueError: bad settings, no window, an output in use, an architecture loom
    cannot write a config for."""
    from loom.model.loader import load_model
    from loom.model.loader.model_loader import resolve_model_path
    from loom.quant.quantize import MODEL_TYPES, _check_output

    settings.check()
    if not windows:
        raise ValueError("awq needs at least one calibration window")
    out = _check_output(output)
    start = time.perf_counter()
    path = resolve_model_path(model)
    loaded = load_model(model, torch.float32, torch.device("cpu"), quantization="none")
    if loaded.arch.architecture not in MODEL_TYPES:
        raise ValueError(f"awq cannot write a config for {loaded.arch.architecture}")
    return out, start, path, loaded


def _put_back(model: torch.nn.Module, scaled: dict[str, torch.Tensor]) -> None:
    """The AWQ-scaled float weights (quantize_model_awq's float_weights: loom layer name -> [out, in] float32) back
    in `model` in place of the rounded ones: the model the allocation measures and GPTQ rounds (AWQ + GPTQ,
    llm-compressor's AWQModifier then GPTQModifier; GPTQ: Frantar et al. 2022, arXiv:2210.17323)."""
    for name, w in scaled.items():
        model.get_submodule(name).weight.data.copy_(w)


def _check_gptq_clip(settings: AWQSettings) -> None:
    """Raises ValueError unless clip is "off": GPTQ rounds the scaled weights unclipped."""
    if settings.clip != "off":
        raise ValueError("awq with gptq weight rounding takes clip 'off' (GPTQ rounds the unclipped scaled weights)")


def write_awq_checkpoint(model: str | None, output: str, settings: AWQSettings, windows: list[list[int]], *,
                         calibration: str = "", weight_rounding: str = "rtn", damp_percent: float = 0.01,
                         desc_act: bool = False) -> AWQResult:
    """Quantize `model` (GGUF file, HF directory, None = the bundled model) with AWQ and write an AutoAWQ gemm
    checkpoint to `output` (model.safetensors, config.json with quantization_config, the tokenizer).

    weight_rounding "gptq": AWQ's scales folded, then the scaled weights rounded by GPTQ onto AWQ's grid (4 bits,
    asymmetric, settings.group_size) instead of clipped and rounded to nearest (gptq_checkpoint.quantize_model_weights
    on the scaled model), with GPTQ's
    dampening damp_percent and, with desc_act, act order over static groups (each group's scale and zero fixed
    over its consecutive columns first, so the groups stay contiguous); settings.clip must then be "off".

    Raises:
        ValueError: bad settings, an architecture loom cannot write a config for, an output directory that
            exists and is not empty, no calibration window, or a group size that does not divide a layer's input.
    """

    from loom.quant.awq_format import quantization_config
    from loom.quant.gptq_checkpoint import GPTQSettings, quantize_model_weights
    from loom.quant.quantize import source_checkpoint, write_checkpoint

    if weight_rounding not in ("rtn", "gptq"):
        raise ValueError(f"weight_rounding must be 'rtn' or 'gptq', got {weight_rounding!r}")
    if weight_rounding == "gptq":
        _check_gptq_clip(settings)
    if desc_act and weight_rounding != "gptq":
        raise ValueError("desc_act (act order) applies to awq with gptq weight rounding")
    gptq = GPTQSettings("gptq", 4, settings.group_size, False, desc_act, damp_percent, static_groups=desc_act)
    if weight_rounding == "gptq":
        gptq.check()  # before the search, not after it
    out, start, path, loaded = _load_source(model, output, settings, windows)
    tokens = sum(len(w) for w in windows)
    scaled: dict[str, torch.Tensor] = {}
    quantized, report = quantize_model_awq(loaded.model, loaded.arch, settings, windows, scaled)
    if weight_rounding == "gptq":
        _put_back(loaded.model, scaled)
        quantized = quantize_model_weights(loaded.model, loaded.arch, gptq, windows)
    source, config = source_checkpoint(path, loaded.arch, set(loaded.eos_token_ids))
    qc = quantization_config(settings.group_size, {
        "quantizer": ["loom"], "method": "awq", "calibration": calibration, "calibration_tokens": tokens,
        "clip": settings.clip, "grid_points": settings.grid_points,
        "search_windows": min(settings.search_windows, len(windows)), "scaling": settings.scaling,
        "loss": settings.loss,
        "duo_groups": sum(report.duo.values()), "scaled_groups": len(report.duo),
        "clipped": list(report.clipped),
        "clip_scores": {name: score._asdict() for name, score in report.clip_scores.items()},
        "clip_windows": report.clip_windows, "clip_held_out": report.clip_held_out,
        "o_proj_scaled": report.o_proj_scaled, "weight_rounding": weight_rounding,
        **({"damp_percent": damp_percent, "desc_act": desc_act} if weight_rounding == "gptq" else {})})
    config["quantization_config"] = qc
    tensors = checkpoint_tensors(source, quantized, loaded.model, loaded.arch)
    write_checkpoint(out, tensors, config, loaded.tokenizer)
    seconds = time.perf_counter() - start
    logger.info("wrote %s in %.1f s (scaling %s: the duo formula won %d of %d groups; weights %s)", out, seconds,
                settings.scaling, sum(report.duo.values()), len(report.duo),
                "rounded by GPTQ" if weight_rounding == "gptq" else f"clipped ({settings.clip}) and rounded to nearest")
    return AWQResult(out, settings, calibration, tokens, seconds, qc, report)


def write_awq_mixed_checkpoint(model: str | None, output: str, settings: AWQSettings, mixed: Any,
                               windows: list[list[int]], *, calibration: str = "") -> AWQResult:
    """AWQ with mixed precision (`loom quantize --method awq --target-bits B`): AWQ's scales searched and folded
    (norms, v / up rows) as write_awq_checkpoint does, then each decoder linear layer's format chosen on the scaled
    model under the budget (loom/quant/mixed.py: ZeroQ sensitivity, greedy allocation, as for rtn / gptq): layers
    left in the base format keep AWQ's own 4-bit weights (its clipping included), upgraded ones are the scaled
    weights by round to nearest in their format (4-bit groups of 32, 8 bits), or 16 bits. With `mixed.method`
    "gptq" every layer, base ones included, is GPTQ of the scaled weights in its format instead (AWQ + GPTQ;
    clipping off). AutoAWQ's format has one
    bit width, so the output is a GPTQ-format checkpoint (`quant_method` "gptq", `meta.method` "awq", GPTQModel's
    `dynamic` per layer; loom/quant/gptq_format.py) with AWQ's folded norms; `checkpoint_format` "gptq" (v1, what
    AutoGPTQ and transformers read) unless some AWQ group's zero point is 0, which only v2 stores.

    Args:
        mixed: a loom.quant.gptq_checkpoint.GPTQSettings with method "rtn" (or "gptq": the weight rounding), 4 bits
            and the AWQ group size, asymmetric, act order only with "gptq" and static groups, its target_bits,
            lm_head_bits and sensitivity_windows.

    Raises:
        ValueError: as write_awq_checkpoint, or a budget below the base format's bits.
    """
    from loom.quant.gptq_checkpoint import (check_lm_head_bits, checkpoint_tensors, lm_head_tensors,
                                            mixed_precision_plan, quantize_model_weights)
    from loom.quant.mixed import plan_bits, units_of
    from loom.quant.quantize import source_checkpoint, write_checkpoint

    mixed.check()
    if mixed.bits != 4 or mixed.group_size != settings.group_size or mixed.sym \
            or (mixed.desc_act and (mixed.method != "gptq" or not mixed.static_groups)) or mixed.target_bits is None:
        raise ValueError("awq mixed precision takes rtn or gptq settings of 4 asymmetric bits in AWQ's groups, "
                         "act order only by gptq with static groups, with target_bits")
    if mixed.method == "gptq":
        _check_gptq_clip(settings)
    out, start, path, loaded = _load_source(model, output, settings, windows)
    arch = loaded.arch
    check_lm_head_bits(mixed.lm_head_bits, arch.vocab_size)
    units = units_of(loaded.model)  # the budget checked before the slow search
    floor = plan_bits(units, dict.fromkeys((u.name for u in units), mixed.base_format()))
    if mixed.target_bits < floor - 1e-9:
        raise ValueError(f"target_bits {mixed.target_bits} is below the {floor:.3f} bits per weight of 4-bit groups "
                         f"of {mixed.group_size} (codes, scales, zeros and g_idx)")
    tokens = sum(len(w) for w in windows)
    scaled: dict[str, torch.Tensor] = {}
    awq_weights, report = quantize_model_awq(loaded.model, arch, settings, windows, scaled)
    _put_back(loaded.model, scaled)  # the sensitivity trials restore these weights, so GPTQ reads them too
    plan, dynamic, bits = mixed_precision_plan(loaded.model, arch, mixed, windows)
    base = mixed.base_format()
    if mixed.method == "gptq":  # every layer by GPTQ in its format (the plan's None: 16 bits, left dense)
        quantized = quantize_model_weights(loaded.model, arch, mixed, windows, plan)
    else:
        upgraded = {name: fmt for name, fmt in plan.items() if fmt != base}
        quantized = quantize_model_weights(loaded.model, arch, mixed, windows, upgraded | {
            name: None for name in plan if name not in upgraded})  # RTN of the upgraded layers only
        quantized |= {name: awq_weights[name] for name, fmt in plan.items() if fmt == base}
    source, config = source_checkpoint(path, arch, set(loaded.eos_token_ids))
    source = source | _folded_tensors(loaded.model, arch, source)
    half = set()
    for u in units_of(loaded.model):  # 16-bit layers: their scaled weights, not the source's
        if plan[u.name] is None:
            lin = loaded.model.get_submodule(u.name)
            for proj, rows in zip(u.projections, scaled[u.name].split(lin.output_sizes), strict=True):
                source[f"{proj}.weight"] = rows.contiguous()
                half.add(f"{proj}.weight")
    # AWQ's grid may put a group's zero at 0, which GPTQ's v1 format (zero - 1) cannot store: then the whole file
    # is v2 (the zero itself; GPTQModel and loom read it)
    fmt = "gptq_v2" if any(int(q.zeros.min()) == 0 for q in quantized.values() if q.zeros.numel()) else "gptq"
    qc = mixed.quantization_config(calibration, tokens, dynamic)
    qc["format"] = qc["checkpoint_format"] = fmt
    qc["meta"] |= {"method": "awq", "clip": settings.clip, "scaling": settings.scaling, "loss": settings.loss,
                   "clipped": list(report.clipped), "search_windows": min(settings.search_windows, len(windows)),
                   "duo_groups": sum(report.duo.values()), "scaled_groups": len(report.duo),
                   "base_format_groups": sum(f == base for f in plan.values()), "layer_groups": len(plan),
                   "weight_rounding": mixed.method}
    config["quantization_config"] = qc
    tensors = checkpoint_tensors(source, quantized, loaded.model, frozenset(half), fmt)
    if mixed.lm_head_bits is not None:
        tensors.update(lm_head_tensors(source, mixed, fmt))
        tensors.pop("lm_head.weight", None)
        config["tie_word_embeddings"] = False
    write_checkpoint(out, tensors, config, loaded.tokenizer)
    seconds = time.perf_counter() - start
    logger.info("wrote %s in %.1f s (awq + mixed precision: %.3f stored bits per linear weight, %d of %d layer "
                "groups in the base format, %s)", out, seconds, bits, sum(f == base for f in plan.values()), len(plan),
                "every layer by GPTQ" if mixed.method == "gptq" else "base ones AWQ's own weights, upgrades by RTN")
    return AWQResult(out, settings, calibration, tokens, seconds, qc, report, bits)
