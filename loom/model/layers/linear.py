"""Linear layers whose matmul is delegated to a quantization method, plus a row-merged variant."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    """How a Linear turns its stored parameters into y = x W^T + b (quantized formats plug in here)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, input_size] -> [num_tokens, output_size], dtype of x."""
        ...


class UnquantizedLinearMethod:
    """Dense weight [output_size, input_size] in the activation dtype."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


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
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


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
