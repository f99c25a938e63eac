"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics taken in float32.

    Input/output: [num_tokens, hidden_size], dtype of the input. With `residual`, x + residual is normalised
    and returned too (the pre-norm residual stream, as vLLM's fused add+norm): (y, x + residual).
    With `kernels` (bfloat16 on any x86 CPU loom's kernels build on, float32 off the oracle path), one C call
    replaces five ops (loom/kernels/csrc/fused_ops.c); bf16 may differ from the torch code by
    one rounding step, the AVX2 float32 build equals it bit for bit (tests/kernels/test_generic_kernels.py).
    """

    def __init__(self, hidden_size: int, eps: float, kernels: Any = None) -> None:
        """kernels: loom's fused ops (loom.kernels.registry.fused_kernels_for) or None for torch's."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden_size]
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None and x.dtype == self.weight.dtype:
            fused = self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)
            if fused is not None:
                out, total = fused
                return out if total is None else (out, total)
        if residual is not None:
            total = x + residual
            return self._norm(total), total
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        size = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused call; in float32 it rounds exactly like the three-step form below (tested bit for bit).
            return F.rms_norm(x, size, self.weight, self.eps)
        # Same rounding order as the HF reference: normalise in fp32, cast, then scale (F.rms_norm with the
        # weight would scale before the cast). The statistics run in one call instead of five.
        return self.weight * F.rms_norm(x.float(), size, None, self.eps).to(x.dtype)
