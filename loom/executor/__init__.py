"""Executors: how the engine runs a step on the model, in this process or on tensor-parallel workers."""

from __future__ import annotations

import torch

from loom.config import CacheConfig, ModelConfig, ParallelConfig
from loom.executor.base import Executor, ExecutorDiedError, UniProcExecutor


def make_executor(model_config: ModelConfig, cache_config: CacheConfig, parallel_config: ParallelConfig,
                  device: torch.device, num_threads: int | None) -> Executor:
    """The single-process executor, or (tensor / pipeline parallel) rank 0 of a multi-process one."""
    if parallel_config.world_size == 1:
        return UniProcExecutor(model_config, cache_config, device)
    from loom.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(model_config, cache_config, device, parallel_config, num_threads)


__all__ = ["Executor", "ExecutorDiedError", "UniProcExecutor", "make_executor"]
