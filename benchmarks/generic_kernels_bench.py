"""Micro-benchmarks of loom's portable CPU kernels (loom/kernels/cpu_generic.py) against the torch code they
replace: paged decode attention, the fused elementwise ops and the bf16-weight GEMV.

    .venv/bin/python benchmarks/generic_kernels_bench.py [--isa avx2] [--threads 2] [--only decode,fused,gemv]

Every figure is the median over --repeats timings of a loop of calls, in microseconds per call. Memory-bound
figures also give GB/s of the bytes the call must read. Cold figures cycle over enough copies of the
operands (--cold-mb) that they come from DRAM, as in a decode step, which streams the whole model and
KV cache (far more than the L3); hot figures reuse one copy.

Not a test: nothing is asserted. The machine and load average are printed with the tables.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loom.attention.cpu_paged import _gather_and_attend, plan_step
from loom.attention.metadata import build_attention_metadata
from loom.kernels.registry import get_kernel, kernel_isas
from loom.model.layers.rotary import RotaryEmbedding, apply_rotary


def median_us(fn: Callable[[], object], repeats: int, min_time_s: float = 0.02) -> float:
    """Median over `repeats` timings of a loop of calls (loop length set so one timing lasts ~min_time_s)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(min_time_s / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops * 1e6)
    return statistics.median(samples)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def bench_decode(args: argparse.Namespace, isa: str) -> None:
    kernel = get_kernel("paged_decode", isa=isa)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16  # SmolLM2-135M
    scale = dim ** -0.5
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 16):
            for context in (100, 1000):
                blocks_per_req = -(-context // block_size)
                num_blocks = batch * blocks_per_req
                g = torch.Generator().manual_seed(batch * 10000 + context)
                kv_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize  # what one layer must read
                # distinct caches (layers) so that each call reads DRAM, like the 30 layers of a step
                layers = max(1, math.ceil(args.cold_mb * 2**20 / (2 * num_blocks * block_size * kv_heads * dim
                                                               * dtype.itemsize)))
                caches = [torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
                          for _ in range(layers)]
                perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache
                tables = perm.view(batch, blocks_per_req).tolist()
                md = build_attention_metadata([1] * batch, [context] * batch, tables, block_size, torch.device("cpu"))
                plan = plan_step(md, None, dtype).decode
                assert plan is not None
                query = torch.randn(batch, heads, dim, generator=g).to(dtype)
                it = iter(range(1 << 62))

                def torch_path() -> torch.Tensor:
                    cache = caches[next(it) % layers]
                    if plan.serial:
                        torch.set_num_threads(1)
                        try:
                            return _gather_and_attend(query, cache, plan, scale)
                        finally:
                            torch.set_num_threads(args.threads)
                    return _gather_and_attend(query, cache, plan, scale)

                def kernel_path(threads: int) -> Callable[[], torch.Tensor]:
                    return lambda: kernel(query, caches[next(it) % layers], plan.block_ids, plan.seq_lens, scale,
                                          None, num_threads=threads, lengths_checked=True)

                ref = _gather_and_attend(query, caches[0], plan, scale).float()
                got = kernel(query, caches[0], plan.block_ids, plan.seq_lens, scale, None).float()
                err = (got - ref).abs().max().item()
                t_torch = median_us(torch_path, args.repeats)
                t_k = median_us(kernel_path(args.threads), args.repeats)
                t_k1 = median_us(kernel_path(1), args.repeats)
                gbs = kv_bytes / (t_k * 1e-6) / 1e9
                rows.append([str(dtype).replace("torch.", ""), str(batch), str(context), f"{kv_bytes / 1e6:.2f}",
                             f"{t_torch:.1f}" + (" (1 thr)" if plan.serial else ""), f"{t_k:.1f}", f"{t_k1:.1f}",
                             f"{t_torch / t_k:.2f}x", f"{gbs:.1f}", f"{err:.1e}"])
    table(f"paged decode per layer (SmolLM2: 9 heads, 3 KV heads, d 64, block 16; {isa}; blocks shuffled; "
          f"us per call)",
          ["cache", "batch", "context", "KV MB", "torch gather+SDPA", f"kernel {args.threads} thr", "kernel 1 thr",
           "speedup", "kernel GB/s", "max |diff|"], rows)


def bench_fused(args: argparse.Namespace, isa: str) -> None:
    ops = get_kernel("fused_ops", isa=isa)
    hidden, inter, eps = 576, 1536, 1e-5
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    cos, sin = rope.cos_sin(torch.tensor([1000]))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, hidden).to(dtype)
        res = torch.randn(1, hidden).to(dtype)
        w = torch.randn(hidden).to(dtype)
        gate_up = torch.randn(1, 2 * inter).to(dtype)
        qkv = torch.randn(1, 15 * 64).to(dtype)
        qk = qkv[:, : 12 * 64].view(1, 12, 64)  # q and k heads of the fused qkv output, as LlamaAttention

        def torch_norm() -> object:
            total = x + res
            if dtype == torch.float32:
                return F.rms_norm(total, (hidden,), w, eps), total
            return w * F.rms_norm(total.float(), (hidden,), None, eps).to(dtype), total

        def torch_silu() -> object:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate).mul_(up)

        name = str(dtype).replace("torch.", "")
        for op, t_fn, k_fn in (
            ("add+RMSNorm [1, 576]", torch_norm, lambda: ops.add_rmsnorm(x, res, w, eps)),
            ("SiLU*up [1, 2x1536]", torch_silu, lambda: ops.silu_mul(gate_up)),
            ("rotary [1, 12, 64]", lambda: apply_rotary(qk, cos, sin), lambda: ops.rotary(qk, cos, sin)),
        ):
            t_torch = median_us(t_fn, args.repeats)
            t_k = median_us(k_fn, args.repeats)
            rows.append([op, name, f"{t_torch:.2f}", f"{t_k:.2f}", f"{t_torch / t_k:.1f}x"])
    table(f"fused ops per call at M = 1 ({isa}; us)", ["op", "dtype", "torch", "kernel", "speedup"], rows)


