"""Token embedding and the language-model head (which may share the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Lookup table: input_ids [num_tokens] int64 -> [num_tokens, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )  # [vocab_size, hidden_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits = hidden W^T with W [vocab_size, hidden_size]; `tied` reuses an embedding's matrix."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tied: VocabEmbedding | None,
    ) -> None:
        super().__init__()
        if tied is not None:
            self.weight = tied.weight  # shared Parameter, [vocab_size, hidden_size]
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
            )  # [vocab_size, hidden_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return F.linear(hidden, self.weight).float()
