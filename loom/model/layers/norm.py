"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        size = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused call; in float32 it rounds exactly like the three-step form below (tested bit for bit).
            return F.rms_norm(x, size, self.weight, self.eps)
        # Same rounding order as the HF reference: normalise in fp32, cast, then scale (F.rms_norm with the
        # weight would scale before the cast). The statistics run in one call instead of five.
        return self.weight * F.rms_norm(x.float(), size, None, self.eps).to(x.dtype)
