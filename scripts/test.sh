#!/usr/bin/env bash
# Set up, build, and run every test (CTest: Catch2 cases, including the ones that run the real
# tools on the real models in ../shared). Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd build
ctest --output-on-failure -j"$(nproc 2>/dev/null || echo 2)" "$@"
