"""Quantization configs: which method each layer gets, chosen from config (`--quantization`), never from a
file name.

| name    | what runs                                                                                     |
|---------|-----------------------------------------------------------------------------------------------|
| none    | every weight dequantized at load to the model dtype: the oracle path (transformers parity)    |
| gguf    | a GGUF file's own quantized blocks, repacked exactly into loom's layouts (default for GGUF)   |
| bf16    | weights stored in bfloat16 (a bf16 checkpoint's own values), float32 activations and sums     |
| w8a16   | int8 weights (RTN groups of 32, each on the better of an asymmetric and a symmetric grid)     |
| w4a16   | 4-bit weights (RTN, asymmetric groups of 32), float activations                               |
| w8a8    | int8 weights (per channel) and int8 activations per token (dynamic), both Hadamard-rotated   |
| fp8     | float8 e4m3 weights, a float32 scale per channel                                              |
| gptq    | a Hugging Face GPTQ checkpoint's own 4/8-bit codes, repacked into q4g / q8g (gptq_method.py)   |

A config answers `get_quant_method(layer, prefix)` for each linear layer (the LM head included, prefix
"lm_head") and says whether the token embedding stays packed.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from loom.config import QUANTIZATION_METHODS
from loom.model.layers.linear import LinearMethod, default_linear_method

logger = logging.getLogger(__name__)

# stacked loom layer -> the checkpoint projections stacked into it, in order
class AlreadyQuantizedError(ValueError):
    """A checkpoint whose weights are already quantized (GPTQ, AWQ, int8 compressed-tensors) asked to run under
    another quantization method (`none` included: it has no float weights of its own)."""


STACKED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class QuantizationConfig(Protocol):
    """Chooses a LinearMethod per layer."""

    name: str
    keeps_gguf_packed: bool  # the GGUF loader hands over repacked blocks (PackedWeight) instead of floats
    float32_kernels: bool  # loom's C kernels may run float32 attention and fused ops (False: torch's, the oracle)

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        """The method for the Linear being built (`layer`: its sizes and dtype are set) named `prefix`."""
        ...

    def embedding_packed(self) -> bool:
        """Whether the token embedding keeps a packed weight (rows dequantized at lookup)."""
        ...


class NoQuantConfig:
    """Dense weights in the model dtype (today's path and the parity oracle)."""

    name = "none"
    keeps_gguf_packed = False
    float32_kernels = False  # the oracle path: float32 runs torch's own ops, as transformers does

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        return default_linear_method(layer.dtype, _device_of(layer))

    def embedding_packed(self) -> bool:
        return False


class GGUFConfig:
    """A GGUF file's own types: each layer whose shards the file stores in a repackable type runs packed."""

    name = "gguf"
    keeps_gguf_packed = True
    float32_kernels = True

    def __init__(self, tensor_types: dict[str, str]) -> None:
        self.tensor_types = tensor_types  # Hugging Face weight name -> GGML type name ("Q4_1", "F32", ...)

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        from loom.quant.gguf_repack import REPACKED_TYPES
        from loom.quant.methods import PackedLinearMethod

        types = [self.tensor_types.get(f"{name}.weight") for name in _shard_names(prefix)]
        if prefix == "lm_head" and types == [None]:  # tied: the head reads the embedding
            types = [self.tensor_types.get("model.embed_tokens.weight")]
        repacked = {t.name for t in REPACKED_TYPES}
        if types and all(t in repacked for t in types):
            return PackedLinearMethod("gguf", "GGUF " + "/".join(dict.fromkeys(types)))
        return default_linear_method(layer.dtype, _device_of(layer), self.float32_kernels)

    def embedding_packed(self) -> bool:
        from loom.quant.gguf_repack import REPACKED_TYPES

        return self.tensor_types.get("model.embed_tokens.weight") in {t.name for t in REPACKED_TYPES}


# The LM head of the lossier methods is kept at 8-bit weight-only (w8a16): GPTQ and AWQ checkpoints leave
# lm_head unquantized by default and llama.cpp's 4-bit files keep output.weight at Q6_K/Q8_0, because its
# errors reach the logits with no later layer to average them out. Measured on the bundled model, 8x512
# held-out tokens (benchmarks/BENCHMARKS.md, "Quality"): w4a16 top-1 agreement 78.9% with a 4-bit head.
LM_HEAD_SCHEME = {"w4a16": "w8a16", "w8a8": "w8a16", "fp8": "w8a16"}


class RTNConfig:
    """Quantize a dense checkpoint at load: every linear layer whose input size the layout takes (others
    stay dense, logged), and the LM head under `LM_HEAD_SCHEME`."""

    keeps_gguf_packed = False
    float32_kernels = True

    def __init__(self, name: str) -> None:
        self.name = name
        # how the packed weights came to be, for the start-up report: rounded to nearest here, or (a checkpoint
        # from `loom quantize --weight-rounding gptq`) values GPTQ already put on this grid
        self.source_label = "RTN"

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        from loom.quant.methods import Fp8LinearMethod, PackedLinearMethod

        name = LM_HEAD_SCHEME.get(self.name, self.name) if prefix == "lm_head" else self.name
        if name == "fp8":
            return Fp8LinearMethod()
        if layer.input_size % 32:
            logger.info("%s stays dense under %s: input size %d is not a multiple of 32", prefix, name,
                        layer.input_size)
            return default_linear_method(layer.dtype, _device_of(layer), self.float32_kernels)
        return PackedLinearMethod(name, "RTN" if prefix == "lm_head" else self.source_label)

    def embedding_packed(self) -> bool:
        return False


class Bf16Config:
    """Every linear layer (the LM head too) keeps bfloat16 weights; embeddings stay in the model dtype."""

    name = "bf16"
    keeps_gguf_packed = False
    float32_kernels = True

    def get_quant_method(self, layer: Any, prefix: str) -> LinearMethod:
        from loom.quant.methods import Bf16WeightMethod

        return Bf16WeightMethod(_device_of(layer))

    def embedding_packed(self) -> bool:
        return False


def get_quant_config(name: str | None, gguf_tensor_types: dict[str, str] | None,
                     gptq: Any = None) -> QuantizationConfig:
    """The config for `--quantization name` (None = auto: "gguf" for a GGUF file, "gptq" for a GPTQ
    checkpoint, else "none").

    gguf_tensor_types: Hugging Face weight name -> GGML type name of a GGUF file, None for other checkpoints.
    gptq: a GPTQ checkpoint's loom.quant.gptq_method.GPTQCheckpoint, None for other checkpoints.

    Raises:
        ValueError: unknown name, "gguf" for a checkpoint that is not a GGUF file, "gptq" for one that is not a
            GPTQ checkpoint; AlreadyQuantizedError (a ValueError): any other method for a GPTQ checkpoint.
    """
    if name is None:
        name = "gguf" if gguf_tensor_types is not None else "gptq" if gptq is not None else "none"
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {name!r}")
    if (name == "gptq") != (gptq is not None):
        if gptq is None:
            raise ValueError("quantization='gptq' needs a GPTQ checkpoint (quantization_config.quant_method 'gptq')")
        raise AlreadyQuantizedError(f"quantization={name!r} cannot run a GPTQ checkpoint, whose weights are already "
                                    "quantized; use 'gptq' (the default for it)")
    if name == "awq":  # an AWQ checkpoint's config comes from loom.quant.awq_method.awq_quant_config
        raise ValueError("quantization='awq' needs an AWQ checkpoint (quantization_config.quant_method 'awq')")
    if name == "gptq":
        from loom.quant.gptq_method import GPTQConfig

        return GPTQConfig(gptq)
    if name == "none":
        return NoQuantConfig()
    if name == "gguf":
        if gguf_tensor_types is None:
            raise ValueError("quantization='gguf' needs a GGUF file (this checkpoint is a Hugging Face directory)")
        return GGUFConfig(gguf_tensor_types)
    if name == "bf16":
        return Bf16Config()
    return RTNConfig(name)


def quantized_shards(prefix: str, quantized: frozenset[str], what: str) -> list[str] | None:
    """The checkpoint projection names behind loom layer `prefix` when the checkpoint holds `what` (its quantized
    tensors) for every one of them; None when for none (the layer stays dense).

    Raises:
        ValueError: it holds them for only some (stacked shards run as one matrix).
    """
    names = _shard_names(prefix)
    present = [n in quantized for n in names]
    if all(present):
        return names
    if any(present):
        raise ValueError(f"{prefix}: the checkpoint has {what} for only some of {names}")
    return None


def _shard_names(prefix: str) -> list[str]:
    """Checkpoint projection names behind a loom layer name (q/k/v behind qkv_proj)."""
    head, _, last = prefix.rpartition(".")
    if last in STACKED_SHARDS:
        return [f"{head}.{part}" for part in STACKED_SHARDS[last]]
    return [prefix]


def _device_of(layer: Any) -> torch.device:
    return getattr(layer, "device", torch.device("cpu"))
