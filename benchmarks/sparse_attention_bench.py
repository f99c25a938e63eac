"""Block-sparse decode attention (issue 16): decode step time at long context, dense vs topk-blocks.

Each configuration (context, mode) runs in its own process (`--one`), so that no cache, kernel or allocator state
carries over; the driver runs every configuration `--reps` times, interleaved, and prints the medians.

In a process: the bundled SmolLM2-135M-Instruct GGUF (packed weights, float16 KV cache on CPU, the engine's
default), one request whose prompt is `context` random token ids, prefilled in chunks of 2048 on every core; then `--steps` decode steps
are timed one by one (engine.step(), pure decode, after `--warmup` steps), and a second run of steps times every
attention backend call (the attention of one layer: K/V write, summary update, selection, kernel).

Modes: dense (the default engine: the one-call C decode step), dense-layers (dense on the per-layer path,
LOOM_DECODE_STEP=0: what topk-blocks runs besides its selection), topk-K (--sparse-attention topk-blocks with
--sparse-attention-topk K, 1 sink and 2 recent blocks).

    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/sparse_attention_bench.py --contexts 8000 4000 2000 \
        --modes dense dense-layers topk-16 topk-32 topk-64 --reps 2 --steps 16 --warmup 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_one(context: int, mode: str, steps: int, warmup: int, seed: int, threads: int | None) -> dict:
    """One configuration in this process: median decode step time and attention call time, in ms."""
    import torch

    from loom import LLM, SamplingParams

    kwargs: dict = dict(block_size=16, max_model_len=8192, num_kv_blocks=8192 // 16 + 8,
                        max_num_batched_tokens=2048, enable_prefix_caching=False)
    if mode.startswith("topk-"):
        kwargs.update(sparse_attention="topk-blocks", sparse_attention_topk=int(mode.split("-")[1]),
                      sparse_attention_sink_blocks=1, sparse_attention_recent_blocks=2)
    llm = LLM(**kwargs)
    engine = llm.engine
    vocab = engine.runner.arch.vocab_size
    prompt = torch.randint(100, vocab - 100, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=warmup + 2 * steps + 4, ignore_eos=True)
    engine.add_request("r", prompt, params)
    started = time.perf_counter()
    while not any(len(o.outputs[0].token_ids) for o in engine.step()):  # prefill, up to the first token
        pass
    prefill_s = time.perf_counter() - started
    if threads is not None:  # the prefill ran on every core; the decode steps on `threads`
        torch.set_num_threads(threads)
    for _ in range(warmup):
        engine.step()
    step_ms, cpu_ms = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        cpu_ms.append((time.process_time() - c) * 1e3)
    # attention-only: time every backend call of the next steps (the per-layer path; the dense one-call C step
    # makes no backend call, so dense reports none)
    backend = engine.runner.attn_backend
    calls: list[float] = []
    forward = backend.forward

    def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = forward(*args, **kw)
        calls.append((time.perf_counter() - t0) * 1e3)
        return out

    backend.forward = timed
    for _ in range(steps):
        engine.step()
    backend.forward = forward
    return {"context": context, "mode": mode, "threads": torch.get_num_threads(),
            "kv_dtype": str(engine.runner.kv_cache_dtype), "prefill_s": round(prefill_s, 2),
            "step_ms": statistics.median(step_ms), "step_cpu_ms": statistics.median(cpu_ms), "attn_call_ms": statistics.median(calls) if calls else None,
            "attn_calls_per_step": len(calls) / steps}


def attention_only(contexts: list[int], modes: list[str], calls: int) -> None:
    """One layer's attention call (backend.forward of one decode token: K/V write, summary update, selection,
    kernel) on SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, float16 cache of random keys, blocks of
    16), one thread, in CPU time (thread_time: a shared machine's waits left out); median of 5 runs of `calls`."""
    import torch

    from loom.attention import build_attention_metadata
    from loom.attention.cpu_paged import CpuPagedBackend
    from loom.attention.sparse import SparseAttentionConfig

    torch.set_num_threads(1)
    print("| context | mode | attention call us (CPU) |\n|---|---|---|")
    for context in contexts:
        num_blocks = context // 16 + 8
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(2, num_blocks, 16, 3, 64, generator=g).to(torch.float16)
        table = list(range(num_blocks))
        prefill = build_attention_metadata([context], [context], [table], 16, torch.device("cpu"))
        step = build_attention_metadata([1], [context + 1], [table], 16, torch.device("cpu"))
        q, k, v = torch.randn(1, 9, 64, generator=g), torch.randn(1, 3, 64, generator=g), torch.randn(1, 3, 64,
                                                                                                      generator=g)
        for mode in modes:
            if mode == "dense-layers":
                continue
            sparse = SparseAttentionConfig(topk=int(mode.split("-")[1])) if mode.startswith("topk-") else None
            backend = CpuPagedBackend(True, sparse)
            if sparse is not None:  # the summaries of the prompt's blocks, as a prefill would leave them
                keys = cache[0].view(-1, 3, 64)[:context]
                backend.sparse.record_keys(cache, keys, prefill.slot_mapping, False)
            runs = []
            for _ in range(5):
                t = time.thread_time()
                for _ in range(calls):
                    backend.forward(q, k, v, cache, step, 0.125, None)
                runs.append((time.thread_time() - t) / calls * 1e6)
            print(f"| {context} | {mode} | {statistics.median(runs):.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--modes", nargs="+", default=["dense", "dense-layers", "topk-16", "topk-32", "topk-64"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the timed decode steps (default: every core; prefill uses every core)")
    parser.add_argument("--attention-only", action="store_true",
                        help="time one layer's attention call on synthetic caches instead (one thread, CPU time)")
    parser.add_argument("--one", nargs=2, metavar=("CONTEXT", "MODE"), help="run one configuration (internal)")
    args = parser.parse_args()
    if args.attention_only:
        attention_only(args.contexts, args.modes, calls=50)
        return
    if args.one:
        print(json.dumps(run_one(int(args.one[0]), args.one[1], args.steps, args.warmup, seed=0,
                                  threads=args.threads)), flush=True)
        return
    results: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.reps):
        for context in args.contexts:
            for mode in args.modes:
                env = dict(os.environ)
                if mode == "dense-layers":
                    env["LOOM_DECODE_STEP"] = "0"
                out = subprocess.run([sys.executable, __file__, "--one", str(context), mode, "--steps",
                                      str(args.steps), "--warmup", str(args.warmup)]
                                     + ([] if args.threads is None else ["--threads", str(args.threads)]),
                                     env=env, capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["load1"] = os.getloadavg()[0]
                print(json.dumps(row), flush=True)
                results.setdefault((context, mode), []).append(row)
    print("\n| context | mode | step ms, wall (median of reps; each rep a median of steps) | step ms, CPU | "
          "attention call ms | calls/step |")
    print("|---|---|---|---|---|---|")
    for (context, mode), rows in sorted(results.items()):
        steps = [r["step_ms"] for r in rows]
        attn = [r["attn_call_ms"] for r in rows if r["attn_call_ms"] is not None]
        attn_s = f"{statistics.median(attn):.3f}" if attn else "-"
        cpu = statistics.median(r["step_cpu_ms"] for r in rows)
        print(f"| {context} | {mode} | {statistics.median(steps):.2f} ({', '.join(f'{s:.2f}' for s in steps)}) | "
              f"{cpu:.2f} | {attn_s} | {rows[0]['attn_calls_per_step']:.0f} |")


if __name__ == "__main__":
    main()
