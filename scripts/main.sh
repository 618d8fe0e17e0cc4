#!/usr/bin/env bash
# The main job: set up, build, then
#  1. convert the real stories260K checkpoint (llama2.c format, ../shared) to .llmq (Q8_0) and
#     generate a story from it;
#  2. convert the real chat model SmolLM2-135M-Instruct (GGUF, fetched by setup) to .llmq and
#     ask it a question with its chat template;
#  3. the same with Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M: a coding question) and
#     continue a story with the base model Gemma-3-270M (gemma3, Q4_K_M; it has no chat template).
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

build/llmq-convert models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -o models/qwen2.5-coder-0.5b-instruct.llmq --force
build/llmq-run -m models/qwen2.5-coder-0.5b-instruct.llmq --chat -p "Write a Python function that checks whether a string is a palindrome." \
  --temp 0 -n 200
build/llmq-convert models/gemma-3-270m-q4_k_m.gguf -o models/gemma-3-270m.llmq --force
build/llmq-run -m models/gemma-3-270m.llmq -p "Once upon a time, in a small village by the sea," -n 80 --temp 0
