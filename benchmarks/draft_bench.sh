#!/usr/bin/env bash
# Draft-model speculation, Qwen2.5-Coder-0.5B drafting for the 1.5B (issue 10's second target), loom and
# llama.cpp side by side on the same code-edit prompts, greedy, 2 threads, one configuration at a time.
#
# Usage:  bash benchmarks/draft_bench.sh [num_prompts] [max_tokens] [k]
# Needs:  the two GGUFs (shared/DESIGN.md) in $QWEN_DIR (default ~/.cache/loom/qwen), the llama.cpp peers
#         (benchmarks/install_peers.sh).
# Options: $LOOM_DRAFT_ARGS, added to loom's draft run (e.g. "--speculative-quantization w4a16
#          --speculative-draft-vocab-size 32768").
# Output: $OUT (default /tmp/draft_bench): loom JSONs and llama.cpp logs; a summary on stdout.
set -euo pipefail
N="${1:-5}"; MAXTOK="${2:-128}"; K="${3:-3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QWEN_DIR="${QWEN_DIR:-$HOME/.cache/loom/qwen}"
TARGET="$QWEN_DIR/qwen2.5-coder-1.5b-instruct.gguf"; DRAFT="$QWEN_DIR/qwen2.5-coder-0.5b-instruct.gguf"
OUT="${OUT:-/tmp/draft_bench}"; mkdir -p "$OUT"
PY="$ROOT/.venv/bin/python"; BIN="$ROOT/benchmarks/peers/build/bin"
lscpu | grep -o 'avx512[a-z_0-9]*\|avx2\|fma\|f16c' | sort -u | tr '\n' ' '; echo

"$PY" "$ROOT/benchmarks/spec_bench.py" --model "$TARGET" --num-prompts "$N" --print-prompts > "$OUT/prompts.jsonl"
"$PY" "$ROOT/benchmarks/spec_bench.py" --model "$TARGET" --num-prompts "$N" --max-tokens "$MAXTOK" \
  --out "$OUT/plain.json" 2>&1 | grep -v -i warn | tail -2
"$PY" "$ROOT/benchmarks/spec_bench.py" --model "$TARGET" --num-prompts "$N" --max-tokens "$MAXTOK" \
  --speculative-method draft_model --speculative-model "$DRAFT" --k "$K" ${LOOM_DRAFT_ARGS:-} --out "$OUT/draft.json" 2>&1 | grep -v -i warn | tail -2
"$PY" "$ROOT/benchmarks/spec_bench.py" --compare "$OUT/plain.json" "$OUT/draft.json"

# llama.cpp: the same templated prompts; plain decode from llama-bench, draft mode from llama-speculative-simple
"$BIN/llama-bench" -m "$TARGET" -t 2 -p 0 -n "$MAXTOK" -r 2 2>/dev/null | grep -E "tg|model"
i=0
while IFS= read -r line; do
  i=$((i + 1))
  prompt="$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1]), end="")' "$line")"
  "$BIN/llama-speculative-simple" -m "$TARGET" -md "$DRAFT" -t 2 -td 2 -p "$prompt" -n "$MAXTOK" \
    --spec-type draft-simple --spec-draft-n-max "$K" --spec-draft-n-min 0 --temp 0 -c 4096 > "$OUT/llama_spec_$i.log" 2>&1 || true
  grep -E "decoded|accept" "$OUT/llama_spec_$i.log" | tr '\n' ' '; echo
done < "$OUT/prompts.jsonl"
