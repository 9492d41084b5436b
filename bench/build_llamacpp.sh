#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server (the CPU anchor for bench/cpu.py) from the
# llama-cpp-python source package on the pip index, into $LLAMA_DIR/build/bin (default
# ~/.cache/redlite/llama.cpp). Portable AVX2/FMA build: no -march=native (AVX-512 hosts may set
# LLAMA_AVX512=1 to add it).  Usage: bench/build_llamacpp.sh [jobs]
set -euo pipefail
JOBS="${1:-2}"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.cache/redlite/llama.cpp}"
PIP="${PIP:-pip}"
mkdir -p "$LLAMA_DIR"
cd "$LLAMA_DIR"
if [ -x build/bin/llama-bench ] && [ -x build/bin/llama-server ]; then
  echo "already built: $LLAMA_DIR/build/bin"; exit 0
fi
ls llama_cpp_python-*.tar.gz >/dev/null 2>&1 || \
  "$PIP" download -q --no-deps --no-binary :all: llama-cpp-python -d .
SDIST="$(ls -1 llama_cpp_python-*.tar.gz | sort -V | tail -1)"
SRC="${SDIST%.tar.gz}"
[ -d "$SRC" ] || tar xzf "$SDIST"
EXTRA=()
if [ "${LLAMA_AVX512:-0}" = 1 ]; then EXTRA+=(-DGGML_AVX512=ON); fi
cmake -S "$SRC/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON "${EXTRA[@]}"
cmake --build build -j "$JOBS" --target llama-bench llama-server
ls -la build/bin/llama-bench build/bin/llama-server
