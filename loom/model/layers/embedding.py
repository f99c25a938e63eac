"""Token embedding and the language-model head (which may share the embedding matrix)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.tensor_parallel import TensorParallel, partition, shard_range
from loom.model.layers.linear import Linear, LinearMethod, LinearShard
from loom.quant.layout import PackedWeight, dequantize


class VocabEmbedding(nn.Module):
    """Lookup table: input_ids [num_tokens] int64 -> [num_tokens, hidden_size] in the model dtype.

    The table is dense, or (`packed=True`, a GGUF model run from its own blocks) a PackedWeight whose looked-up
    rows are dequantized (loom/quant/layout.py), so the matrix is never held in float.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 packed: bool = False, tp: TensorParallel | None = None) -> None:
        """tp: vocab-parallel (Megatron-LM): this rank holds the rows [vocab_start, vocab_end) and looks up only
        the ids there; an all-reduce adds the ranks' rows (exactly one is nonzero per token)."""
        super().__init__()
        self.dtype = dtype
        self.device = device
        self.shape = (vocab_size, hidden_size)  # of the checkpoint's table
        self.tp = tp
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp)
        self.weight: nn.Parameter | None = None
        if not packed:
            self.weight = nn.Parameter(
                torch.empty(self.vocab_end - self.vocab_start, hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )  # [vocab rows held here, hidden_size]
        self.packed: PackedWeight | None = None  # [vocab_size, hidden_size] in a loom layout, when packed
        # loom's C lookup of packed rows (CPU, float32 / bfloat16), set with a packed table
        self._dequantize_rows: Any = None

    def load(self, name: str, tensor: Any, shard: int | None = None) -> None:
        """Load the checkpoint table (a dense tensor, or a PackedWeight for a packed table).

        Raises:
            ValueError: wrong parameter name or shape.
        """
        shape = tuple(tensor.shape)
        if name != "weight" or shard is not None or shape != self.shape:
            raise ValueError(f"embedding {name} of shape {shape} does not fit the table {self.shape}")
        if self.tp is not None:
            rows = slice(self.vocab_start, self.vocab_end)
            tensor = tensor.rows(rows) if isinstance(tensor, PackedWeight) else tensor[rows]
        if self.weight is None:
            self.packed = tensor.to(self.device) if isinstance(tensor, PackedWeight) else None
            if self.packed is not None and torch.device(self.device).type == "cpu" \
                    and self.dtype in (torch.float32, torch.bfloat16):
                # bit for bit layout.dequantize of the looked-up rows, gathered and dequantized in one C call
                # instead of ~10 torch ops (one row of SmolLM2's interleaved Q8_0 table inside a decode step:
                # ~115 -> ~30 us on Zen 4; benchmarks/NOTES.md, "Issue 9 on the Zen 4: where a single-stream token
                # goes now")
                from loom.quant.methods import quant_kernels

                self._dequantize_rows = quant_kernels(self.device).dequantize_rows
            if self.packed is None:  # the file stores it in float after all
                self.weight = nn.Parameter(tensor.to(device=self.device, dtype=self.dtype), requires_grad=False)
        else:
            if isinstance(tensor, PackedWeight):
                tensor = dequantize(tensor)
            self.weight.data.copy_(tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        here = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = self._lookup(torch.where(here, input_ids - self.vocab_start, 0))
        return self.tp.all_reduce(rows.masked_fill_(~here.unsqueeze(-1), 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the table held here -> [*ids.shape, hidden_size], model dtype."""
        if self.packed is not None:
            flat = ids.reshape(-1).long()  # any shape of ids, as F.embedding takes
            if self._dequantize_rows is not None:
                rows = self._dequantize_rows(self.packed, flat, self.dtype)
            else:
                rows = dequantize(self.packed.rows(flat), self.dtype)
            return rows.view(*ids.shape, rows.shape[-1])
        return F.embedding(ids, self.weight)

    def weight_format(self) -> tuple[str, int]:
        """(format, bytes held) for the start-up report (a lookup reads only its rows)."""
        if self.packed is not None:
            return f"packed {self.packed.label}", self.packed.nbytes
        return str(self.weight.dtype).removeprefix("torch."), self.weight.nbytes


class LMHead(Linear):
    """Logits = hidden W^T with W [vocab_size, hidden_size], through the layer's quant method like any Linear;
    `tied` reuses an embedding's matrix (shared with a dense method, fed to the method's loader otherwise)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tied: VocabEmbedding | None,
        quant_method: LinearMethod | None = None,
        *,
        quant_config: Any = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: vocab-parallel: this rank computes the logits of its vocab rows (the embedding's rows when tied) and
        an all-gather joins them."""
        start, stop = shard_range(vocab_size, tp)
        super().__init__(hidden_size, stop - start, False, dtype, device, quant_method, quant_config=quant_config,
                         prefix="lm_head", shard=None if tp is None else LinearShard(tp, rows=((start, stop),)))
        self.vocab_widths = None if tp is None else [b - a for a, b in
                                                     (partition(vocab_size, tp.size, r) for r in range(tp.size))]
        self.tied = tied
        if tied is not None and tied.weight is not None and isinstance(self.weight, nn.Parameter) \
                and self.weight.shape == tied.weight.shape and self.weight.dtype == tied.weight.dtype:
            self.weight = tied.weight  # one dense matrix for both (the method reads or requantizes it)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 (the matmul runs in the model dtype and
        is cast, as transformers does)."""
        logits = super().forward(hidden).float()
        if self.shard is not None:
            logits = self.shard.tp.all_gather_columns(logits, self.vocab_widths)
        return logits
