#!/usr/bin/env bash
# Set up, build, and run every test (CTest: Catch2 cases, including the ones that run the real
# tools on the real models in ../shared). Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd build
ctest --output-on-failure -j"$(nproc 2>/dev/null || echo 2)" "$@"

# The server and the converter it calls, built with AddressSanitizer + UBSan, through the same
# end-to-end server tests (a sanitizer report in the server's log fails them).
# LLMQ_SKIP_SANITIZE=1 skips this stage.
if [ "${LLMQ_SKIP_SANITIZE:-0}" != "1" ]; then
  cd ..
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLLMQ_SANITIZE=ON -DLLMQ_BUILD_TESTS=OFF >/dev/null
  cmake --build build-asan -j"$(nproc 2>/dev/null || echo 2)" --target llmq-server llmq-convert
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  BUILD_DIR="$PWD/build" LLMQ_BIN_DIR="$PWD/build-asan" LLMQ_SHARED_DIR="${LLMQ_SHARED:-$PWD/../shared}" \
    LLMQ_MODELS_DIR="$PWD/models" bash tests/server/run.sh test_openai.py test_load.py -k "not throughput"
fi
