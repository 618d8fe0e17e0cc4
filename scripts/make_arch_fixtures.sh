#!/usr/bin/env bash
# Regenerates tests/fixtures/transformers/ (scripts/make_arch_fixtures.py) in a venv of its own
# with torch and Hugging Face transformers (about 5 GB; not needed to build or test llmq).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMQ_TORCH_VENV:-.venv-torch}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch transformers safetensors
fi
"$VENV/bin/python" scripts/make_arch_fixtures.py tests/fixtures/transformers "${LLMQ_SHARED_DIR:-../shared}/models/stories260K/tok512.bin"