def bench_gemv(args: argparse.Namespace, isa: str) -> None:
    gemv = get_kernel("gemv_w16", isa=isa)
    rows = []
    for n, k in ((576, 576), (3072, 576), (576, 1536), (49152, 576)):
        for cold in (True, False):
            g = torch.Generator().manual_seed(n + k)
            bytes16 = n * k * 2
            copies = max(1, math.ceil(args.cold_mb * 2**20 / bytes16)) if cold else 1
            copies32 = max(1, math.ceil(args.cold_mb * 2**20 / (2 * bytes16))) if cold else 1
            w16 = [torch.randn(n, k, generator=g).bfloat16() for _ in range(copies)]
            w32 = [w.float() for w in w16[:copies32]] + [torch.randn(n, k, generator=g)
                                                         for _ in range(copies32 - min(copies32, copies))]
            x = torch.randn(1, k, generator=g)
            x16 = x.bfloat16()
            it = iter(range(1 << 62))
            t_w16 = median_us(lambda: gemv(x, w16[next(it) % copies]), args.repeats)
            t_f32 = median_us(lambda: F.linear(x, w32[next(it) % copies32]), args.repeats)
            t_bf16 = median_us(lambda: F.linear(x16, w16[next(it) % copies]), args.repeats)
            err = (gemv(x, w16[0]).double() - x.double() @ w16[0].double().T).abs().max().item()
            rows.append([f"[{n}, {k}]", "cold" if cold else "hot", f"{t_w16:.1f}", f"{bytes16 / t_w16 / 1e3:.1f}",
                         f"{t_f32:.1f}", f"{2 * bytes16 / t_f32 / 1e3:.1f}", f"{t_bf16:.1f}",
                         f"{t_f32 / t_w16:.2f}x", f"{t_bf16 / t_w16:.1f}x", f"{err:.1e}"])
    table(f"GEMV at M = 1, x float32 ({isa}; us per call, GB/s of weight bytes)",
          ["W [N, K]", "cache", "gemv_w16 bf16 W", "GB/s", "F.linear f32 W", "GB/s", "F.linear bf16 x, W",
           "vs f32", "vs bf16 F.linear", "max |diff| vs f64"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default=None, help="kernel ISA (default: the best this CPU runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cold-mb", type=float, default=96.0, help="operand bytes cycled over for cold figures")
    parser.add_argument("--only", default="decode,fused,gemv", help="comma-separated subset")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or kernel_isas("paged_decode")[0]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads, kernel ISA {isa}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    parts = set(args.only.split(","))
    if "decode" in parts:
        bench_decode(args, isa)
    if "fused" in parts:
        bench_fused(args, isa)
    if "gemv" in parts:
        bench_gemv(args, isa)


if __name__ == "__main__":
    main()
