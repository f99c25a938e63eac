"""Speculative decoding on and off in one process, alternated prompt by prompt, so the machine's drift (+-20%
within minutes on the shared 2-core machines) hits both halves alike; per-prompt ratios and their median.

    .venv/bin/python benchmarks/spec_ab.py --speculative-method suffix --prompts mtbench --mtbench-file question.jsonl
    .venv/bin/python benchmarks/spec_ab.py --speculative-method suffix --k 8 --baseline-tree-width 1 --tree-width 3
    .venv/bin/python benchmarks/spec_ab.py --model 1.5b.gguf --speculative-method draft_model \\
        --speculative-model 0.5b.gguf --k 3 --num-prompts 3 --max-tokens 96

With --baseline-tree-width, "off" is speculation with that many branches (a chain: 1) instead of no
speculation, so tree candidates are compared with the chain they extend. Prompts as in benchmarks/spec_bench.py (code-edit prompts, or MT-bench first turns). Both engines run with
prefix caching off, so no prompt is served from an earlier one's cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from spec_bench import load_texts

    from loom import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target model (default: the bundled SmolLM2)")
    ap.add_argument("--speculative-method", required=True, choices=["ngram", "suffix", "draft_model"])
    ap.add_argument("--speculative-model")
    ap.add_argument("--speculative-quantization")
    ap.add_argument("--speculative-draft-vocab-size", type=int)
    ap.add_argument("--speculative-draft-vocab-corpus")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompts", default="code", choices=["code", "mtbench"])
    ap.add_argument("--mtbench-file")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree-width", type=int, default=1, help="--speculative-tree-width of the 'on' engine")
    ap.add_argument("--baseline-tree-width", type=int, default=None,
                    help="the 'off' engine speculates too, with this tree width (default: no speculation)")
    args = ap.parse_args()

    common = {"num_threads": args.threads, "enable_prefix_caching": False}
    if args.model:
        common["model"] = args.model
    spec = dict(speculative_method=args.speculative_method, num_speculative_tokens=args.k)
    if args.speculative_model:
        spec["speculative_model"] = args.speculative_model
    if args.speculative_draft_vocab_size:
        spec["speculative_draft_vocab_size"] = args.speculative_draft_vocab_size
    if args.speculative_draft_vocab_corpus:
        spec["speculative_draft_vocab_corpus"] = args.speculative_draft_vocab_corpus
    if args.speculative_quantization:
        spec["speculative_quantization"] = args.speculative_quantization
    baseline = {} if args.baseline_tree_width is None else dict(spec, speculative_tree_width=args.baseline_tree_width)
    engines = {"off": LLM(**common, **baseline), "on": LLM(**common, **spec, speculative_tree_width=args.tree_width)}
    texts = load_texts(args.prompts, args.mtbench_file, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up: kernel builds and first-call costs
        llm.chat([[{"role": "user", "content": "Say hi."}]], SamplingParams(temperature=0.0, max_tokens=8))
    totals = {"off": [0, 0.0], "on": [0, 0.0]}
    decode_ratios, same = [], 0
    for i, text in enumerate(texts):
        conv = [[{"role": "user", "content": text}]]
        row = {}
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):  # alternate which goes first
            t0 = time.perf_counter()
            out = engines[name].chat(conv, params)[0]
            dt = time.perf_counter() - t0
            ids = out.outputs[0].token_ids
            ttft = out.metrics.first_token_time - out.metrics.arrival_time
            row[name] = (ids, (len(ids) - 1) / max(dt - ttft, 1e-9))
            totals[name][0] += len(ids)
            totals[name][1] += dt
        same += row["on"][0] == row["off"][0]
        decode_ratios.append(row["on"][1] / row["off"][1])
        print(f"{i}: decode {row['off'][1]:.1f} -> {row['on'][1]:.1f} tok/s ({decode_ratios[-1]:.2f}x)", flush=True)
    stats = engines["on"].engine.get_stats()
    off, on = (totals[n][0] / totals[n][1] for n in ("off", "on"))
    label = "" if args.baseline_tree_width is None else f"tree width {args.baseline_tree_width} -> {args.tree_width}, "
    print(f"{label}{args.speculative_method} k={args.k} on {args.prompts} ({len(texts)} prompts): output tok/s {off:.1f} -> "
          f"{on:.1f} = {on / off:.3f}x; per-prompt decode median {statistics.median(decode_ratios):.3f}x "
          f"(min {min(decode_ratios):.2f}, max {max(decode_ratios):.2f}); identical outputs {same}/{len(texts)}")
    if stats.spec_num_draft_tokens:
        print(f"  acceptance {stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens:.1%}, tokens per verify "
              f"pass {1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts:.2f}, "
              f"{stats.spec_num_drafts} passes with drafts")
    if args.tree_width > 1:
        sched = engines["on"].engine.scheduler.spec_stats
        print(f"  branches per verify pass {sched.num_branches / max(sched.num_drafts, 1):.2f}, kept from a branch "
              f"other than the first in {sched.num_branch_wins} of {sched.num_drafts} passes")


if __name__ == "__main__":
    main()
