"""FP8 (e4m3) weight checkpoints with a scale per output channel, in the compressed-tensors layout
(`loom quantize --method fp8` writes them; loom loads them, and checkpoints of the same form from elsewhere).

The format (compressed-tensors "float-quantized", as llm-compressor writes FP8 weight-only and FP8-dynamic
models and vLLM reads them):

| tensor         | dtype          | shape   | content                                                 |
|----------------|----------------|---------|---------------------------------------------------------|
| P.weight       | float8_e4m3fn  | [N, K]  | round(W / scale) on the e4m3 grid (OCP FP8 spec)         |
| P.weight_scale | float32        | [N, 1]  | max |W[n, :]| / 448 (strategy "channel"), or [1] ("tensor") |

and config.json's quantization_config = {"quant_method": "compressed-tensors", "format": "float-quantized",
"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy":
"channel", "symmetric": true, "dynamic": false}, "input_activations": null}}, "ignore": ["lm_head"]}.
Layers without a weight_scale (the LM head, "ignore") are plain float weights.

Run on loom's `fp8` method (loom/quant/methods.py Fp8LinearMethod): the fp8 values stay fp8 on a GPU and, under
float32 activations, on a CPU (loom's gemv_fp8 kernel); under bfloat16 activations on a CPU, or without loom's
kernels, they are dequantized once at load. A checkpoint whose config asks for fp8
activations (input_activations dynamic) runs weight-only: loom's fp8 method keeps activations in the model dtype.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)



def fp8_quantization_config() -> dict[str, Any]:
    """The quantization_config `loom quantize --method fp8` writes (module docstring)."""
    return compressed_tensors_quantization_config("float", None)


def compressed_tensors_quantization_config(weight_type: str, input_activations: dict[str, Any] | None) -> dict[str, Any]:
    """The compressed-tensors quantization_config `loom quantize` writes: one group over every Linear but the LM head,
    8-bit weights of `weight_type` ("float": FP8 e4m3, "int": INT8) with one scale per output channel, and
    `input_activations` (None: weights only)."""
    return {
        "quant_method": "compressed-tensors", "format": f"{weight_type}-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": weight_type, "strategy": "channel", "symmetric": True,
                        "dynamic": False},
            "input_activations": input_activations, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None,
    }


def compressed_tensors_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config when it is a compressed-tensors one, else None."""
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors" else None


def single_config_group(qc: dict[str, Any]) -> dict[str, Any]:
    """The one config group of a compressed-tensors quantization_config (FP8 and INT8 readers).

    Raises:
        ValueError: config_groups is not a mapping of exactly one group.
    """
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config.config_groups must hold exactly one group for loom")
    group = next(iter(groups.values()))
    return group if isinstance(group, dict) else {}


def scaled_modules(weights: dict[str, Any], tensor_names: set[str], label: str) -> frozenset[str]:
    """The modules a compressed-tensors checkpoint quantized (those with a weight_scale tensor), after checking
    that its weight scales are per channel or per tensor; `label` ("FP8", "int8") names the format in errors.

    Raises:
        ValueError: another weights.strategy, or no weight_scale tensor at all.
    """
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"quantization_config.config_groups: weights.strategy {weights.get('strategy')!r}: loom "
                         f"reads 'channel' or 'tensor' {label} scales")
    quantized = frozenset(n.removesuffix(".weight_scale") for n in tensor_names if n.endswith(".weight_scale"))
    if not quantized:
        raise ValueError(f"a compressed-tensors {label} checkpoint without any weight_scale tensor")
    return quantized


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    quantized: frozenset[str]  # module names with a weight_scale
    activations: str  # "none" or "dynamic fp8 (run as weight-only)"


def read_fp8_checkpoint(qc: dict[str, Any], tensor_names: set[str]) -> Fp8Checkpoint:
    """Validate a compressed-tensors quantization_config as FP8 weights loom can run.

    Raises:
        ValueError: a format other than float-quantized, weights that are not 8-bit floats per channel or per
            tensor, more than one config group, or no weight_scale tensor; each names the field.
    """
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format {fmt!r}: loom runs compressed-tensors 'float-quantized' "
                         "(FP8) and 'int-quantized' (INT8, loom/quant/int8_checkpoint.py) checkpoints only")
    group = single_config_group(qc)
    weights = group.get("weights")
    if not isinstance(weights, dict) or weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError("quantization_config.config_groups: weights must be num_bits 8, type 'float' (FP8)")
    quantized = scaled_modules(weights, tensor_names, "FP8")
    acts = group.get("input_activations")
    return Fp8Checkpoint(quantized, "none" if not acts else "dynamic fp8 (run as weight-only)")


