"""Ring attention (issue 14, context parallel): one layer's prefill attention of an n-token prompt on 1 vs 2 gloo
ranks (one thread each), against torch's fused single-process attention at 1 and 2 threads.

Attention only: q/k/v projections and the MLP split by tokens with no communication, so attention (and its K/V
ring) is what context parallelism changes. Heads default to SmolLM2-135M's (9 query heads, 3 KV heads, 64 wide).

    .venv/bin/python benchmarks/cp_bench.py --tokens 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.distributed.context_parallel import ContextParallel, ring_attention, split_sequence, split_sequence_zigzag


def _inputs(n: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g),
            torch.randn(n, kv_heads, dim, generator=g))


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    cp = ContextParallel(rank, size)
    q, k, v = _inputs(args.tokens, args.heads, args.kv_heads, args.head_dim)
    want = torch.load(Path(out_dir) / "reference.pt")
    lines = []
    for split in (split_sequence, split_sequence_zigzag):
        pos = split(args.tokens, cp)
        ql, kl, vl = q[pos].contiguous(), k[pos].contiguous(), v[pos].contiguous()
        own, slowest = [], []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            out = ring_attention(ql, kl, vl, cp, scale=args.head_dim ** -0.5, positions=pos)
            own.append(time.perf_counter() - t0)  # this rank's time, ring waits included
            dist.barrier()
            slowest.append(time.perf_counter() - t0)  # until the last rank is done (plus one barrier)
        err = (out - want[pos]).abs().max().item()
        lines.append(f"{split.__name__} rank {rank}: own {statistics.median(own) * 1e3:.0f} ms, all ranks done "
                     f"{statistics.median(slowest) * 1e3:.0f} ms, max abs error vs sdpa {err:.1e}")
    (Path(out_dir) / f"rank{rank}.txt").write_text("\n".join(lines))
    dist.destroy_process_group()


def _single(args: argparse.Namespace, out_dir: str) -> None:
    q, k, v = _inputs(args.tokens, args.heads, args.kv_heads, args.head_dim)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            # 4-D inputs: torch's fused CPU kernel (3-D ones took its unfused path, 9x slower here)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                enable_gqa=True)[0]
            times.append(time.perf_counter() - t0)
        print(f"sdpa (fused, one process) {threads} thread(s): {statistics.median(times) * 1e3:.0f} ms")
    want = want.transpose(0, 1).contiguous()
    torch.save(want, Path(out_dir) / "reference.pt")
    torch.set_num_threads(1)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, ContextParallel(0, 1), scale=args.head_dim ** -0.5)
        times.append(time.perf_counter() - t0)
    print(f"ring_attention size 1, 1 thread: {statistics.median(times) * 1e3:.0f} ms, "
          f"max abs error vs sdpa {(out - want).abs().max().item():.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        _single(args, out_dir)
        mp.spawn(_worker, args=(args.ranks, port, args, out_dir), nprocs=args.ranks)
        for r in range(args.ranks):
            print((Path(out_dir) / f"rank{r}.txt").read_text())
    chunk = -(-args.tokens // args.ranks)
    sent = (args.ranks - 1) * 2 * chunk * args.kv_heads * args.head_dim * 4
    print(f"K/V sent per rank: {sent / 2**20:.2f} MiB in {args.ranks - 1} transfer(s)")


if __name__ == "__main__":
    main()
