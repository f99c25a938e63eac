#!/usr/bin/env bash
# Build the llama.cpp peer binaries (llama-bench, llama-batched-bench, llama-server, llama-speculative-simple) from the
# source distribution of llama-cpp-python, which vendors a pinned llama.cpp tree.
#
# Usage:  nice -n 19 bash benchmarks/install_peers.sh [-j N]
# Env:    LLAMA_CPP_PYTHON_VERSION (pin, default below), PIP (pip executable), PEERS_BUILD_DIR,
#         GGML_NATIVE (default ON), PEERS_CMAKE_FLAGS (extra cmake flags) and PEERS_TARGETS (the executables to
#         build, default all six below). On a CPU whose AMX llama.cpp's native
#         build uses but the VM does not grant (every prompt-processing run segfaulted on a Sapphire Rapids-class
#         VM, 2026-12-02), build without it:
#           GGML_NATIVE=OFF PEERS_CMAKE_FLAGS="-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
#           PEERS_BUILD_DIR=benchmarks/peers/build-noamx bash benchmarks/install_peers.sh
# Output: benchmarks/peers/build/bin/{llama-bench,llama-batched-bench,llama-server,llama-speculative-simple,
#         llama-quantize,llama-perplexity}; the converter is benchmarks/peers/build/src/convert_hf_to_gguf.py
# Never run from tests: it takes minutes on two cores.
set -euo pipefail

PIN="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS=2
if [[ "${1:-}" == "-j" ]]; then JOBS="$2"; fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
BUILD_DIR="${PEERS_BUILD_DIR:-$ROOT/benchmarks/peers/build}"
SRC_DIR="$BUILD_DIR/src"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [[ -f "$BUILD_DIR/LLAMA_CPP_PYTHON_VERSION" && "$(cat "$BUILD_DIR/LLAMA_CPP_PYTHON_VERSION")" == "$PIN" && -d "$SRC_DIR" ]]; then
  echo "[install_peers] llama.cpp of llama-cpp-python==$PIN already unpacked; incremental build"
else
  echo "[install_peers] llama-cpp-python==$PIN sdist -> $SRC_DIR"
  "$PIP" download --no-deps --no-binary :all: --dest "$TMP" "llama-cpp-python==$PIN"
  shopt -s nullglob
  sdists=("$TMP"/llama_cpp_python-*.tar.gz "$TMP"/llama-cpp-python-*.tar.gz)
  if (( ${#sdists[@]} == 0 )); then echo "no sdist downloaded" >&2; exit 1; fi
  tar -xzf "${sdists[0]}" -C "$TMP"
  vendors=("$TMP"/llama*cpp*python-*/vendor/llama.cpp)
  if (( ${#vendors[@]} == 0 )); then echo "no vendor/llama.cpp in the sdist" >&2; exit 1; fi
  VENDOR="${vendors[0]}"

  rm -rf "$SRC_DIR"
  mkdir -p "$BUILD_DIR"
  cp -r "$VENDOR" "$SRC_DIR"
  echo "$PIN" > "$BUILD_DIR/LLAMA_CPP_PYTHON_VERSION"
fi

cmake -S "$SRC_DIR" -B "$BUILD_DIR/cmake" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE="${GGML_NATIVE:-ON}" ${PEERS_CMAKE_FLAGS:-} \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF
TARGETS="${PEERS_TARGETS:-llama-bench llama-batched-bench llama-server llama-speculative-simple llama-quantize llama-perplexity}"
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR/cmake" --config Release -j "$JOBS" --target $TARGETS

mkdir -p "$BUILD_DIR/bin"
for exe in $TARGETS; do
  # llama.cpp's CMakeLists sends every executable to <build>/bin
  cp "$BUILD_DIR/cmake/bin/$exe" "$BUILD_DIR/bin/$exe"
  test -x "$BUILD_DIR/bin/$exe" || { echo "missing $BUILD_DIR/bin/$exe" >&2; exit 1; }
done
# llama.cpp's converter (convert_hf_to_gguf.py, used by `loom bench quant --llama-cpp`) imports sentencepiece for
# Llama-family vocabularies before it falls back to BPE; its gguf-py comes from $SRC_DIR (PYTHONPATH)
"$PIP" install --quiet sentencepiece
echo "[install_peers] done: $(ls "$BUILD_DIR/bin")"
