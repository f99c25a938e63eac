"""A tensor-parallel worker (rank >= 1): load this rank's shard, then run every step rank 0 sends until told to
stop. Any error ends the process: rank 0 then sees its next collective fail (loom/executor/multiproc.py)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loom.config import CacheConfig, ModelConfig, ParallelConfig
from loom.distributed.context_parallel import ContextParallel
from loom.distributed.pipeline_parallel import PipelineParallel, build_groups
from loom.distributed.tensor_parallel import TensorParallel
from loom.env import env_flag
from loom.executor.step_message import StepDecoder
from loom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# The step channel waits through an idle server: only the model's collectives carry the short timeout.
CONTROL_TIMEOUT = timedelta(days=7)
# Loading a large checkpoint may take far longer than a step: the ranks' check after loading waits this long.
LOAD_TIMEOUT = timedelta(hours=2)


def threads_per_rank(num_threads: int | None, size: int) -> int:
    """torch threads of one rank: num_threads, else this machine's cores shared evenly by the local ranks."""
    return num_threads or max(1, (os.cpu_count() or 1) // size)


def model_parallel_groups(rank: int, parallel: ParallelConfig, num_layers: int
                          ) -> tuple[TensorParallel | None, PipelineParallel | None, ContextParallel | None]:
    """This rank's tensor-parallel group, pipeline stage and context-parallel ring (every rank calls it, in the same
    order). Context parallelism runs alone (ParallelConfig refuses it beside the others): its ring is every rank of
    the default group.

    Raises:
        ValueError: more stages than the model's `num_layers`.
    """
    if parallel.context_parallel_size > 1:
        return None, None, ContextParallel(rank, parallel.context_parallel_size)
    tp, pp = build_groups(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, num_layers,
                          parallel.pipeline_microbatches, parallel.enable_expert_parallel)
    return tp, pp, None


def check_layout(model_config: ModelConfig, parallel: ParallelConfig) -> int:
    """Refuse a layout the model cannot take before any process starts: more stages than layers, or what tensor
    parallelism cannot split (check_tensor_parallel). Returns the model's layer count.

    Raises:
        ValueError: naming the option.
    """
    from loom.distributed.pipeline_parallel import stage_layers
    from loom.distributed.tensor_parallel import check_tensor_parallel
    from loom.model.loader import read_arch
    from loom.model.loader.model_loader import default_quantization

    arch = read_arch(model_config.model)
    stage_layers(arch.num_layers, parallel.pipeline_parallel_size, 0)
    if parallel.tensor_parallel_size > 1:
        check_tensor_parallel(arch, model_config.quantization or default_quantization(model_config.model),
                              parallel.tensor_parallel_size)
    if parallel.enable_expert_parallel and not arch.num_experts:
        logger.warning("enable_expert_parallel: %s has no experts (a dense model): no effect", arch.architecture)
    return arch.num_layers


def block_counts(runner: ModelRunner, size: int, group: object) -> list[list[int]]:
    """Every rank's (KV blocks, host blocks), gathered on every rank (they must agree: the scheduler's block ids
    index every rank's cache)."""
    mine = torch.tensor([runner.num_blocks, runner.num_host_blocks], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


def agree_on_options(options: tuple[object, ...], group: object) -> None:
    """Every rank must run with rank 0's options (torchrun starts each machine's command on its own): compare them
    on every rank, so that a mismatch fails everywhere with one clear message instead of a desynchronized gloo error.

    Raises:
        ValueError: naming the ranks whose options differ from rank 0's.
    """
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, options, group=group)
    differ = [rank for rank, theirs in enumerate(gathered) if theirs != gathered[0]]
    if differ:
        raise ValueError(f"ranks {differ} were started with other options than rank 0 (model, quantization, dtype, "
                         "KV cache, parallel sizes must be the same on every machine): rank 0 has "
                         f"{gathered[0]!r}, rank {differ[0]} has {gathered[differ[0]]!r}")


def serve_worker(rank: int, parallel: ParallelConfig, model_config: ModelConfig, cache_config: CacheConfig) -> None:
    """Run rank `rank` of an initialized default process group until rank 0 sends the stop message.

    Raises:
        whatever loading or a step raises (the caller exits; rank 0's collectives then fail).
    """
    profile = env_flag("LOOM_PIPELINE_PROFILE", False)  # benchmarks/parallel_bench.py: a stage's busy time at exit
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    loaded = dist.new_group(backend="gloo", timeout=LOAD_TIMEOUT)
    agree_on_options((model_config, cache_config, parallel), loaded)
    tp, pp, cp = model_parallel_groups(rank, parallel, check_layout(model_config, parallel))
    runner = ModelRunner(model_config, cache_config, torch.device("cpu"), tp=tp, pp=pp, cp=cp)
    block_counts(runner, parallel.world_size, loaded)  # rank 0 checks that the ranks agree
    decoder = StepDecoder()
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            if runner.pp is not None and profile:
                print(f"pipeline stage {runner.pp.stage} rank {rank}: busy {runner.pipeline_busy_s:.4f} s of "
                      f"{runner.pipeline_step_s:.4f} s in steps", file=sys.stderr, flush=True)
            return
        runner.execute_model(decoder.decode(box[0]))


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a local worker process reads (pickled) from its stdin."""

    rank: int
    parallel: ParallelConfig
    init_method: str  # tcp://127.0.0.1:PORT of rank 0's rendezvous
    model_config: ModelConfig
    cache_config: CacheConfig
    num_threads: int | None


def _exit_with_parent() -> None:
    """A local worker leaves when rank 0, its parent, is gone (killed, or exited without stopping it): the worker
    runs in a session of its own, so no signal reaches it, and while it loads or waits for a step no socket error
    would either. A thread checks once a second whether it was re-parented."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="loom-parent-watch", daemon=True).start()


def main() -> None:
    """A local worker's entry (`python -c` with rank 0's loom first on the path; `python -m loom.executor.worker`
    runs it too), started by MultiprocExecutor with WorkerArgs on stdin."""
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    _exit_with_parent()
    print("ready", flush=True)  # rank 0 waits for this line before it joins the process group
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # rank 0 reads no more: anything printed goes to stderr
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s")
    world = args.parallel.world_size
    torch.set_num_threads(threads_per_rank(args.num_threads, world))
    try:
        dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=world,
                                timeout=timedelta(seconds=args.parallel.distributed_timeout_s))
        serve_worker(args.rank, args.parallel, args.model_config, args.cache_config)
    except ValueError as e:  # a user error: rank 0 finds and says it too
        logger.error("model-parallel worker rank %d: %s", args.rank, e)
        sys.exit(1)
    except Exception:  # noqa: BLE001 - logged, then the exit code tells rank 0
        logger.exception("model-parallel worker rank %d failed", args.rank)
        sys.exit(1)
    dist.destroy_process_group()


def serve_torchrun_rank(model_config: ModelConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                        num_threads: int | None) -> None:
    """A rank > 0 of a torchrun launch (`torchrun ... -m loom.cli serve --tensor-parallel-size N`): join the group
    torchrun's rendezvous set up and serve rank 0's steps until it stops.

    Raises:
        ValueError: WORLD_SIZE differs from tensor x pipeline x context_parallel_size.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks for tensor x pipeline x context_parallel_size = "
                         f"{parallel.world_size}: they must be equal")
    torch.set_num_threads(threads_per_rank(num_threads, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=parallel.distributed_timeout_s))
    try:
        serve_worker(rank, parallel, model_config, cache_config)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
