#!/usr/bin/env bash
# Issue 9 side-by-side runs (benchmarks/BENCHMARKS.md, "Issue 9"): llama.cpp and loom, back to back, 2 threads.
set -x
cd "$(dirname "$0")/.."
MODEL=$(.venv/bin/python -c 'from loom.model.loader import default_model_path; print(default_model_path())')
lscpu | grep -E "Model name|Flags" | cut -c1-400
uptime
benchmarks/peers/build/bin/llama-bench -m $MODEL -t 2 -p 512 -n 128 -r 3
.venv/bin/loom --log-level WARNING bench latency --input-len 512 --output-len 128 --num-threads 2 --backend loom --bandwidth-gbs ${BANDWIDTH_GBS:-22.5}
.venv/bin/loom --log-level WARNING bench latency --input-len 128 --output-len 128 --num-threads 2 --backend loom --bandwidth-gbs ${BANDWIDTH_GBS:-22.5}
uptime
benchmarks/peers/build/bin/llama-batched-bench -m $MODEL -t 2 -c 8192 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 32 2>&1 | grep -E "^\|"
.venv/bin/loom --log-level WARNING bench throughput --dataset synthetic --num-prompts 32 --input-len 128 --output-len 128 --num-threads 2 --backend loom --no-tqdm
uptime
