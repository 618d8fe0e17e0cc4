#!/usr/bin/env bash
# Installs what llmq needs on Debian 12 (as root, or with sudo) and builds it into build/.
# Usage: scripts/setup.sh            (idempotent; safe to run again)
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake pkg-config git catch2 libsentencepiece-dev nlohmann-json3-dev
      libcli11-dev libfmt-dev libxxhash-dev libcpp-httplib-dev libopenmpi-dev openmpi-bin iproute2 python3 python3-pip python3-venv chromium chromium-driver)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

bash scripts/fetch_models.sh all  # SmolLM2, Qwen2.5-Coder-0.5B, Gemma-3-270M (about 800 MB)

bash scripts/fetch_xgrammar.sh    # structured outputs: xgrammar's C++ core, into third_party/

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${LLMQ_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
echo "setup: built into build/"
