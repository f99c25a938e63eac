"""Token embedding and the language-model head (which may share the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.cpu import GEMV_MAX_ROWS, GemvBf16
from loom.kernels.registry import get_kernel
from loom.model.layers.linear import onednn_packing_available, pack_onednn_weight


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

        self.packed_weight: torch.Tensor | None = None  # oneDNN layout of weight, set after loading
        self.gemv: GemvBf16 | None = None  # loom's bf16 GEMV for <= GEMV_MAX_ROWS rows, set after loading

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 (the matmul runs in the weight dtype
        and is cast, as transformers does)."""
        if self.gemv is not None and hidden.dim() == 2 and hidden.shape[0] <= GEMV_MAX_ROWS:
            logits = self.gemv(hidden, self.weight)  # decode: loom's GEMV streams the dense matrix
        elif self.packed_weight is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, None, "none", [], "")
        else:
            logits = F.linear(hidden, self.weight)
        return logits.float()

    def process_weights_after_loading(self) -> None:
        """Pre-pack the (possibly shared) matrix for oneDNN when the CPU has native bf16; the largest
        matmul of a decode step (vocab x hidden), so packing it pays the most."""
        if onednn_packing_available(self.weight.dtype, self.weight.device):
            self.packed_weight = pack_onednn_weight(self.weight)
            self.gemv = get_kernel("gemv_bf16")
