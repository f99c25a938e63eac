"""loom's one-call C decode step against the per-layer path in one process, alternated generation by
generation (the machine's drift hits both alike): greedy decode tok/s medians, and whether the tokens match.

    .venv/bin/python benchmarks/decode_path_ab.py --model ~/.cache/loom/qwen/qwen2.5-coder-1.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    from loom import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    ap.add_argument("--rounds", type=int, default=4, help="generations per path")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(model=args.model, num_threads=args.threads, enable_prefix_caching=False)
    inner = llm.engine.runner.model.model
    step = inner.decode_step
    if step is None:
        raise SystemExit("the C decode step does not serve this model: nothing to compare")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = "def fib(n):\n    "
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    speeds: dict[str, list[float]] = {"c-step": [], "per-layer": []}
    tokens: dict[str, list[int]] = {}
    for i in range(args.rounds):
        for name in (("c-step", "per-layer") if i % 2 == 0 else ("per-layer", "c-step")):
            inner.decode_step = step if name == "c-step" else None
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            m = out.metrics
            speeds[name].append((len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time))
            tokens.setdefault(name, out.outputs[0].token_ids)
    inner.decode_step = step
    print(f"same tokens: {tokens['c-step'] == tokens['per-layer']}")
    for name, v in speeds.items():
        print(f"{name}: decode median {statistics.median(v):.2f} tok/s ({', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
