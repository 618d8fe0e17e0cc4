#!/bin/bash
# Builds bench/kld_llamacpp.cpp against llmq's build/ and the peer llama.cpp (the CPU build of
# the llama-cpp-python 0.3.36 sdist in build-peer/, as ../shared/LIBRARIES.md describes), then
# runs it on a GGUF and its llmq conversion:
#   bench/kld_llamacpp.sh GGUF [CTX=512] [CHUNKS=20]
# Output: one JSON line (bench/kld_llamacpp.cpp says what it holds).
set -euo pipefail
cd "$(dirname "$0")/.."
PEER=${PEER:-build-peer/llama_cpp_python-0.3.36/vendor/llama.cpp}
PEER_LIB=${PEER_LIB:-build-peer/cpu/bin}
[ -f "$PEER/include/llama.h" ] && [ -f "$PEER_LIB/libllama.so" ] || { echo "build the peer first (../shared/LIBRARIES.md)" >&2; exit 2; }
mkdir -p bench/tmp
g++ -std=c++20 -O2 -I. -I"$PEER/include" -I"$PEER/ggml/include" bench/kld_llamacpp.cpp -o bench/tmp/kld_llamacpp \
  build/libllmq_core.a -L"$PEER_LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$(realpath "$PEER_LIB")" -lxxhash -lfmt -lpthread
[ "${KLD_BUILD_ONLY:-0}" = 1 ] && exit 0  # bench/kquant_quality.sh: just the tool
gguf=$1
llmq=bench/tmp/$(basename "$gguf" .gguf).llmq
build/llmq-convert "$gguf" -o "$llmq" -f --no-progress 2>/dev/null
bench/tmp/kld_llamacpp "$gguf" "$llmq" ../shared/text/wikitext2-test.txt "${2:-512}" "${3:-20}" 2
