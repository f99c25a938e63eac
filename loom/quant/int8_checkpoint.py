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
scale converts exactly when above 2^-14; a float32 one rounds to 11 significant bits, as GGUF's scales are stored);
activations are int8 per token (dynamic) or with the file's scale (static: the largest of a stacked layer's q/k/v
or gate/up scales, as vLLM does, clamped to -127..127 where the format allows -128); above 8 rows one exact int8
GEMM. Weights-only checkpoints run with loom's int16 activation codes, as w8a16.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

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
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config.config_groups must hold exactly one group for loom")
    group = next(iter(groups.values()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if (not isinstance(weights, dict) or weights.get("num_bits") != 8 or weights.get("type") != "int"
            or weights.get("symmetric") is False):
        raise ValueError("quantization_config.config_groups: weights must be num_bits 8, type 'int', symmetric")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"quantization_config.config_groups: weights.strategy {weights.get('strategy')!r}: loom "
                         "reads 'channel' or 'tensor' int8 scales")
    quantized = frozenset(n.removesuffix(".weight_scale") for n in tensor_names if n.endswith(".weight_scale"))
    if not quantized:
        raise ValueError("a compressed-tensors int8 checkpoint without any weight_scale tensor")
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
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[kind] = tensor
        if len(parts) == 2:
            del pending[module]
            yield f"{module}.weight", _packed(module, parts["weight"], parts["weight_scale"])
    if pending:
        raise ValueError(f"int8 checkpoint: {sorted(pending)[:4]} lack a weight or a weight_scale")


def _packed(module: str, weight: torch.Tensor, scale: torch.Tensor) -> PackedWeight:
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"{module}.weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(n)
    elif scale.numel() != n:
        raise ValueError(f"{module}.weight_scale has {scale.numel()} values for {n} output channels")
    return PackedWeight("q8g", weight.contiguous(), scale.float().reshape(n, 1).half().contiguous(), None, k)


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
        return default_linear_method(layer.dtype, getattr(layer, "device", torch.device("cpu")))

    def embedding_packed(self) -> bool:
        return False


def int8_quant_config(name: str | None, qc: dict[str, Any], tensor_names: set[str]) -> Int8CheckpointConfig:
    """The quantization config of a compressed-tensors int8 checkpoint for `--quantization name` (None, or the
    checkpoint's own: "w8a8" with int8 activations, "w8a16" without).

    Raises:
        ValueError: another method (the weights are already int8), or a config read_int8_checkpoint refuses.
    """
    config = Int8CheckpointConfig(read_int8_checkpoint(qc, tensor_names))
    if name not in (None, config.name):
        raise ValueError(f"quantization={name!r} cannot run this int8 compressed-tensors checkpoint, whose weights "
                         f"are already quantized; use {config.name!r} (the default for it)")
    return config


__all__ = ["Int8Checkpoint", "Int8CheckpointConfig", "int8_quant_config", "iter_int8_weights",
           "read_int8_checkpoint"]
