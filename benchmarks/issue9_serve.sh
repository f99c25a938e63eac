#!/usr/bin/env bash
# Issue 9 serving run (benchmarks/BENCHMARKS.md, "Issue 9"): loom serve, then llama-server, one at a time, 2 threads.
# Env: PEERS_BIN (llama.cpp binaries, default benchmarks/peers/build/bin), LOOM_SERVE_ARGS (extra loom serve flags).
set -x
cd "$(dirname "$0")/.."
MODEL=$(.venv/bin/python -c 'from loom.model.loader import default_model_path; print(default_model_path())')
ARGS="--dataset sharegpt --num-prompts 128 --max-concurrency 16 --goodput ttft:2000 tpot:200 --no-tqdm"
wait_up() { for _ in $(seq 120); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; return 1; }
uptime
.venv/bin/loom --log-level WARNING serve --num-threads 2 --port 8000 ${LOOM_SERVE_ARGS:-} & PID=$!
wait_up http://127.0.0.1:8000/v1/models && .venv/bin/loom bench serve --label loom $ARGS
kill $PID; wait $PID
uptime
${PEERS_BIN:-benchmarks/peers/build/bin}/llama-server -m $MODEL -t 2 -c 32768 -np 16 --port 8081 >/dev/null 2>&1 & PID=$!
wait_up http://127.0.0.1:8081/v1/models && .venv/bin/loom bench serve --base-url http://127.0.0.1:8081 --label llama-server $ARGS
kill $PID; wait $PID
uptime
