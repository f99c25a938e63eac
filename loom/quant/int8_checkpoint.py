"""INT8 weight checkpoints with a scale per output channel (or one per tensor), in the compressed-tensors layout:
W8A8 (int8 activations, dynamic per token or static per tensor) and W8A16 (weights only), as llm-compressor
writes them (its SmoothQuant + RTN/GPTQ "W8A8" recipes) and vLLM reads them. `loom quantize --method w8a8` writes
them (loom/quant/quantize.py); loom loads them, and checkpoints of the same form from elsewhere.

The format (compressed-tensors "int-quantized"):

| tensor          | dtype        | shape   | content                                                            |
|-----------------|--------------|---------|--------------------------------------------------------------------|
| P.weight        | int8         | [N, K]  | round(W / scale) clamped to the int8 range                          |
| P.weight_scale  | float (any)  | [N, 1]  | the scale of each output channel (strategy "channel"), or [1] ("tensor") |
| P.input_scale   | float (any)  | [1]     | static activations only: x is quantized as round(x / input_scale)  |

and config.json's quantization_config = {"quant_method": "compressed-tensors", "format": "int-quantized",
"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": true,
"strategy": "channel", "dynamic": false}, "input_activations": {"num_bits": 8, "type": "int", "symmetric": true,
"strategy": "token", "dynamic": true} (or "strategy": "tensor", "dynamic": false with input_scale tensors, or null
for weights only)}}, "ignore": ["lm_head"]}. Layers without a weight_scale (the LM head, "ignore") are float weights.

Run on loom's packed q8g layout with one group per row (loom/quant/methods.py): the scales become float16 (a bfloat16
scale converts exactly when above 2^-14; a float32 one rounds to 11 significant bits, as GGUF's scales are stored; a
layer with a scale outside float16's normal range, or an input size that is not a multiple of 32, runs dense);
activations are int8 per token (dynamic) or with the file's scale (static: the largest of a stacked layer's q/k/v
or gate/up scales, as vLLM does, clamped to -127..127 where the format allows -128); one exact int8 GEMM at every
row count where the CPU has one (loom/quant/methods.py int8_gemm_is_exact), else loom's per-block kernel. Weights-only checkpoints run with loom's int16 activation codes, as w8a16.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loom.quant.config import AlreadyQuantizedError
from loom.quant.layout import PackedWeight


@dataclass(frozen=True, slots=True)
class Int8Checkpoint:
    quantized: frozenset[str]  # module names with a weight_scale
    activations: str  # "dynamic" (int8 per token), "static" (int8 with the file's input_scale) or "none"


def read_int8_checkpoint(qc: dict[str, Any], tensor_names: set[str]) -> Int8Checkpoint:
    """Validate a compressed-tensors "int-quantized" quantization_config as an int8 checkpoint loom can run.

    Raises:
        ValueError: not 8-bit symmetric integer weights per channel or per tensor, activations other than 8-bit
            symmetric per token (dynamic) or per tensor (static), more than one config group, no weight_scale
            tensor, or static activations without input_scale tensors; each names the field.
    """
    from loom.quant.fp8_checkpoint import scaled_modules, single_config_group

    group = single_config_group(qc)
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_config.quantization_status {qc.get('quantization_status')!r}: loom reads "
                         "'compressed' checkpoints (int8 codes with their scales)")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError("quantization_config.kv_cache_scheme: loom does not read a quantized KV cache scheme from "
                         "a checkpoint (use --kv-cache-dtype)")
    if group.get("output_activations") is not None:
        raise ValueError("quantization_config.config_groups: output_activations must be null for loom")
    if group.get("targets", ["Linear"]) != ["Linear"]:
        raise ValueError(f"quantization_config.config_groups: targets {group.get('targets')!r}: loom reads groups "
                         "that target ['Linear'] (which layers are int8 follows their weight_scale tensors)")
    weights = group.get("weights")
    if (not isinstance(weights, dict) or weights.get("num_bits") != 8 or weights.get("type") != "int"
            or weights.get("symmetric") is False):
        raise ValueError("quantization_config.config_groups: weights must be num_bits 8, type 'int', symmetric")
    quantized = scaled_modules(weights, tensor_names, "int8")
    acts = group.get("input_activations")
    if not acts:
        return Int8Checkpoint(quantized, "none")
    if acts.get("num_bits") != 8 or acts.get("type") != "int" or acts.get("symmetric") is False:
        raise ValueError("quantization_config.config_groups: input_activations must be num_bits 8, type 'int', "
                         "symmetric")
    if acts.get("dynamic") and acts.get("strategy") == "token":
        return Int8Checkpoint(quantized, "dynamic")
    if not acts.get("dynamic") and acts.get("strategy") == "tensor":
        missing = sorted(m for m in quantized if f"{m}.input_scale" not in tensor_names)
        if missing:
            raise ValueError(f"static int8 activations need an input_scale for every quantized layer; missing for "
                             f"{missing[:4]}")
        return Int8Checkpoint(quantized, "static")
    raise ValueError(f"quantization_config.config_groups: input_activations strategy {acts.get('strategy')!r} "
                     f"with dynamic={acts.get('dynamic')!r}: loom runs 'token' dynamic or 'tensor' static")


def iter_int8_weights(weights: Iterator[tuple[str, torch.Tensor]],
                      checkpoint: Int8Checkpoint) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized projection's int8 `weight` and its `weight_scale` joined into
    one PackedWeight (q8g, one group per row, float16 scales) under the weight's name; input_scale and the other
    tensors pass through.

    Raises:
        ValueError: a weight that is not int8 [N, K], a scale that is neither [N, 1] / [N] nor one value, or a
            weight without its scale (or the reverse).
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if module not in checkpoint.quantized or kind not in ("weight", "weight_scale"):
            if tensor.dtype == torch.int8 or (kind == "input_scale" and module not in checkpoint.quantized):
                # int8 codes without a scale would load as float weights
                raise ValueError(f"int8 checkpoint: {name} belongs to a layer without {module}.weight_scale")
            if kind == "input_scale" and not (bool(torch.isfinite(tensor).all()) and bool((tensor > 0).all())):
                raise ValueError(f"int8 checkpoint: {name} must be a finite positive number")
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[kind] = tensor
        if len(parts) == 2:
            del pending[module]
            yield f"{module}.weight", _packed(module, parts["weight"], parts["weight_scale"])
    if pending:
        raise ValueError(f"int8 checkpoint: {sorted(pending)[:4]} lack a weight or a weight_scale")


def _packed(module: str, weight: torch.Tensor, scale: torch.Tensor) -> PackedWeight | torch.Tensor:
    """The packed weight of one projection, or its float32 values codes x scale where the packed layout cannot hold
    it exactly enough: K not a multiple of 32, or a scale outside float16's normal range [2^-14, 65504] (a float16
    scale would lose bits or flush to zero); such a layer runs dense."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"{module}.weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(n)
    elif scale.numel() != n:
        raise ValueError(f"{module}.weight_scale has {scale.numel()} values for {n} output channels")
    scale = scale.float().reshape(n, 1)
    if not (bool(torch.isfinite(scale).all()) and bool((scale >= 0).all())):
        raise ValueError(f"{module}.weight_scale must hold finite non-negative numbers")
    if k % 32 or bool(((scale < 2.0**-14) | (scale > 65504)).any()):
        return weight.float() * scale
    return PackedWeight("q8g", weight.contiguous(), scale.half().contiguous(), None, k)


