#!/usr/bin/env bash
# The main job: set up, build, convert the real stories260K checkpoint to .llmq (Q8_0) and
# generate text from it on the CPU.
# Usage: scripts/main.sh [prompt]      (LLMQ_SHARED overrides the data folder, default ../shared)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
shared=${LLMQ_SHARED:-../shared}
src=$shared/models/stories260K
mkdir -p models
build/llmq-convert "$src/stories260K.bin" --tokenizer "$src/tok512.bin" --type q8_0 \
  -o models/stories260K-q8_0.llmq --force
build/llmq-run -m models/stories260K-q8_0.llmq -p "${1:-Once upon a time}" -n 128 --temp 0
