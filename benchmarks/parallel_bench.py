"""Tensor / pipeline parallelism on this machine: decode throughput and single-stream TPOT of each layout, each in a
process of its own (alternated, `--repeats` rounds), and each pipeline stage's bubble fraction.

    .venv/bin/python benchmarks/parallel_bench.py [--quantization gguf] [--batch 16] [--input-len 64] \
        [--output-len 64] [--repeats 2] [--layouts 1x1,2x1,1x2:1,1x2:2,1x2:4]

A layout is TPxPP[:micro-batches]. Threads: the machine's cores shared by the ranks (the engine's default), so every
layout uses the same cores. Prints a markdown table (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def _prompts(tokenizer, batch: int, input_len: int) -> list[list[int]]:
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife. However little known the feelings or views of such a man may be ") * 8
    ids = tokenizer.encode(text)
    return [[ids[0] + 0] + ids[1 + i : input_len + i] for i in range(batch)]


def run_one(layout: str, quantization: str, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    """Measure one layout in this process (its workers are its children)."""
    from loom import LLM, SamplingParams

    shape, _, micro = layout.partition(":")
    tp, pp = (int(x) for x in shape.split("x"))
    llm = LLM(quantization=quantization, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              pipeline_microbatches=int(micro or 2), max_num_seqs=batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = _prompts(llm.tokenizer, batch, input_len)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.runner
    busy0, step0 = runner.pipeline_busy_s, runner.pipeline_step_s
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    busy, step = runner.pipeline_busy_s - busy0, runner.pipeline_step_s - step0
    single = []
    for _ in range(2):
        out = llm.generate([prompts[0]], params, use_tqdm=False)[0]
        m = out.metrics
        single.append((m.last_token_time - m.first_token_time) / (output_len - 1))
    llm.engine.shutdown()
    return {"batch_output_tok_s": batch * output_len / batch_s, "single_tpot_ms": 1e3 * min(single),
            "stage0_bubble": (1 - busy / step) if step else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", default="1x1,2x1,1x2:1,1x2:2,1x2:4")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one layout, in a child process
    ns = parser.parse_args()
    if ns.run is not None:
        print(json.dumps(run_one(ns.run, ns.quantization, ns.batch, ns.input_len, ns.output_len)))
        return
    layouts = ns.layouts.split(",")
    results: dict[str, list[dict[str, float]]] = {layout: [] for layout in layouts}
    env = {**os.environ, "LOOM_PIPELINE_PROFILE": "1"}
    for _ in range(ns.repeats):
        for layout in layouts:
            proc = subprocess.run([sys.executable, __file__, "--run", layout, "--quantization", ns.quantization,
                                   "--batch", str(ns.batch), "--input-len", str(ns.input_len),
                                   "--output-len", str(ns.output_len)], capture_output=True, text=True, env=env,
                                  check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            stages = re.findall(r"pipeline stage (\d+) rank \d+: busy ([\d.]+) s of ([\d.]+) s", proc.stderr)
            for stage, busy, step in stages:  # whole-run figures of the later stages (warm-up included)
                row[f"stage{stage}_bubble"] = 1 - float(busy) / float(step) if float(step) else 0.0
            results[layout].append(row)
    print(f"| layout (TPxPP:micro-batches) | batch {ns.batch} x ({ns.input_len} + {ns.output_len}) output tok/s | "
          "single-stream TPOT ms | bubble: stage 0 / last stage |")
    print("|---|---|---|---|")
    for layout, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}
        bubbles = [v for k, v in sorted(med.items()) if k.endswith("_bubble") and k.startswith("stage")]
        bubble = " / ".join(f"{b:.0%}" for b in bubbles) if "x1" not in layout.split(":")[0][-2:] else "-"
        print(f"| {layout} | {med['batch_output_tok_s']:.1f} | {med['single_tpot_ms']:.2f} | {bubble} |")


if __name__ == "__main__":
    main()
