#!/usr/bin/env bash
# Set up, build, and run every test (CTest: Catch2 cases, including the ones that run the real
# tools on the real models in ../shared). Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd build
ctest --output-on-failure -j"$(nproc 2>/dev/null || echo 2)" "$@"

# Then everything again with AddressSanitizer + UBSan (build-asan/, -O1; a UBSan report stops
# the program, -fno-sanitize-recover=all): the Catch2 suite and the fuzz regression inputs
# (ctest without the server suites, the interactive test, the two cases that pip-install
# Python libraries and the two real-model checks, which run the same code as the small models
# but take minutes at -O1 under the sanitizers, the peak-RSS check (a sanitized binary's memory
# is not the product's), the two-host MPI rehearsal and SmolLM2 under mpirun (the stories260K MPI
# process tests run the same code)), then the end-to-end server tests against the sanitized server and converter
# (a sanitizer report in the server's log fails them). LLMQ_SKIP_SANITIZE=1 skips this stage;
# LLMQ_SANITIZE_SUITE=0 builds and tests only the server and the converter. Timings are printed
# at the end (issue 8: the whole stage must fit CI's 2 cores; bench/RESULTS.md has the numbers).
if [ "${LLMQ_SKIP_SANITIZE:-0}" != "1" ]; then
  cd ..
  t0=$(date +%s)
  suite=${LLMQ_SANITIZE_SUITE:-1}
  # -O1 -g1: quicker to compile than -O2 -g on 2 cores; reports still carry line numbers.
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" \
    -DLLMQ_SANITIZE=ON \
    -DLLMQ_BUILD_TESTS=$([ "$suite" = 1 ] && echo ON || echo OFF) \
    -DLLMQ_SHARED_DIR="${LLMQ_SHARED:-$PWD/../shared}" >/dev/null
  if [ "$suite" = 1 ]; then
    cmake --build build-asan -j"$(nproc 2>/dev/null || echo 2)"
  else
    cmake --build build-asan -j"$(nproc 2>/dev/null || echo 2)" --target llmq-server llmq-convert
  fi
  t1=$(date +%s)
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  # Open MPI's own allocations outlive MPI_Finalize (the ranks under mpirun: tests/test_tp_process.cpp,
  # the server's mpirun test): suppressed by library, tests/lsan_mpi.supp.
  export LSAN_OPTIONS=suppressions=$PWD/tests/lsan_mpi.supp:print_suppressions=0
  if [ "$suite" = 1 ]; then
    (cd build-asan && ctest --output-on-failure -j"$(nproc 2>/dev/null || echo 2)" -LE server \
       -E "interactive_ctrl_c|gguf-py|written by the safetensors library|Qwen2.5-Coder-0.5B GGUF|Gemma-3-270M GGUF|peak RSS|mpi_two_hosts|SmolLM2 under mpirun")
  fi
  t2=$(date +%s)
  BUILD_DIR="$PWD/build" LLMQ_BIN_DIR="$PWD/build-asan" LLMQ_SHARED_DIR="${LLMQ_SHARED:-$PWD/../shared}" \
    LLMQ_MODELS_DIR="$PWD/models" bash tests/server/run.sh test_openai.py test_load.py -k "not throughput"
  t3=$(date +%s)
  echo "sanitizer stage: build $((t1 - t0)) s, ctest $((t2 - t1)) s, server tests $((t3 - t2)) s, total $((t3 - t0)) s"
fi
