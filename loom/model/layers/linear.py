"""Linear layers whose parameters and matmul belong to a quantization method (loom/quant), plus the dense
methods: F.linear, and oneDNN-packed bfloat16 with loom's decode GEMV.

The seam follows vLLM's quant methods: the method creates the layer's parameters and their loaders
(`create_weights`), is chosen per layer by `QuantizationConfig.get_quant_method(layer, prefix)`, derives its
run-time form once the checkpoint is in (`process_weights_after_loading`) and runs the matmul (`apply`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.tensor_parallel import TensorParallel
from loom.kernels.cpu import GEMV_MAX_ROWS, GemvBf16
from loom.kernels.registry import get_kernel
from loom.quant.layout import PackedWeight

# Rows the oneDNN weight layout is tuned for: a decode batch. Any number of rows works with it.
_ONEDNN_PACK_ROWS = 32

# One parameter's loader: (checkpoint tensor or packed weight, shard index or None) -> None
WeightLoader = Callable[[Any, "int | None"], None]


class LinearMethod(Protocol):
    """How a Linear holds its weight and computes y = x W^T + b (quantized formats plug in here)."""

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's parameters and one loader per parameter name in `layer.weight_loaders`."""
        ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, input_size] -> [num_tokens, output_size], dtype of x."""
        ...

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Derive whatever `apply` reads from what was loaded (repacking, quantizing)."""
        ...

    def weight_format(self, layer: Linear) -> tuple[str, int]:
        """(format name, bytes a pass over the weight reads) for the start-up report and the roofline."""
        ...


class UnquantizedLinearMethod:
    """Dense weight [output_size, input_size] in the activation dtype, F.linear."""

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        rows = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(rows, input_size, dtype=dtype, device=device),
                                    requires_grad=False)  # [output_size, input_size]
        layer.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)  # [output_size] or None
        layer.weight_loaders["weight"] = lambda t, shard: copy_rows(layer, layer.weight, t, shard)
        if bias:
            layer.weight_loaders["bias"] = lambda t, shard: copy_rows(layer, layer.bias, t, shard)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def weight_format(self, layer: Linear) -> tuple[str, int]:
        return str(layer.weight.dtype).removeprefix("torch."), layer.weight.numel() * layer.weight.element_size()


class OneDNNPackedLinearMethod(UnquantizedLinearMethod):
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


# Rows of x up to which Float32GemvLinearMethod runs loom's GEMV: the 49152 x 576 LM head on a 2-core Zen 4, ms
# per call (gemv_f32 / F.linear): 1 row 4.0 / 10.1, 9 rows 10.4 / 20.6, 16 rows 16.2 / 21.1, 32 rows 27.5 / 28.6,
# 64 rows 47.9 / 35.5 (benchmarks/NOTES.md, "Where a step's time went that no kernel owned")
F32_GEMV_MAX_ROWS = 16


