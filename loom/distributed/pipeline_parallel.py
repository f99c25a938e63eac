"""Pipeline parallelism (GPipe, Huang et al. 2019, arXiv:1811.06965): the decoder's layers split into stages, one
per group of ranks, activations sent point to point from each stage to the next.

A step's requests are cut into micro-batches; each stage runs micro-batch j while the next stage runs j - 1, so
with m micro-batches and M stages a step keeps the stages busy except for the fill and drain of the pipeline: a
bubble of (M - 1) / (m + M - 1) of the step (GPipe's figure). Only the last stage computes logits; they travel to
rank 0, which samples with the request state it alone holds.

Ranks are laid out stage-major: global rank = stage * tensor_parallel_size + tensor-parallel rank, so rank 0 is
stage 0's tensor-parallel rank 0, and each rank's peer in the next stage has the same tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loom.distributed.tensor_parallel import TensorParallel, partition


@dataclass(frozen=True, slots=True)
class PipelineParallel:
    """This process's stage of a pipeline."""

    stage: int  # 0 .. size - 1
    size: int  # stages (> 1)
    layer_start: int  # first decoder layer of this stage
    layer_stop: int  # one past its last
    tp_size: int = 1  # ranks per stage (tensor parallel within the stage)
    tp_rank: int = 0  # this rank's tensor-parallel rank within its stage
    num_microbatches: int = 2  # most micro-batches a step is cut into

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.stage < self.size:
            raise ValueError(f"pipeline stage {self.stage} of {self.size}: need size >= 2, 0 <= stage < size")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def holds_layer(self, layer: int) -> bool:
        return self.layer_start <= layer < self.layer_stop

    def global_rank(self, stage: int) -> int:
        """The rank of `stage` that has this rank's tensor-parallel rank."""
        return stage * self.tp_size + self.tp_rank

    def send_next(self, tensors: list[torch.Tensor]) -> list[Any]:
        """Start sending `tensors` to the next stage; returns the requests to wait on (isend: a stage never blocks
        on a peer that is itself sending)."""
        peer = self.global_rank(self.stage + 1)
        return [dist.isend(t.contiguous(), peer) for t in tensors]

    def recv_prev(self, tensors: list[torch.Tensor]) -> None:
        """Receive into `tensors` (shapes and dtypes known from the step) from the previous stage."""
        peer = self.global_rank(self.stage - 1)
        for t in tensors:
            dist.recv(t, peer)


def stage_layers(num_layers: int, size: int, stage: int) -> tuple[int, int]:
    """[start, stop) of the layers of `stage` of `size`, the first num_layers % size stages one layer more.

    Raises:
        ValueError: fewer layers than stages.
    """
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers")
    return partition(num_layers, size, stage)


def build_groups(world_rank: int, tp_size: int, pp_size: int, num_layers: int, num_microbatches: int,
                 expert_parallel: bool = False) -> tuple[TensorParallel | None, PipelineParallel | None]:
    """This rank's tensor-parallel group (its MoE experts spread whole over the group with `expert_parallel`) and
    pipeline stage. Every rank must call it (new_group is collective), after init_process_group with world size
    tp_size * pp_size.

    Raises:
        ValueError: as stage_layers.
    """
    tp: TensorParallel | None = None
    for stage in range(pp_size):  # every rank creates every stage's group, in the same order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, backend="gloo") if tp_size > 1 else None
        if world_rank in ranks and tp_size > 1:
            tp = TensorParallel(world_rank - stage * tp_size, tp_size, group, expert_parallel)
    if pp_size == 1:
        return tp, None
    stage = world_rank // tp_size
    start, stop = stage_layers(num_layers, pp_size, stage)
    return tp, PipelineParallel(stage, pp_size, start, stop, tp_size, world_rank % tp_size, num_microbatches)


def split_microbatches(token_counts: list[int], num_microbatches: int) -> list[tuple[int, int]]:
    """Cut a step's requests (in batch order, `token_counts` tokens each) into at most num_microbatches
    contiguous runs of about equal tokens; returns [start, stop) request ranges, none empty."""
    n = len(token_counts)
    parts = min(num_microbatches, n)
    if parts <= 1:
        return [(0, n)] if n else []
    total = sum(token_counts)
    bounds = [0]
    running = 0
    for i, count in enumerate(token_counts):
        running += count
        # close a run once it reaches its share, leaving at least one request for each run still to come
        if len(bounds) < parts and running >= total * len(bounds) / parts and n - (i + 1) >= parts - len(bounds):
            bounds.append(i + 1)
    if bounds[-1] != n:
        bounds.append(n)
    return list(zip(bounds, bounds[1:]))
