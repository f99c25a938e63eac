"""Time one decode step of the bundled model (packed, loom's C step) at a batch of B requests with context C,
the model forward only (no sampling), median of repeats; prints the step time next to its byte floor.

    .venv/bin/python benchmarks/decode_step_bench.py --batch 16 --context 100 1000 --bandwidth-gbs 22.5 \
        [--kv-cache-dtype float16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loom.attention import build_attention_metadata
from loom.attention.kv_quant import kv_row_bytes
from loom.model.loader import load_model
from loom.worker.kv_cache import allocate_kv_caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--bandwidth-gbs", type=float, default=22.5)
    ap.add_argument("--gflops", type=float, default=178.0, help="float32 FMA peak of the threads used")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16", "int8"], default="float32",
                    help="KV cache element type (the model runs float32 either way)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    loaded = load_model(None, torch.float32, cpu, quantization="gguf")
    model, arch = loaded.model, loaded.arch
    report = model.weight_report()
    w = sum(nbytes for kind, (_, nbytes) in report.items() if kind in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj"))
    bs = 16
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    kv_row = kv_row_bytes(arch.head_dim, kv_dtype)  # bytes of one (token, KV head) row, int8 metadata included
    for ctx in args.context:
        per_seq = (ctx + 1 + bs - 1) // bs + 1
        caches = allocate_kv_caches(arch, args.batch * per_seq + 1, bs, kv_dtype, cpu)
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(args.batch)]
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for table in tables:  # fill the caches by prefill, one request at a time
                ids = torch.randint(0, arch.vocab_size, (ctx,), generator=g)
                meta = build_attention_metadata([ctx], [ctx], [table], bs, cpu)
                model(ids, torch.arange(ctx), caches, meta)
            meta = build_attention_metadata([1] * args.batch, [ctx + 1] * args.batch, tables, bs, cpu)
            ids = torch.randint(0, arch.vocab_size, (args.batch,), generator=g)
            pos = torch.full((args.batch,), ctx)
            times = []
            for _ in range(args.repeats + 2):
                t0 = time.perf_counter()
                model(ids, pos, caches, meta)
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times[2:]) * 1e3
        kv = args.batch * (ctx + 1) * arch.num_layers * 2 * arch.num_kv_heads * kv_row
        byte_floor = (w + kv) / args.bandwidth_gbs / 1e6
        # FLOPs: 2 per layer weight per row, and q.k plus p.v over the context for every query head
        h, d = arch.hidden_size, arch.head_dim
        layer_weights = arch.num_layers * (h * (arch.num_heads + 2 * arch.num_kv_heads) * d + arch.num_heads * d * h
                                           + 3 * h * arch.intermediate_size)
        flops = 2 * layer_weights * args.batch \
            + 4 * args.batch * (ctx + 1) * arch.num_layers * arch.num_heads * arch.head_dim
        flop_floor = flops / args.gflops / 1e6
        floor = max(byte_floor, flop_floor)
        print(f"batch {args.batch} context {ctx} KV {args.kv_cache_dtype}: step {ms:.2f} ms (model forward, LM head excluded); floors: "
              f"bytes (layer weights {w / 1e6:.1f} MB + KV {kv / 1e6:.1f} MB at {args.bandwidth_gbs} GB/s) "
              f"{byte_floor:.2f} ms, FLOPs ({flops / 1e9:.2f} GFLOP at {args.gflops} GFLOP/s) {flop_floor:.2f} ms; "
              f"{ms / floor:.2f}x the larger")


if __name__ == "__main__":
    main()
