"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053): how a decoder's matrices split over
the ranks of a process group, and the two collectives a split model needs.

Column-parallel: a rank holds a contiguous range of a matrix's output rows (q/k/v by heads, gate/up, the vocab rows
of the embedding and the LM head) and computes those outputs alone. Row-parallel: a rank holds a range of the input
columns (o_proj over its heads' outputs, down_proj over its part of the MLP width), computes a partial sum, and an
all-reduce adds the ranks' partial sums. One all-reduce per attention block and one per MLP, plus the embedding's
and the LM head's gather, is all a step communicates.

Splits need not be even: a range is the rank's share of `n` items, the first `n % size` ranks one more. Attention
splits whole KV heads, each query head going where its KV head is; with fewer KV heads than ranks, each KV head is
replicated on size / num_kv_heads ranks and the query heads split evenly (vLLM's rule for GQA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int  # 0 .. size - 1 within the group
    size: int  # ranks in the group (> 1; one rank is no TensorParallel at all)
    group: Any = None  # torch.distributed ProcessGroup of the ranks; None = the default group
    expert_parallel: bool = False  # MoE experts spread whole over the ranks (not each expert's width split)

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of size {self.size}: need size >= 2, 0 <= rank < size")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x. Every rank must call it with the same shape and dtype."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Concatenate each rank's x [n, widths[rank]] along the last dimension -> [n, sum(widths)].

        gloo gathers equal shapes only, so each part is padded to the widest and trimmed after.
        """
        widest = max(widths)
        if x.shape[-1] != widest:
            x = torch.nn.functional.pad(x, (0, widest - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate each rank's x [counts[rank], ...] along the first dimension -> [sum(counts), ...]."""
        most = max(counts)
        if x.shape[0] != most:
            x = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send rows [sum(send_counts[:r]), +send_counts[r]) of x to rank r; returns the rows each rank sent here,
        in rank order [sum(recv_counts), ...]."""
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out


# Methods whose weights split over tensor-parallel ranks: dense ones, and those quantized at load from a dense or
# GGUF-packed tensor (rows split freely; a row-parallel split must fall on the packed groups' boundaries)
TENSOR_PARALLEL_METHODS = ("none", "gguf", "w8a16", "w4a16")


def check_tensor_parallel(arch: Any, quantization: str, size: int) -> None:
    """Refuse what tensor parallelism over `size` ranks cannot split yet: heads that do not split (head_shard), a
    quantization method outside TENSOR_PARALLEL_METHODS, QK-norm over the whole projection (it needs every head's
    sum of squares). `arch` is a loom.model.arch.ModelArchConfig.

    Raises:
        ValueError: naming the option.
    """
    for rank in range(size):
        head_shard(arch.num_heads, arch.num_kv_heads, TensorParallel(rank, size))
    if quantization not in TENSOR_PARALLEL_METHODS:
        raise ValueError(f"tensor parallelism with quantization {quantization!r} is not supported yet; supported: "
                         f"{', '.join(TENSOR_PARALLEL_METHODS)}")
    if arch.qk_norm == "projection":
        raise ValueError("tensor parallelism: QK-norm over the whole projection (OLMo 2, OLMoE) needs every "
                         "head's sum of squares, which is not split yet; run it with tensor_parallel_size 1")


def partition(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items split into `size` contiguous parts, the first n % size one larger."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_range(n: int, tp: TensorParallel | None, align: int = 1) -> tuple[int, int]:
    """This rank's [start, stop) of n rows or columns; (0, n) without tensor parallelism. With `align`, the split
    falls on multiples of it where n is one (so a row-parallel split keeps packed weights' groups whole)."""
    if tp is None:
        return 0, n
    unit = align if n % align == 0 else 1
    start, stop = partition(n // unit, tp.size, tp.rank)
    return start * unit, stop * unit


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes (indices into the checkpoint's heads)."""

    q_start: int  # first query head
    num_heads: int  # query heads here
    kv_start: int  # first KV head
    num_kv_heads: int  # KV heads here (a replicated KV head counts once on each rank that holds it)


def head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel | None) -> HeadShard:
    """The heads a rank holds: whole KV heads (contiguous, uneven shares allowed) with their query heads; with fewer
    KV heads than ranks, one KV head replicated over size / num_kv_heads ranks and the query heads split evenly.

    Raises:
        ValueError: fewer KV heads than ranks where the ranks are not a multiple of the KV heads or the query heads
            do not split evenly, or more ranks than KV heads' query groups allow.
    """
    if tp is None:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp.size:
        kv_start, kv_stop = partition(num_kv_heads, tp.size, tp.rank)
        return HeadShard(kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start)
    if tp.size % num_kv_heads or num_heads % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} with {num_kv_heads} KV heads and {num_heads} query heads: "
                         "with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and split the "
                         "query heads evenly")
    per_rank = num_heads // tp.size
    q_start = tp.rank * per_rank
    return HeadShard(q_start, per_rank, q_start // group, 1)


def max_kv_heads_per_rank(num_heads: int, num_kv_heads: int, size: int) -> int:
    """The most KV heads any rank of `size` holds (ranks size their KV caches alike: the scheduler's block ids must
    mean the same on every rank)."""
    if size == 1:
        return num_kv_heads
    return max(head_shard(num_heads, num_kv_heads, TensorParallel(r, size)).num_kv_heads for r in range(size))
