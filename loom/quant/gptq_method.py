"""Hugging Face GPTQ checkpoints run on loom's packed kernels: the config (`quantization_config.quant_method ==
"gptq"` in config.json) and the linear method that turns each layer's qweight / qzeros / scales / g_idx into
loom's layouts (loom/quant/gptq_format.py: 4-bit -> q4g, 8-bit -> q8g, desc_act -> an input permutation).

Per-module precision follows GPTQModel's `dynamic` key of quantization_config (the form vLLM also reads): an
ordered map from a regular expression over module names to overrides; the first pattern that matches a module
(`re.match`) decides. A "-:" pattern leaves the module unquantized (its plain `weight` is in the file); a "+:"
pattern (or one without a prefix) overrides the base settings for it, e.g.
`{"+:model\\.layers\\.0\\.mlp\\.down_proj": {"bits": 8}}`. Of the overrides loom reads `bits` (group size is
implicit in g_idx); the others describe how the file was made.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.model.layers.linear import Linear, LinearMethod, default_linear_method
from loom.quant.gptq import BITS
from loom.quant.gptq_format import FORMATS, from_checkpoint, to_loom
from loom.quant.methods import PackedLinearMethod

logger = logging.getLogger(__name__)

GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True, slots=True)
class GPTQCheckpoint:
    """What loading needs from a GPTQ checkpoint's quantization_config."""

    bits: int  # 4 or 8: the base settings
    checkpoint_format: str  # "gptq" (v1: qzeros hold zero - 1) or "gptq_v2"
    quantized: frozenset[str]  # layer names with a qweight ("model.layers.0.self_attn.q_proj", ...)
    # quantization_config.dynamic in file order: (negative, compiled pattern, overrides)
    dynamic: tuple[tuple[bool, re.Pattern, dict[str, Any]], ...] = field(default=())

    def bits_of(self, name: str) -> int | None:
        """Bits of module `name` ("model.layers.0.mlp.down_proj"): the first matching `dynamic` pattern's
        override, else the base bits; None when a negative pattern leaves it unquantized."""
        for negative, pattern, overrides in self.dynamic:
            if pattern.match(name):
                return None if negative else int(overrides.get("bits", self.bits))
        return self.bits


def read_gptq_checkpoint(quantization_config: dict[str, Any], tensor_names: set[str]) -> GPTQCheckpoint:
    """Validate config.json's quantization_config for a GPTQ checkpoint.

    Raises:
        ValueError: quant_method is not "gptq", bits not 4 or 8, an unknown checkpoint_format, or no qweight.
    """
    if quantization_config.get("quant_method") != "gptq":
        raise ValueError(f"quantization_config.quant_method must be 'gptq', got "
                         f"{quantization_config.get('quant_method')!r}")
    bits = quantization_config.get("bits")
    if bits not in BITS:
        raise ValueError(f"quantization_config.bits must be one of {BITS} for loom's kernels, got {bits!r}")
    # "checkpoint_format" (AutoGPTQ, older transformers) wins over "format" (transformers 5, GPTQModel), as
    # transformers reads them
    fmt = quantization_config.get("checkpoint_format") or quantization_config.get("format") or "gptq"
    if fmt not in FORMATS:
        raise ValueError(f"quantization_config.checkpoint_format must be one of {FORMATS}, got {fmt!r}")
    quantized = frozenset(name.removesuffix(".qweight") for name in tensor_names if name.endswith(".qweight"))
    if not quantized:
        raise ValueError("a GPTQ checkpoint (quantization_config.quant_method 'gptq') without any qweight tensor")
    return GPTQCheckpoint(int(bits), fmt, quantized, read_dynamic(quantization_config.get("dynamic")))


def read_dynamic(dynamic: Any) -> tuple[tuple[bool, re.Pattern, dict[str, Any]], ...]:
    """quantization_config.dynamic (module docstring) as (negative, pattern, overrides) in order.

    Raises:
        ValueError: not a JSON object of objects, a pattern that is not a valid regular expression, or a bits
            override loom has no kernel for; each names quantization_config.dynamic and the pattern.
    """
    if dynamic is None:
        return ()
    if not isinstance(dynamic, dict):
        raise ValueError(f"quantization_config.dynamic must be an object of pattern -> overrides, got "
                         f"{type(dynamic).__name__}")
    rules = []
    for key, overrides in dynamic.items():
        if not isinstance(overrides, dict):
            raise ValueError(f"quantization_config.dynamic[{key!r}] must be an object of overrides, got "
                             f"{type(overrides).__name__}")
        negative = key.startswith("-:")
        source = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            pattern = re.compile(source)
        except re.error as exc:
            raise ValueError(f"quantization_config.dynamic[{key!r}] is not a regular expression: {exc}") from None
        if not negative and "bits" in overrides and overrides["bits"] not in BITS:
            raise ValueError(f"quantization_config.dynamic[{key!r}].bits must be one of {BITS} for loom's "
                             f"kernels, got {overrides['bits']!r}")
        rules.append((negative, pattern, dict(overrides)))
    return tuple(rules)