class Int8CheckpointConfig:
    """Each linear layer whose projections carry a weight_scale runs packed (q8g, one group per row) with the file's
    codes: int8 activations for a W8A8 checkpoint (name "w8a8"), int16 activation codes for weights only ("w8a16");
    the others (the LM head) stay dense in the model dtype."""

    keeps_gguf_packed = False
    float32_kernels = True

    def __init__(self, checkpoint: Int8Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.name = "w8a16" if checkpoint.activations == "none" else "w8a8"

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from loom.model.layers.linear import default_linear_method
        from loom.quant.config import quantized_shards
        from loom.quant.methods import PackedLinearMethod

        if quantized_shards(prefix, self.checkpoint.quantized, "int8 weight scales") is not None:
            scheme = {"dynamic": "int8_dynamic", "static": "int8_static", "none": "int8_weight_only"}
            return PackedLinearMethod(scheme[self.checkpoint.activations], "compressed-tensors")
        return default_linear_method(layer.dtype, getattr(layer, "device", torch.device("cpu")),
                                     self.float32_kernels)

    def embedding_packed(self) -> bool:
        return False


def int8_quant_config(name: str | None, qc: dict[str, Any], tensor_names: set[str]) -> Int8CheckpointConfig:
    """The quantization config of a compressed-tensors int8 checkpoint for `--quantization name` (None, or the
    checkpoint's own: "w8a8" with int8 activations, "w8a16" without).

    Raises:
        ValueError: another method (AlreadyQuantizedError: the weights are already int8), or a config
            read_int8_checkpoint refuses.
    """
    config = Int8CheckpointConfig(read_int8_checkpoint(qc, tensor_names))
    if name not in (None, config.name):
        raise AlreadyQuantizedError(f"quantization={name!r} cannot run this int8 compressed-tensors checkpoint, "
                                    f"whose weights are already quantized; use {config.name!r} (the default for it)")
    return config


def int8_quantization_config(activations: str) -> dict[str, Any]:
    """The quantization_config `loom quantize --method w8a8` writes: int8 weights per channel, activations int8
    per token ("dynamic") or per tensor with calibrated input_scale tensors ("static")."""
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token" if activations == "dynamic"
            else "tensor", "dynamic": activations == "dynamic"}
    from loom.quant.fp8_checkpoint import compressed_tensors_quantization_config

    return compressed_tensors_quantization_config("int", acts)