class Float32GemvLinearMethod(UnquantizedLinearMethod):
    """float32 weights, up to F32_GEMV_MAX_ROWS rows of x through loom's `gemv_f32` kernel (csrc/gemv_f32.c),
    above them F.linear. For the dense float32 layers of quantized models (a GPTQ, AWQ or compressed-tensors
    checkpoint's unquantized lm_head, an F16/F32 tensor of a GGUF file, RTN's layers of odd sizes), never for
    `--quantization none`: the oracle path keeps torch's F.linear, the kernel transformers runs. The kernel sums in
    its own fixed order (outputs within float32 rounding of F.linear's, not equal to them)."""

    def __init__(self, gemv: Any) -> None:
        self.gemv = gemv  # loom.kernels.cpu_generic.GemvF32

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= F32_GEMV_MAX_ROWS and x.dtype == torch.float32:  # (a float32 layer)
            return self.gemv(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when bfloat16 weights on this CPU can be pre-packed for oneDNN (native bf16 dot products)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def default_linear_method(dtype: torch.dtype, device: torch.device, float32_kernels: bool = False) -> LinearMethod:
    """The fastest dense method for this dtype/device: oneDNN-packed bf16 (with loom's decode GEMV when it
    builds here) on CPU; float32 on CPU with `float32_kernels` (a quantization config other than the oracle's
    `none`) loom's float32 GEMV for decode rows (Float32GemvLinearMethod); else F.linear."""
    if onednn_packing_available(dtype, device):
        return OneDNNPackedLinearMethod(get_kernel("gemv_bf16"))
    if float32_kernels and dtype == torch.float32 and device.type == "cpu":
        gemv = get_kernel("gemv_f32")
        if gemv is not None:
            return Float32GemvLinearMethod(gemv)
    return UnquantizedLinearMethod()


def copy_rows(layer: Linear, target: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
    """Copy a dense checkpoint tensor [rows, input_size] (or a bias [rows]) into `target`, all of it
    (shard None) or the rows of shard `shard` of a stacked layer.

    Raises:
        ValueError: a packed weight for a dense layer, or a shape that does not match.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"a dense layer got a {type(tensor).__name__} (expected a tensor)")
    part = target.data if shard is None else target.data[layer.shard_rows(shard)]
    if part.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != parameter shape {tuple(part.shape)}")
    part.copy_(tensor)


@dataclass(frozen=True, slots=True)
class LinearShard:
    """The part of a checkpoint matrix one tensor-parallel rank holds (loom/distributed/tensor_parallel.py).

    Column-parallel (`rows`): each stacked projection's range of checkpoint rows; the rank's outputs are its own.
    Row-parallel (`cols`): a range of the checkpoint's input columns; the rank's outputs are partial sums that
    `Linear.forward` all-reduces, and only rank 0 holds the bias, so the sum adds it once.
    """

    tp: TensorParallel
    rows: tuple[tuple[int, int], ...] | None = None  # per stacked projection: [start, stop) of its checkpoint rows
    cols: tuple[int, int] | None = None  # [start, stop) of the checkpoint's input columns
    reduce: bool = True  # row-parallel: all-reduce in forward (False: the caller sums later, e.g. once per MoE block)

    def slice(self, name: str, tensor: Any, shard: int | None) -> Any:
        """This rank's part of checkpoint parameter `name` ("weight" / "bias"; projection `shard` of a stack).

        Raises:
            ValueError: a tensor kind that does not split here (checkpoint-specific packed formats), or a split
                that does not fall on the packed layout's group boundaries.
        """
        if not isinstance(tensor, (torch.Tensor, PackedWeight)):
            raise ValueError(f"a {type(tensor).__name__} checkpoint tensor does not split for tensor parallelism")
        if self.rows is not None:
            start, stop = self.rows[shard or 0]
            return tensor.rows(slice(start, stop)) if isinstance(tensor, PackedWeight) else tensor[start:stop]
        assert self.cols is not None
        start, stop = self.cols
        if name == "bias":  # added once, after the sum
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        return tensor.cols(start, stop) if isinstance(tensor, PackedWeight) else tensor[:, start:stop].contiguous()


class Linear(nn.Module):
    """y = x W^T + b with W [output_size, input_size]; what is stored and how it is multiplied is the
    quant method's. Several projections of one input (q|k|v, gate|up) stack their rows (`output_sizes`),
    so one matmul computes them all; their checkpoint tensors are loaded shard by shard.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int | list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant_method: LinearMethod | None = None,
        *,
        quant_config: Any = None,
        prefix: str = "",
        shard: LinearShard | None = None,
    ) -> None:
        """quant_method: explicit method; else `quant_config.get_quant_method(self, prefix)` (a
        loom.quant.QuantizationConfig; prefix = the checkpoint name of the layer, e.g.
        "model.layers.0.self_attn.qkv_proj"); else the default dense method. shard: the rank's part under tensor
        parallelism (input_size / output_size are then the rank's), None = the whole matrix."""
        super().__init__()
        self.shard = shard
        sizes = list(output_size) if isinstance(output_size, list) else [output_size]
        self.input_size = input_size
        self.output_sizes = sizes  # rows of each shard, in stacking order
        self.output_size = sum(sizes)
        self.dtype = dtype  # activation dtype
        self.device = device
        self.weight_loaders: dict[str, WeightLoader] = {}  # parameter name -> loader, set by the method
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        self.packed_weight: torch.Tensor | None = None  # method-specific copy of weight (e.g. oneDNN layout)
        self.prefix = prefix
        if quant_method is None and quant_config is not None:
            quant_method = quant_config.get_quant_method(self, prefix)
        self.quant_method: LinearMethod = quant_method or default_linear_method(dtype, device)
        self.quant_method.create_weights(self, input_size, sizes, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        if self.shard is not None and self.shard.cols is not None and self.shard.reduce:  # row-parallel: add the
            # ranks' partial sums
            self.shard.tp.all_reduce(out)
        return out

    def shard_rows(self, shard: int) -> slice:
        """Rows of the stacked weight that hold shard number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load(self, name: str, tensor: Any, shard: int | None = None) -> None:
        """Load checkpoint parameter `name` ("weight" or "bias"), whole or one shard of a stacked layer.

        Raises:
            ValueError: the layer has no such parameter, or the tensor does not fit it.
        """
        loader = self.weight_loaders.get(name)
        if loader is None:
            raise ValueError(f"checkpoint has a {name} for a projection built without one (attention_bias)")
        loader(tensor if self.shard is None else self.shard.slice(name, tensor, shard), shard)

    def process_weights_after_loading(self) -> None:
        """Let the method derive its own weight form once the checkpoint is loaded."""
        self.quant_method.process_weights_after_loading(self)

    def weight_format(self) -> tuple[str, int]:
        """(format, bytes of one pass over the weight), from the method."""
        return self.quant_method.weight_format(self)


class MergedLinear(Linear):
    """A Linear over several stacked projections (kept as a name for readability at the call sites)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant_method: LinearMethod | None = None,
        *,
        quant_config: Any = None,
        prefix: str = "",
        shard: LinearShard | None = None,
    ) -> None:
        super().__init__(input_size, list(output_sizes), bias, dtype, device, quant_method,
                         quant_config=quant_config, prefix=prefix, shard=shard)
