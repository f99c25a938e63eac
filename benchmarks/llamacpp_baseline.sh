#!/usr/bin/env bash
# llama.cpp baseline on the default GGUF: llama-bench pp512/tg128 and llama-batched-bench
# (32 sequences, 128-token prompts, 128 new tokens), 2 threads. Needs benchmarks/install_peers.sh first.
# Output goes to stdout and benchmarks/results/llamacpp-<timestamp>.txt. Not run by tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/benchmarks/peers/build/bin"
THREADS="${THREADS:-2}"
MODEL="${MODEL:-$("$ROOT/.venv/bin/python" -c 'from loom.model.loader import default_model_path; print(default_model_path())')}"
OUT="$ROOT/benchmarks/results/llamacpp-$(date +%Y%m%d-%H%M%S).txt"
mkdir -p "$(dirname "$OUT")"
{
  echo "# $(lscpu | grep 'Model name' | sed 's/  */ /g'); nproc $(nproc); load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# llama-cpp-python sdist $(cat "$ROOT/benchmarks/peers/build/LLAMA_CPP_PYTHON_VERSION" 2>/dev/null || echo '?')"
  set -x
  "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 3
  # 32 sequences x (128 prompt + 128 generated) = 8192 cells of KV, the model's context length
  "$BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,32
} 2>&1 | tee "$OUT"
echo "wrote $OUT"