def write_int8_checkpoint(model: str | None, output: str, windows: list[list[int]], *, alpha: float | str = 0.5,
                          activations: str = "dynamic", calibration: str = "",
                          weight_rounding: str = "rtn") -> dict[str, Any]:
    """SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) then int8 per output channel (round to nearest, or GPTQ
    with weight_rounding "gptq": llm-compressor's SmoothQuant + GPTQ W8A8 recipe, loom/quant/gptq_w8a8.py),
    written to `output` as a compressed-tensors W8A8 checkpoint (module docstring; vLLM's and loom's format).
    Calibrate on `windows` (token ids): the per-channel input maxima give the smoothing scales (alpha, or
    "search" per layer against this grid, without loom's run-time rotation, which the format has no place for);
    with activations "static" the same tokens through the smoothed model give each projection's input_scale, max|x| / 127.

    Returns:
        {"output", "seconds", "quantization_config", "calibration_tokens", "bits_per_weight"}.

    Raises:
        ValueError: activations not "dynamic" / "static", bad alpha, no calibration window, an architecture
            without a smoothing map, or an output that exists and is not an empty directory.
    """
    import time

    from loom.attention.backend import default_attention_backend, get_attention_backend
    from loom.model.registry import get_model_class
    from loom.quant.gptq_checkpoint import LINEAR_NAMES, PROJECTIONS
    from loom.quant.quantize import _check_alpha, _check_output, smoothed_source, write_checkpoint
    from loom.quant.rtn import quantize_q8
    from loom.quant.smoothquant import collect_input_absmax

    if activations not in ("dynamic", "static"):
        raise ValueError(f"activations must be 'dynamic' or 'static', got {activations!r}")
    _check_alpha(alpha)
    out = _check_output(output)
    start = time.perf_counter()
    loaded, _, smoothed, config = smoothed_source(model, windows, alpha, "w8a8", calibration, rotated=False)
    arch = loaded.arch
    input_scale: dict[str, float] = {}
    if activations == "static":  # the smoothed model's own input maxima, one per loom layer
        cpu = torch.device("cpu")
        net = get_model_class(arch.architecture)(arch, get_attention_backend(default_attention_backend(cpu)),
                                                 torch.float32, cpu)
        net.load_weights((k, v.float()) for k, v in smoothed.items())
        for name, amax in collect_input_absmax(net.eval(), arch, windows).items():
            head, _, kind = name.rpartition(".")
            for proj in PROJECTIONS[kind]:
                input_scale[f"{head}.{proj}"] = max(float(amax.max()), 1e-12) / 127
    gptq = {}
    if weight_rounding == "gptq":
        from loom.quant.gptq_w8a8 import gptq_w8a8_weights

        gptq = gptq_w8a8_weights(arch, smoothed, windows, rotated=False)
    tensors: dict[str, torch.Tensor] = {}
    bits = count = 0
    for name, t in smoothed.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.startswith("model.layers.") and module.rpartition(".")[2] in LINEAR_NAMES:
            if module in gptq:
                codes, scales = gptq[module]
            else:
                packed = quantize_q8(t, t.shape[1])  # one float16 scale per row: loom reads the file's own
                codes, scales = packed.qweight, packed.scales
            scale = scales.float().reshape(-1, 1)
            tensors[name], tensors[f"{module}.weight_scale"] = codes.contiguous(), scale
            if activations == "static":
                tensors[f"{module}.input_scale"] = torch.tensor([input_scale[module]], dtype=torch.float32)
            bits += 8 * t.numel() + 32 * scale.numel()
            count += t.numel()
        else:
            tensors[name] = t.float().contiguous()
    config["quantization_config"] = int8_quantization_config(activations)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, tensors, config, loaded.tokenizer)
    return {"output": out, "seconds": time.perf_counter() - start, "quantization_config": config["quantization_config"],
            "calibration_tokens": sum(len(w) for w in windows), "bits_per_weight": bits / count if count else 0.0}


__all__ = ["Int8Checkpoint", "Int8CheckpointConfig", "int8_quant_config", "int8_quantization_config",
           "iter_int8_weights", "read_int8_checkpoint", "write_int8_checkpoint"]
