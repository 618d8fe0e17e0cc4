#!/bin/bash
# Issue 9's before/after table: SmolLM2-135M-Instruct in every CPU weight type, prefill of a
# 512-token prompt and decode of 128 tokens at -t THREADS, with llmq-bench's measured read
# bandwidth. "before" is llmq-bench built from an older commit (BEFORE_BIN, e.g. a42a903, the
# last commit before the SIMD kernels); "after" is this tree's build/llmq-bench.
#
#   bench/cpu_speed.sh [THREADS] [BEFORE_BIN]      (run on a quiet machine; JSON lines to stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
T=${1:-2}
BEFORE=${2:-}
GGUF=models/smollm2-135m-instruct-q4_1.gguf
mkdir -p bench/tmp
for type in q4_1 q8_0 q4_0 f16 bf16; do
  m=bench/tmp/smollm2-$type.llmq
  if [ ! -f "$m" ]; then
    if [ $type = q4_1 ]; then build/llmq-convert $GGUF -o "$m" --no-progress >/dev/null
    else build/llmq-convert $GGUF --type $type -o "$m" --no-progress >/dev/null; fi
  fi
  if [ -n "$BEFORE" ]; then
    echo "{\"which\": \"before\", \"type\": \"$type\", \"bench\": $("$BEFORE" -m "$m" -t "$T" -p 512 -n 128 -r 3 | tr -d '\n')}"
  fi
  echo "{\"which\": \"after\", \"type\": \"$type\", \"bench\": $(build/llmq-bench -m "$m" -t "$T" -p 512 -n 128 -r 3 | tr -d '\n')}"
done
