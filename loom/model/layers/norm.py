"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics taken in float32.

    Input/output: [num_tokens, hidden_size], dtype of the input.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden_size]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Same rounding order as the HF reference: normalise in fp32, cast, then scale.
        return self.weight * x32.to(dtype)
