"""Tensor parallelism over processes on torch.distributed: rank 0 is the engine's process (scheduler and driver
runner), ranks 1.. are workers that run the same step on their shard of the model.

Two process groups: the default one carries the model's collectives (all-reduce, all-gather) with
`timeout_s`, so a worker that stops answering fails a step instead of hanging it; a second gloo group carries
each step's StepMessage from rank 0 (broadcast_object_list) with a long timeout, so workers can wait through an
idle server. A worker that dies closes its sockets, and rank 0's next collective fails at once; local workers are
also checked by their process handles before every step. Either way the executor raises ExecutorDiedError and
stops the rest: no later step runs on a model that is missing a shard.

Start: `tensor_parallel_size` N > 1 spawns N - 1 local worker processes (loopback TCP rendezvous), or, under
`torchrun` (WORLD_SIZE, RANK, MASTER_ADDR in the environment), joins the ranks torchrun started: rank 0 runs the
engine, every other rank `loom.executor.worker.serve_worker` (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import select
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import loom
from loom.config import CacheConfig, ModelConfig, ParallelConfig
from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
from loom.env import launched_by_torchrun
from loom.executor.base import ExecutorDiedError
from loom.executor.step_message import StepEncoder
from loom.executor.worker import (LOAD_TIMEOUT, WorkerArgs, agree_on_options, block_counts, check_layout,
                                  model_parallel_groups)
from loom.worker.model_runner import ModelRunner, physical_memory_bytes

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a local worker's interpreter: the loom package rank 0 imported first on the path (not the current directory)
_WORKER_MAIN = (f"import sys; sys.path[0] = {str(Path(loom.__file__).resolve().parent.parent)!r}; "
                "from loom.executor.worker import main; main()")

# a rank's memory besides its KV cache and weights: the interpreter, torch and the step's activations (a rank of the
# bundled model measured ~1 GB resident at 16 ranks on one machine, 0.5 GiB of it KV cache)
RANK_RUNTIME_BYTES = 256 << 20


def checkpoint_bytes(model: str | None) -> int:
    """Bytes of a checkpoint's weight files (a GGUF file, or a Hugging Face directory's safetensors shards); 0 where
    they cannot be read here (the loader then names the problem)."""
    from loom.model.loader import default_model_path
    from loom.model.loader.safetensors import safetensors_files

    path = Path(model) if model is not None else Path(default_model_path())
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in safetensors_files(path))
    except (OSError, ValueError):
        return 0


def check_local_memory(model_config: ModelConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                       local_ranks: int) -> None:
    """Refuse, before any process starts, ranks on this machine that cannot all fit its memory: each commits its KV
    cache at start (`kv_cache_memory_gb`, and the host tier), holds its share of the weights (the whole checkpoint
    under context parallelism, 1 / (tensor x pipeline) of it otherwise) and RANK_RUNTIME_BYTES of interpreter and
    torch. Each rank checks its own cache against the machine, but not the others': `-cp 64` on a 24 GiB machine
    would otherwise start 63 workers and exhaust its memory. With num_kv_blocks set the cache's size depends on the
    model, and only the weights and runtime are counted here (each rank still checks its cache).

    Raises:
        ValueError: naming the parallel sizes and kv_cache_memory_gb, with the sizes in GiB.
    """
    physical = physical_memory_bytes()
    if physical is None:  # not a POSIX system: each rank's own check decides
        return
    kv = 0 if cache_config.num_blocks is not None else cache_config.kv_cache_memory_bytes
    weights = checkpoint_bytes(model_config.model) // (parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
    per_rank = kv + cache_config.kv_offload_memory_bytes + weights + RANK_RUNTIME_BYTES
    if local_ranks * per_rank > physical:
        gib = 1 << 30
        raise ValueError(
            f"{local_ranks} ranks on this machine (tensor {parallel.tensor_parallel_size} x pipeline "
            f"{parallel.pipeline_parallel_size} x context {parallel.context_parallel_size}) need about "
            f"{per_rank / gib:.2f} GiB each (KV cache {(kv + cache_config.kv_offload_memory_bytes) / gib:.2f} GiB "
            f"from kv_cache_memory_gb + kv_offload_memory_gb, weights {weights / gib:.2f}, runtime "
            f"{RANK_RUNTIME_BYTES / gib:.2f}): {local_ranks * per_rank / gib:.1f} GiB in all, more than this "
            f"machine's {physical / gib:.1f} GiB; use fewer ranks or a smaller kv_cache_memory_gb")


class MultiprocExecutor:
    """Rank 0 of a model-parallel group; see the module docstring."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                 parallel: ParallelConfig, num_threads: int | None) -> None:
        """Raises:
            ValueError: a device other than the CPU, or torchrun's WORLD_SIZE differs from the world size.
            ExecutorDiedError: a worker failed to start (its error is logged by the worker)."""
        if device.type != "cpu":
            raise ValueError("tensor / pipeline / context parallelism runs on CPU (gloo) for now; CUDA (NCCL) is not "
                             "wired yet")
        if dist.is_initialized():
            raise ValueError("a model-parallel engine already runs in this process (one default process group per "
                             "process): shut it down first (llm.engine.shutdown())")
        self.size = parallel.world_size
        timeout_s = parallel.distributed_timeout_s
        self._procs: list[Any] = []
        self._dead = False
        self._owns_group = False  # this executor created the default process group (and so destroys it)
        self._encoder: StepEncoder | None = None
        if launched_by_torchrun():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != self.size or rank != 0:
                raise ValueError(f"torchrun started {world} ranks (this is rank {rank}) for tensor x pipeline x "
                                 f"context_parallel_size = {self.size}: they must be equal, and rank 0 runs the "
                                 "engine")
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        num_layers = check_layout(model_config, parallel)  # before any process starts
        check_local_memory(model_config, cache_config, parallel,
                           int(os.environ.get("LOCAL_WORLD_SIZE", self.size)) if init_method == "env://" else self.size)
        try:
            for rank in range(1, self.size if init_method != "env://" else 1):
                # a fresh interpreter (loom.executor.worker.main), not multiprocessing: a user's script
                # needs no `if __name__ == "__main__"` guard, and nothing of this process is inherited; a session
                # of its own, so a terminal's Ctrl-C reaches rank 0 alone (which then stops it cleanly)
                # it imports the loom rank 0 runs (`-m` would put the current directory first on the path, where
                # another checkout may sit)
                proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
                self._procs.append(proc)
                assert proc.stdin is not None
                try:
                    pickle.dump(WorkerArgs(rank, parallel, init_method, model_config, cache_config, num_threads),
                                proc.stdin)
                    proc.stdin.close()
                except BrokenPipeError:  # it exited before reading its arguments: _wait_ready says so, with its
                    # exit code, as for a worker that dies a moment later (the same error either way)
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            self._wait_ready(timeout_s)
            dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=timeout_s))
            self._owns_group = True
            # rank 0 waits for the workers' next receive with the collectives' timeout (a frozen worker fails the
            # step); the workers wait for rank 0's next step with the long one (an idle server)
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            loaded = dist.new_group(backend="gloo", timeout=LOAD_TIMEOUT)  # waits for the slowest rank's loading
            agree_on_options((model_config, cache_config, parallel), loaded)
            tp, pp, cp = model_parallel_groups(0, parallel, num_layers)
            self.driver = ModelRunner(model_config, cache_config, device, tp=tp, pp=pp, cp=cp)
            self._check_same_blocks(loaded)
        except Exception as e:
            dead = self._dead_workers()
            self._shutdown(tell_workers=False)
            if dead and not isinstance(e, (ValueError, ExecutorDiedError)):  # a user error is the same on every
                # rank: say it as is
                raise ExecutorDiedError(f"model-parallel workers failed to start: {dead}") from e
            raise
        self._encoder = StepEncoder()
        logger.info("model parallel: tensor %d x pipeline %d x context %d = %d ranks on gloo (%s), %d KV blocks on "
                    "every rank", parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                    parallel.context_parallel_size, self.size,
                    "torchrun" if not self._procs else "local worker processes", self.driver.num_blocks)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until every local worker has its arguments and its imports (it writes a line on stdout just before
        it joins the process group), watching the processes meanwhile: one that dies at start-up (a bad
        interpreter, an import error) fails the start at once instead of leaving rank 0 in the rendezvous until
        the timeout.

        Raises:
            ExecutorDiedError: a local worker exited before it was ready, or was not ready within timeout_s.
        """
        waiting = {proc.stdout.fileno(): proc for proc in self._procs if proc.stdout is not None}
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], 0.1)
            for fd in ready:
                proc = waiting.pop(fd)
                line = proc.stdout.readline()  # "ready"; an empty read is the end of the pipe: it exited
                proc.stdout.close()
                if not line:
                    try:  # reap it, so the error gives its exit code (its pipe can close before poll() sees it)
                        proc.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
                    raise ExecutorDiedError(f"model-parallel workers exited before joining: "
                                            f"{self._dead_workers() or f'pid {proc.pid} closed its output'}")
            dead = self._dead_workers()
            if dead:
                raise ExecutorDiedError(f"model-parallel workers exited before joining: {dead}")
            if time.monotonic() > deadline:
                raise ExecutorDiedError(f"model-parallel workers not ready after {timeout_s:.0f} s")

    def _check_same_blocks(self, group: Any) -> None:
        """Every rank must size its KV cache alike (the scheduler's block ids index every rank's cache)."""
        counts = block_counts(self.driver, self.size, group)
        if any(c != counts[0] for c in counts):
            raise RuntimeError(f"ranks disagree on KV blocks (blocks, host blocks): {counts}")

    def _dead_workers(self) -> str:
        return ", ".join(f"rank {i + 1} (pid {p.pid}, exit code {p.returncode})"
                         for i, p in enumerate(self._procs) if p.poll() is not None)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead:
            raise ExecutorDiedError("the model-parallel executor has stopped (a worker died earlier)")
        dead = self._dead_workers()
        if dead:
            self._fail(f"model-parallel worker died: {dead}")
        self.driver.step_collectives_done = False  # (the previous step's flag must not excuse this broadcast)
        try:
            dist.broadcast_object_list([self._encoder.encode(scheduler_output)], src=0, group=self._control)
            return self.driver.execute_model(scheduler_output)
        except Exception as e:
            if self.driver.step_collectives_done:  # rank 0's own work after the step's last collective (sampling):
                raise  # the ranks are still in step; the engine fails this step's requests only
            # a failed collective, or a failure while the workers are inside the step: no later step can run
            dead = self._dead_workers()
            self._fail(f"model-parallel step failed ({type(e).__name__}: {e})"
                       + (f"; dead workers: {dead}" if dead else ""), e)

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        logger.error("%s; stopping the executor", message)
        self._shutdown(tell_workers=False)
        raise ExecutorDiedError(message) from cause

    def shutdown(self) -> None:
        self._shutdown(tell_workers=True)

    def _shutdown(self, tell_workers: bool) -> None:
        if self._dead:
            return
        self._dead = True
        if tell_workers and self._encoder is not None:
            try:  # a clean stop: the workers leave their loop (torchrun's ranks exit with it)
                dist.broadcast_object_list([None], src=0, group=self._control)
            except Exception:  # noqa: BLE001 - a worker already gone; terminated below
                logger.debug("stop message not delivered", exc_info=True)
        for proc in self._procs:
            try:
                proc.wait(timeout=5 if tell_workers else 0.01)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group with dead peers may fail to close; nothing to keep
                logger.debug("destroy_process_group failed", exc_info=True)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
