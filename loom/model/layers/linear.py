"""Linear layers whose matmul is delegated to a quantization method, plus a row-merged variant."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.cpu import GEMV_MAX_ROWS, GemvBf16
from loom.kernels.registry import get_kernel


# Rows the oneDNN weight layout is tuned for: a decode batch. Any number of rows works with it.
_ONEDNN_PACK_ROWS = 32


class LinearMethod(Protocol):
    """How a Linear turns its stored parameters into y = x W^T + b (quantized formats plug in here)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, input_size] -> [num_tokens, output_size], dtype of x."""
        ...

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Derive whatever `apply` reads from the loaded `layer.weight` (repacking, quantizing)."""
        ...


class UnquantizedLinearMethod:
    """Dense weight [output_size, input_size] in the activation dtype."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass


class OneDNNPackedLinearMethod:
    """bfloat16 weight pre-packed once into oneDNN's blocked layout (CPU only), plus loom's GEMV for decode.

    F.linear reorders nothing but picks a generic kernel; the pre-packed weight lets oneDNN run its
    AVX512-BF16/AMX micro-kernel directly (measured 1.2x at 32 rows, 1.5-2.5x for one row on Zen 4;
    benchmarks/NOTES.md, "Fast CPU path"). Same arithmetic: outputs equal F.linear's bit for bit in tests.
    The dense `layer.weight` is kept (loading, tied embeddings).

    With `gemv` (loom/kernels/csrc/gemv_bf16.c), inputs of at most GEMV_MAX_ROWS rows (single-stream and
    small-batch decode, memory-bound on the weights) read the dense weight with that kernel instead, which
    streams it faster than oneDNN at one row (benchmarks/NOTES.md, "Third pass"). Its float32 sums run in
    another order than oneDNN's, so its bf16 outputs may differ from F.linear's by one bf16 rounding step.
    """

    def __init__(self, gemv: GemvBf16 | None = None) -> None:
        self.gemv = gemv  # small-row kernel, or None for oneDNN at every size

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return self.gemv(x, layer.weight, layer.bias)
        packed = layer.packed_weight
        if packed is None:  # not processed yet (e.g. called between construction and loading)
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed_weight = pack_onednn_weight(layer.weight)


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [output_size, input_size] bfloat16 on CPU -> opaque oneDNN tensor for _linear_pointwise."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ONEDNN_PACK_ROWS)


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when bfloat16 weights on this CPU can be pre-packed for oneDNN (native bf16 dot products)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def default_linear_method(dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """The fastest dense method for this dtype/device: oneDNN-packed bf16 (with loom's decode GEMV when it
    builds here) on CPU, else F.linear."""
    if onednn_packing_available(dtype, device):
        return OneDNNPackedLinearMethod(get_kernel("gemv_bf16"))
    return UnquantizedLinearMethod()


class Linear(nn.Module):
    """y = x W^T + b with W [output_size, input_size]; the matmul itself is `quant_method.apply`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype, device=device), requires_grad=False
        )  # [output_size, input_size]
        self.bias = (
            nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )  # [output_size] or None
        self.quant_method: LinearMethod = quant_method or default_linear_method(dtype, device)
        self.packed_weight: torch.Tensor | None = None  # method-specific copy of weight (e.g. oneDNN layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def process_weights_after_loading(self) -> None:
        """Let the method derive its own weight form once the checkpoint is loaded."""
        self.quant_method.process_weights_after_loading(self)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output rows (e.g. q|k|v, gate|up),
    so one matmul computes them all. Checkpoint tensors are loaded shard by shard.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype, device, quant_method)
        self.output_sizes = list(output_sizes)  # rows of each shard, in stacking order

    def shard_rows(self, shard: int) -> slice:
        """Rows of the stacked weight that hold shard number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool) -> None:
        """Copy a checkpoint weight [rows, input_size] (or bias [rows]) into shard `shard`.

        Raises:
            ValueError: the tensor's shape does not match the shard.
        """
        target = (self.bias if is_bias else self.weight)
        if target is None:
            raise ValueError("checkpoint has a bias for a projection built without one (attention_bias)")
        part = target.data[self.shard_rows(shard)]
        if part.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != shard shape {tuple(part.shape)}")
        part.copy_(tensor)
