#!/bin/sh
# Builds the CPU kernel lab against build-simd/libllmq_core.a (build that first:
# cmake --build build-simd -j2 --target llmq_core).
set -e
cd "$(dirname "$0")/../.."
mkdir -p build-simd/dev
g++ -std=c++20 -O2 -I. dev/cpu/bench_matmul.cpp -o build-simd/dev/bench_matmul \
  build-simd/libllmq_core.a -lfmt $(pkg-config --libs sentencepiece libxxhash) -lpthread
g++ -std=c++20 -O2 -I. dev/cpu/bench_attn.cpp -o build-simd/dev/bench_attn \
  build-simd/libllmq_core.a -lfmt $(pkg-config --libs sentencepiece libxxhash) -lpthread
g++ -std=c++20 -O2 dev/cpu/bench_peak.cpp -o build-simd/dev/bench_peak
g++ -std=c++20 -O2 -I. dev/cpu/geglu_error.cpp -o build-simd/dev/geglu_error \
  build-simd/libllmq_core.a -lfmt $(pkg-config --libs sentencepiece libxxhash) -lpthread
