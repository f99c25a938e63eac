"""The Executor seam: how the engine runs a step on the model, in this process or on many.

The engine owns the scheduler and calls `execute_model(scheduler_output)` once per step; an executor turns that
into forward passes wherever the model lives and returns the driver's ModelRunnerOutput. The driver runner (rank 0,
always in the engine's process) is exposed for what the engine reads once at start-up: the architecture, the
tokenizer, the KV cache's block count and groups.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loom.config import CacheConfig, ModelConfig
from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
from loom.worker.model_runner import ModelRunner


class ExecutorDiedError(RuntimeError):
    """A worker process of the executor died or stopped answering: the engine cannot run another step."""


class Executor(Protocol):
    """Runs each step's forward pass and sampling (vLLM v1's Executor)."""

    driver: ModelRunner  # rank 0's runner, in this process: model shapes, tokenizer, KV cache layout

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the driver's sampled tokens and logprobs.

        Raises:
            ExecutorDiedError: a worker died or timed out; no later step can run.
        """
        ...

    def shutdown(self) -> None:
        """Stop the workers and release the process group (idempotent)."""
        ...


class UniProcExecutor:
    """The whole model in this process: the runner itself."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device) -> None:
        self.driver = ModelRunner(model_config, cache_config, device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
