"""Draft-model speculation in one process: the target alone and the target with its draft, alternated prompt
by prompt on the code-edit prompts (benchmarks/spec_bench.py), so the machine's drift hits both alike.

    .venv/bin/python benchmarks/draft_ab.py [k] [num_prompts] [draft quantization, e.g. w4a16]

Needs the Qwen2.5-Coder 0.5B and 1.5B GGUFs (shared/DESIGN.md) in $QWEN_DIR (default ~/.cache/loom/qwen).
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_bench import prompts
from loom import LLM, SamplingParams
Q = os.environ.get("QWEN_DIR", os.path.expanduser("~/.cache/loom/qwen")) + "/"
K = int(sys.argv[1]) if len(sys.argv) > 1 else 3
N = int(sys.argv[2]) if len(sys.argv) > 2 else 3
plain = LLM(model=Q + "qwen2.5-coder-1.5b-instruct.gguf", num_threads=2, enable_prefix_caching=False)
draft = LLM(model=Q + "qwen2.5-coder-1.5b-instruct.gguf", num_threads=2, speculative_method="draft_model",
            speculative_model=Q + "qwen2.5-coder-0.5b-instruct.gguf", num_speculative_tokens=K,
            speculative_quantization=(sys.argv[3] if len(sys.argv) > 3 else None),
            enable_prefix_caching=False)
hi = [[{"role": "user", "content": "Say hi."}]]
for l in (plain, draft): l.chat(hi, SamplingParams(temperature=0.0, max_tokens=8))
params = SamplingParams(temperature=0.0, max_tokens=96)
ratios = []
for i, text in enumerate(prompts(N)):
    conv = [[{"role": "user", "content": text}]]
    res = {}
    for name, l in (("plain", plain), ("draft", draft)):
        t = time.perf_counter(); o = l.chat(conv, params)[0]; dt = time.perf_counter() - t
        ttft = o.metrics.first_token_time - o.metrics.arrival_time
        n = len(o.outputs[0].token_ids)
        res[name] = (o.outputs[0].token_ids, dt, (n - 1) / (dt - ttft), n / dt)
    same = res["plain"][0] == res["draft"][0]
    ratios.append((res["draft"][2] / res["plain"][2], res["draft"][3] / res["plain"][3]))
    print(i, "same" if same else "DIFF", "decode tok/s plain %.2f draft %.2f (%.2fx); output tok/s %.2f vs %.2f (%.2fx)" % (
        res["plain"][2], res["draft"][2], ratios[-1][0], res["plain"][3], res["draft"][3], ratios[-1][1]), flush=True)
s = draft.engine.get_stats()
print("k", K, "acceptance", s.spec_num_accepted_tokens / max(1, s.spec_num_draft_tokens), "tokens/pass",
      1 + s.spec_num_accepted_tokens / max(1, s.spec_num_drafts))
print("median decode ratio %.2f, output ratio %.2f" % (statistics.median(r[0] for r in ratios), statistics.median(r[1] for r in ratios)))
