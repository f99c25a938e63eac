"""Microbenchmark of loom's packed-weight CPU kernels (loom/kernels/quant.py, csrc/qgemm.c) at SmolLM2-135M's
matrix shapes, against dequantize + torch's GEMM and PyTorch's own int8 / int4 weight-only kernels.

For each shape and M (rows of x), the median time per call over `--repeats` calls and the weight bytes
read per second (the packed matrix's bytes / time; for torch's kernels, the bytes of their own packing).
Weights are cold by default: each call reads the next of enough copies of the matrix to exceed
`--working-set-mb` (more than the L3), as a decode step reads each layer's weights once; `--hot` reuses
one copy (cache-resident for the small matrices).

Paths:
  q8        quantize_activations(x) + gemm_q8 (int8 activations; llama.cpp-style integer dots)
  f         gemm_f (float activations, codes widened in registers: W4A16 / W8A16)
  deq+mm    kernels.dequantize(w) to float32 + F.linear (what loom runs above dense_min_rows rows)
  t.int8    torch.ops.aten._weight_int8pack_mm (int8 per output channel, float32 x)
  t.int4    torch._weight_int4pack_mm_for_cpu (4-bit groups of 32 with scale and zero, bfloat16 x)

`--model-step` also times one decode step's matmuls at M = 1: 30 layers of SmolLM2's q4g matrices
(qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], with mins) and the q8g LM head
[49152, 576], activations quantized once per distinct input, as PackedLinearMethod runs them.

    .venv/bin/python benchmarks/quant_kernels_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loom.kernels.registry import get_kernel
from loom.quant.layout import PackedWeight, pack_q4g

SHAPES = (  # name, layout, N, K, group, mins
    ("o [576,576]", "q4g", 576, 576, 32, True),
    ("gate_up [3072,576]", "q4g", 3072, 576, 32, True),
    ("down [576,1536]", "q4g", 576, 1536, 32, True),
    ("lm_head [49152,576]", "q8g", 49152, 576, 32, False),
)


def make_weight(layout: str, n: int, k: int, group: int, mins: bool, gen: torch.Generator) -> PackedWeight:
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    m = (torch.randn(n, k // group, generator=gen) * 0.05).half() if mins else None
    if layout == "q4g":
        return pack_q4g(torch.randint(0, 16, (n, k), generator=gen), scales, m)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return PackedWeight("q8g", codes, scales, m, group)


def timed(fn: Callable[[int], object], calls: int, repeats: int) -> tuple[float, float]:
    """(median, best) seconds per call of fn(i) over `repeats` calls after a warm-up, i the call's index
    (fewer repeats for calls over 0.2 s, so that the run stays short)."""
    t0 = time.perf_counter()
    fn(0)
    first = time.perf_counter() - t0
    for i in range(1, min(calls, 3)):
        fn(i)
    if first > 0.2:
        repeats = min(repeats, 5)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def bench_shape(kern, name: str, layout: str, n: int, k: int, group: int, mins: bool, ms: list[int],
                args: argparse.Namespace) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    proto = make_weight(layout, n, k, group, mins, gen)
    copies = 1 if args.hot else max(1, math.ceil(args.working_set_mb * 1e6 / proto.nbytes))
    ws = [proto] + [make_weight(layout, n, k, group, mins, gen) for _ in range(copies - 1)]
    # PyTorch's own kernels, same shapes: int8 per channel; int4 groups of 32 (scale and zero per group)
    i8 = [(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n) * 0.01 + 1e-3)
          for _ in range(copies if "t.int8" in args.paths else 0)]
    i8_bytes = n * k + 4 * n
    i4 = []
    for _ in range(copies if "t.int4" in args.paths else 0):
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        sz = torch.stack([torch.rand(k // 32, n) * 0.01 + 1e-3, torch.randn(k // 32, n) * 0.01], -1).bfloat16()
        i4.append((torch._convert_weight_to_int4pack_for_cpu(codes, 2), sz))
    i4_bytes = n * k // 2 + (k // 32) * n * 4
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen)
        xb = x.bfloat16()
        # fewer repeats for the big calls, so the whole run stays short
        flops = 2 * m * n * k
        reps = max(5, min(args.repeats, int(2e9 / max(flops, 1))))

        def q8(i: int) -> None:
            kern.gemm_q8(kern.quantize_activations(x), ws[i % copies])

        def fpath(i: int) -> None:
            kern.gemm_f(x, ws[i % copies])

        def deq(i: int) -> None:
            F.linear(x, kern.dequantize(ws[i % copies], torch.float32))

        def t8(i: int) -> None:
            w, s = i8[i % copies]
            torch.ops.aten._weight_int8pack_mm(x, w, s)

        def t4(i: int) -> None:
            w, sz = i4[i % copies]
            torch._weight_int4pack_mm_for_cpu(xb, w, 32, sz)

        for path, fn, nbytes in (("q8", q8, proto.nbytes), ("f", fpath, proto.nbytes), ("deq+mm", deq, proto.nbytes),
                                 ("t.int8", t8, i8_bytes), ("t.int4", t4, i4_bytes)):
            if path not in args.paths:
                continue
            try:
                t, best = timed(fn, copies, reps)
            except RuntimeError as exc:  # a torch kernel that does not take this shape
                rows.append((name, m, path, None, None, None, str(exc)[:60]))
                continue
            rows.append((name, m, path, t, nbytes / t / 1e9, best, ""))
    return rows


def model_step(kern, args: argparse.Namespace) -> tuple[float, float, int]:
    """(median ms, GB/s, bytes) of one M = 1 decode step's matmuls on the q8 path."""
    gen = torch.Generator().manual_seed(1)
    layers = [[make_weight("q4g", n, k, 32, True, gen) for n, k in ((960, 576), (576, 576), (3072, 576),
                                                                      (576, 1536))] for _ in range(30)]
    head = make_weight("q8g", 49152, 576, 32, False, gen)
    total = sum(w.nbytes for ly in layers for w in ly) + head.nbytes
    x576 = torch.randn(1, 576, generator=gen)
    x1536 = torch.randn(1, 1536, generator=gen)

    def step(_: int) -> None:
        for qkv, o, gate_up, down in layers:
            kern.gemm_q8(kern.quantize_activations(x576), qkv)
            kern.gemm_q8(kern.quantize_activations(x576), o)
            kern.gemm_q8(kern.quantize_activations(x576), gate_up)
            kern.gemm_q8(kern.quantize_activations(x1536), down)
        kern.gemm_q8(kern.quantize_activations(x576), head)

    t, best = timed(step, 3, args.step_repeats)
    return t * 1e3, best * 1e3, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,4,8,32,512", help="rows of x, comma-separated")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--working-set-mb", type=float, default=96.0, help="copies of each weight to exceed this")
    ap.add_argument("--hot", action="store_true", help="reuse one copy of each weight")
    ap.add_argument("--isa", default=None, help="qgemm ISA build (default: the best this CPU runs)")
    ap.add_argument("--shapes", default="", help="substring filter on the shape names")
    ap.add_argument("--paths", default="q8,f,deq+mm,t.int8,t.int4", help="comma-separated paths to run")
    ap.add_argument("--model-step", action="store_true", help="also time a whole M=1 decode step's matmuls")
    ap.add_argument("--step-repeats", type=int, default=30)
    args = ap.parse_args()
    args.paths = set(args.paths.split(","))
    torch.set_num_threads(args.threads)
    kern = get_kernel("qgemm", isa=args.isa)
    if kern is None:
        raise SystemExit("qgemm kernel unavailable (no compiler or unsupported ISA)")
    ms = [int(v) for v in args.ms.split(",")]
    print(f"qgemm isa={kern.isa} ({kern.impl}), threads={args.threads}, torch {torch.__version__}, "
          f"{'hot' if args.hot else f'cold (working set > {args.working_set_mb:.0f} MB)'}, "
          f"loadavg {os.getloadavg()[0]:.2f}")
    print(f"{'shape':<22}{'M':>5}  {'path':<8}{'median us':>12}{'GB/s':>8}{'best us':>12}{'GB/s':>8}  note")
    for name, layout, n, k, group, mins in SHAPES:
        if args.shapes not in name:
            continue
        for row in bench_shape(kern, name, layout, n, k, group, mins, ms, args):
            nm, m, path, t, gbs, best, note = row
            if t is None:
                print(f"{nm:<22}{m:>5}  {path:<8}{'-':>12}{'-':>8}{'-':>12}{'-':>8}  {note}", flush=True)
                continue
            print(f"{nm:<22}{m:>5}  {path:<8}{t * 1e6:12.1f}{gbs:8.2f}{best * 1e6:12.1f}{gbs * t / best:8.2f}  {note}",
                  flush=True)
    if args.model_step:
        med, best, total = model_step(kern, args)
        print(f"model step (M=1, q8 path, 121 matmuls + 121 activation quantizations, {total / 1e6:.1f} MB): "
              f"median {med:.2f} ms ({total / med / 1e6:.2f} GB/s), best {best:.2f} ms ({total / best / 1e6:.2f} GB/s)")


if __name__ == "__main__":
    main()