@dataclass(slots=True)
class Fp8Result:
    output: Path
    seconds: float
    quantization_config: dict[str, Any]
    bits_per_weight: float  # stored bits per weight of the decoder's linear layers (8 + 32 / K)


def write_fp8_checkpoint(model: str | None, output: str) -> Fp8Result:
    """Quantize every decoder linear weight of `model` (GGUF file, HF directory, None = the bundled model) to
    e4m3 with a float32 scale per output channel (loom.quant.rtn.quantize_fp8_e4m3) and write the
    compressed-tensors checkpoint to `output`; the rest (embeddings, norms, LM head, biases) in float32.

    Raises:
        ValueError: an output directory that exists and is not empty, or an architecture loom cannot write a
            config for.
    """
    from loom.model.loader import load_tokenizer
    from loom.model.loader.model_loader import read_arch, resolve_model_path
    from loom.quant.gptq_checkpoint import LINEAR_NAMES
    from loom.quant.quantize import MODEL_TYPES, _check_output, source_checkpoint, write_checkpoint
    from loom.quant.rtn import quantize_fp8_e4m3

    out = _check_output(output)
    start = time.perf_counter()
    path = resolve_model_path(model)
    arch = read_arch(model)
    if arch.architecture not in MODEL_TYPES:
        raise ValueError(f"fp8 cannot write a config for {arch.architecture}")
    eos: set[int] = set()
    if path.is_file():
        from loom.model.loader.gguf import gguf_eos_token_ids, open_gguf

        eos = set(gguf_eos_token_ids(open_gguf(path)))
    source, config = source_checkpoint(path, arch, eos)
    tensors: dict[str, torch.Tensor] = {}
    bits = weights = 0
    for name, t in source.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.startswith("model.layers.") and module.rpartition(".")[2] in LINEAR_NAMES:
            q, scale = quantize_fp8_e4m3(t)
            tensors[name] = q.contiguous()
            tensors[f"{module}.weight_scale"] = scale.contiguous()
            bits += 8 * t.numel() + 32 * scale.numel()
            weights += t.numel()
        else:
            tensors[name] = t.float().contiguous()
    config["quantization_config"] = fp8_quantization_config()
    write_checkpoint(out, tensors, config, load_tokenizer(model))
    seconds = time.perf_counter() - start
    logger.info("wrote %s in %.1f s", out, seconds)
    return Fp8Result(out, seconds, config["quantization_config"], bits / weights if weights else 0.0)


class Fp8CheckpointConfig:
    """Each linear layer whose projections carry a weight_scale runs on loom's fp8 method with the file's fp8
    values and scales; the others (the LM head) stay dense in the model dtype."""

    name = "fp8"
    keeps_gguf_packed = False
    float32_kernels = True

    def __init__(self, checkpoint: Fp8Checkpoint) -> None:
        self.checkpoint = checkpoint

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from loom.model.layers.linear import default_linear_method
        from loom.quant.config import quantized_shards
        from loom.quant.methods import Fp8LinearMethod

        if quantized_shards(prefix, self.checkpoint.quantized, "FP8 scales") is not None:
            return Fp8LinearMethod(checkpoint_scales=True)
        return default_linear_method(layer.dtype, getattr(layer, "device", torch.device("cpu")),
                                     self.float32_kernels)

    def embedding_packed(self) -> bool:
        return False


def fp8_quant_config(name: str | None, qc: dict[str, Any], tensor_names: set[str]) -> Fp8CheckpointConfig:
    """The quantization config of a compressed-tensors FP8 checkpoint for `--quantization name` (None or "fp8").

    Raises:
        ValueError: another method (the weights are already fp8), or a config read_fp8_checkpoint refuses.
    """
    if name not in (None, "fp8"):
        raise ValueError(f"quantization={name!r} cannot run an FP8 checkpoint, whose weights are already "
                         "quantized; use 'fp8' (the default for it)")
    checkpoint = read_fp8_checkpoint(qc, tensor_names)
    if checkpoint.activations != "none":
        logger.info("the checkpoint asks for %s activations; loom runs its fp8 weights with activations in the "
                    "model dtype", checkpoint.activations)
    return Fp8CheckpointConfig(checkpoint)
