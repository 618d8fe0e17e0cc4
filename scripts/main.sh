#!/usr/bin/env bash
# The main job: set up, build, then
#  1. convert the real stories260K checkpoint (llama2.c format, ../shared) to .llmq (Q8_0) and
#     generate a story from it;
#  2. convert the real chat model SmolLM2-135M-Instruct (GGUF, fetched by setup) to .llmq and
#     ask it a question with its chat template.
# Usage: scripts/main.sh            (LLMQ_SHARED overrides the data folder, default ../shared)
# Then chat interactively:  build/llmq-run -m models/smollm2-135m-instruct.llmq
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
shared=${LLMQ_SHARED:-../shared}
src=$shared/models/stories260K
mkdir -p models
build/llmq-convert "$src/stories260K.bin" --tokenizer "$src/tok512.bin" --type q8_0 \
  -o models/stories260K-q8_0.llmq --force
build/llmq-run -m models/stories260K-q8_0.llmq -p "Once upon a time" -n 128 --temp 0

build/llmq-convert models/smollm2-135m-instruct-q4_1.gguf -o models/smollm2-135m-instruct.llmq --force
build/llmq-run -m models/smollm2-135m-instruct.llmq --chat -p "Give me three tips for learning to cook." \
  --temp 0.6 --top-p 0.9 --seed 7 -n 200
