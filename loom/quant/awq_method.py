"""AutoAWQ "gemm" checkpoints run on loom's packed kernels: the config (`quantization_config.quant_method ==
"awq"` in config.json) and the linear method that decodes each layer's qweight / qzeros / scales
(loom/quant/awq_format.py) and repacks them into q4g through the GPTQ path (loom/quant/gptq_format.py
to_loom: the file's codes and scales, min = -zero * scale in float16).
"""

from __future__ import annotations

from typing import Any

import torch

from loom.model.layers.linear import Linear
from loom.quant.awq_format import AWQ_TENSORS, check_quantization_config, from_checkpoint
from loom.quant.config import AlreadyQuantizedError
from loom.quant.gptq_format import to_checkpoint as to_gptq_v2
from loom.quant.gptq_method import GPTQCheckpoint, GPTQConfig, GPTQLinearMethod


def awq_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config when it is an AWQ one (quant_method "awq"), else None."""
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "awq" else None


def awq_quant_config(name: str | None, quantization_config: dict[str, Any], tensor_names: set[str]) -> "AWQConfig":
    """The quantization config of an AWQ checkpoint for `--quantization name` (None or "awq").

    Raises:
        ValueError: another method (AlreadyQuantizedError: the weights are already quantized), a
            quantization_config loom cannot run
            (awq_format.check_quantization_config), or no qweight tensor.
    """
    if name not in (None, "awq"):
        raise AlreadyQuantizedError(f"quantization={name!r} cannot run an AWQ checkpoint, whose weights are already "
                                    "quantized; use 'awq' (the default for it)")
    quantized = frozenset(n.removesuffix(".qweight") for n in tensor_names if n.endswith(".qweight"))
    if not quantized:
        raise ValueError("an AWQ checkpoint (quantization_config.quant_method 'awq') without any qweight tensor")
    return AWQConfig(GPTQCheckpoint(4, "gptq_v2", quantized), check_quantization_config(quantization_config))


class AWQConfig(GPTQConfig):
    """Each linear layer whose projections the checkpoint stores as AWQ tensors runs packed (q4g); the others
    (the LM head) stay dense in the model dtype."""

    name = "awq"

    def __init__(self, checkpoint: GPTQCheckpoint, group_size: int) -> None:
        super().__init__(checkpoint)
        self.group_size = group_size  # input columns per scale (quantization_config.group_size)

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        method = super().get_quant_method(layer, prefix)
        return AWQLinearMethod(self.checkpoint, self.group_size) if isinstance(method, GPTQLinearMethod) else method


class AWQLinearMethod(GPTQLinearMethod):
    """An AWQ layer: its qweight / qzeros / scales are gathered per shard while loading, decoded, and run as
    GPTQ's 4-bit layers are (one GPTQWeight per shard, contiguous groups, no input permutation)."""

    def __init__(self, checkpoint: GPTQCheckpoint, group_size: int) -> None:
        super().__init__(checkpoint)
        self.group_size = group_size
        self.source_label = "AWQ 4-bit (gemm)"

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        super().create_weights(layer, input_size, output_sizes, bias, dtype, device)
        for name in list(layer.weight_loaders):
            if name not in AWQ_TENSORS and name != "bias":  # AWQ has no g_idx
                del layer.weight_loaders[name]

    def process_weights_after_loading(self, layer: Linear) -> None:
        # AWQ tensors -> the GPTQWeight they encode -> GPTQ v2 tensors, which the parent repacks
        try:
            layer.gptq_parts = [to_gptq_v2(from_checkpoint(parts, self.group_size), "gptq_v2")
                                for parts in layer.gptq_parts]
        except ValueError as exc:
            raise ValueError(f"{layer.prefix}: {exc}") from None
        super().process_weights_after_loading(layer)