class GPTQConfig:
    """Each linear layer whose projections the checkpoint stores as GPTQ tensors runs packed; others (the LM
    head, unless the checkpoint quantized it) stay dense in the model dtype."""

    name = "gptq"
    keeps_gguf_packed = False
    float32_kernels = True

    def __init__(self, checkpoint: GPTQCheckpoint) -> None:
        self.checkpoint = checkpoint

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        from loom.quant.config import quantized_shards

        names = quantized_shards(prefix, self.checkpoint.quantized, "quantized tensors")
        if names is not None:
            bits = {self.checkpoint.bits_of(n) for n in names}
            if None in bits:
                raise ValueError(f"{prefix}: quantization_config.dynamic leaves {names} unquantized, but the "
                                 "checkpoint holds their qweight")
            if len(bits) > 1:
                raise ValueError(f"{prefix}: quantization_config.dynamic gives {names} different bits "
                                 f"{sorted(bits)}; loom runs them as one matrix")
            return GPTQLinearMethod(self.checkpoint, bits.pop())
        return default_linear_method(layer.dtype, getattr(layer, "device", torch.device("cpu")),
                                     self.float32_kernels)

    def embedding_packed(self) -> bool:
        return False


class GPTQLinearMethod(PackedLinearMethod):
    """A GPTQ layer: its tensors are gathered per shard while loading, then repacked into loom's layouts.

    Stacked shards (q/k/v, gate/up) must share one input permutation to run packed; GPTQ's act-order gives
    them one (their Hessian is the same), and shards that differ (or whose groups do not fall on blocks of
    32) make the layer run dense on the file's dequantized values instead."""

    def __init__(self, checkpoint: GPTQCheckpoint, bits: int | None = None) -> None:
        self.bits = checkpoint.bits if bits is None else bits
        super().__init__("gptq", f"GPTQ {self.bits}-bit")
        self.checkpoint = checkpoint

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        super().create_weights(layer, input_size, output_sizes, bias, dtype, device)
        del layer.weight_loaders["weight"]
        layer.gptq_parts = [{} for _ in output_sizes]  # per shard: tensor name -> checkpoint tensor
        for name in GPTQ_TENSORS:
            layer.weight_loaders[name] = lambda t, shard, name=name: self._store(layer, name, t, shard)

    @staticmethod
    def _store(layer: Linear, name: str, tensor: Any, shard: int | None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"a GPTQ {name} must be a tensor, got {type(tensor).__name__}")
        layer.gptq_parts[0 if shard is None else shard][name] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        converted = []
        for index, parts in enumerate(layer.gptq_parts):
            qweight = parts.get("qweight")
            if qweight is not None and qweight.dim() == 2 and qweight.shape[0] * 32 != layer.input_size * self.bits:
                raise ValueError(f"{layer.prefix}: qweight has {qweight.shape[0]} rows, {layer.input_size} inputs "
                                 f"at {self.bits} bits need {layer.input_size * self.bits // 32} (check "
                                 "quantization_config.bits and dynamic)")
            try:
                weight = from_checkpoint(parts, self.bits, self.checkpoint.checkpoint_format)
            except ValueError as exc:
                raise ValueError(f"{layer.prefix}: {exc}") from None
            rows = layer.output_sizes[index]
            if tuple(weight.codes.shape) != (rows, layer.input_size):
                raise ValueError(f"{layer.prefix}: GPTQ weight [{weight.codes.shape[0]}, {weight.codes.shape[1]}] "
                                 f"!= parameter shape ({rows}, {layer.input_size})")
            converted.append(to_loom(weight))
        layer.gptq_parts = []
        perms = [c.input_perm for c in converted]
        same_perm = all((p is None and perms[0] is None) or (p is not None and perms[0] is not None
                                                              and torch.equal(p, perms[0])) for p in perms)
        if all(c.packed is not None for c in converted) and same_perm:
            layer.packed_shards = [c.packed for c in converted]
            layer.input_perm = perms[0]
        else:
            logger.info("%s runs dense: its GPTQ groups do not fall on blocks of 32 or its shards' act-order "
                        "permutations differ", layer.prefix)
            layer.packed_shards = [c.dense if c.packed is None else _dense_of(c) for c in converted]
        super().process_weights_after_loading(layer)


def _dense_of(converted: Any) -> torch.Tensor:
    """The [N, K] float32 matrix of a packed LoomGPTQ, columns back in the checkpoint's order."""
    from loom.quant.layout import dequantize

    dense = dequantize(converted.packed)
    if converted.input_perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, converted.input_perm] = dense
    return out
