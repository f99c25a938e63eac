"""Beam search: loom against transformers' beam search on the same weights, and the KV blocks beams share.

    .venv/bin/python benchmarks/beam_bench.py [--width 4] [--max-tokens 64] [--prompts 4] [--repeats 3]
                                              [--quantization none|gguf]

Both run float32 on the bundled model (loom dequantized by default, as transformers reads the GGUF; `gguf`
runs loom on the packed Q4_1 weights, where identity is not promised), one prompt at a
time, greedy beam search with transformers' defaults (length_penalty 1, early_stopping False). Reports the
median seconds per search of each, whether the sequences are identical, and, for loom, the KV blocks the
beams held at the widest point against what unshared copies would need. Run each configuration on a quiet
machine: two processes sharing the cores slow each other unevenly.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPTS = [
    "The history of the Roman empire begins with",
    "def quicksort(xs):",
    "Write a short poem about the sea.",
    "The best way to learn a language is",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="none",
                    help="loom's weights: none (dequantized float32, the transformers-parity path) or gguf (packed)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom import LLM, BeamSearchParams
    from loom.model.loader import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", quantization=args.quantization)
    engine = llm.engine
    eos = sorted(engine.eos_token_ids)
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens)
    hf_times, loom_times, same, peak_held, peak_unshared = [], [], 0, 0, 0
    for prompt in PROMPTS[: args.prompts]:
        ids = tok.encode(prompt)
        for _ in range(args.repeats):
            t = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), num_beams=args.width, num_return_sequences=args.width,
                                  do_sample=False, max_new_tokens=args.max_tokens, eos_token_id=eos,
                                  pad_token_id=eos[0])
            hf_times.append(time.perf_counter() - t)
        reference = []
        for seq in out.tolist():
            gen = seq[len(ids):]
            end = next((i + 1 for i, x in enumerate(gen) if x in eos), len(gen))
            reference.append(gen[:end])
        for _ in range(args.repeats):
            engine.add_request("b", ids, params)
            manager = engine.scheduler.kv_cache_manager
            t = time.perf_counter()
            result = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    result = o
                tables = [manager.get_block_ids(r.request_id) for r in engine.scheduler.running]
                held = len({b for table in tables for b in table})
                if held > peak_held:
                    peak_held, peak_unshared = held, sum(len(table) for table in tables)
            loom_times.append(time.perf_counter() - t)
        same += [c.token_ids for c in result.outputs] == reference
    flags = " ".join(f for f in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
                     if f.startswith(("avx", "amx", "fma")))
    print(f"loom --quantization {args.quantization}; width {args.width}, max_tokens {args.max_tokens}, "
          f"{args.prompts} prompts x {args.repeats}; "
          f"{torch.get_num_threads()} threads; flags: {flags}")
    print(f"transformers beam search: median {statistics.median(hf_times):.3f} s per search")
    print(f"loom beam search:         median {statistics.median(loom_times):.3f} s per search "
          f"({statistics.median(hf_times) / statistics.median(loom_times):.2f}x transformers)")
    print(f"identical sequences: {same} / {args.prompts}")
    print(f"KV blocks at the widest step: {peak_held} held, {peak_unshared} without sharing")


if __name__ == "__main__":
    main()
