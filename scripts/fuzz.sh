#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang, ASan + UBSan, into build-fuzz/) and runs each
# for SECONDS (default 60), one after the other, single process. Prints per target the
# executions, executions per second, peak memory and any crash; exits 1 if any target crashed.
#   scripts/fuzz.sh [SECONDS] [TARGET...]      (targets: see LLMQ_FUZZ_TARGETS in CMakeLists.txt)
# Inputs each target finds go to build-fuzz/corpus/<target>/ (kept between runs), crashing
# inputs to build-fuzz/artifacts/<target>/, the full log to build-fuzz/logs/<target>.log.
# A fixed crash's input belongs in fuzz/regressions/<target>/ (CTest re-runs it). fuzz/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
ALL=(llmq_file gguf safetensors llama2c tokenizer_spm tokenizer_bpe chat_template server_request structured_output http_request)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL[@]}")
for t in "${TARGETS[@]}"; do
  [[ " ${ALL[*]} " == *" $t "* ]] || { echo "unknown target '$t' (known: ${ALL[*]})" >&2; exit 1; }
done

LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
  -DLLMQ_FUZZ=ON -DLLMQ_BUILD_TESTS=OFF -DLLMQ_CUDA=OFF "${LAUNCHER[@]}" >/dev/null
cmake --build build-fuzz -j"${LLMQ_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}" --target "${TARGETS[@]/#/fuzz-}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p build-fuzz/logs
status=0
printf '%-16s %12s %10s %8s  %s\n' target executions exec/s rss_mb result
for t in "${TARGETS[@]}"; do
  work=build-fuzz/corpus/$t art=build-fuzz/artifacts/$t/
  mkdir -p "$work" "$art" "fuzz/regressions/$t"
  log=build-fuzz/logs/$t.log
  # -timeout: an input running 10 s is a hang; -rss_limit_mb: one allocating 2 GiB a finding.
  set +e
  "build-fuzz/fuzz/fuzz-$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$art" "$work" "fuzz/corpus/$t" "fuzz/regressions/$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
  if [ "$rc" -eq 0 ]; then
    result="ok, no crash"
  else
    status=1
    result="CRASH (exit $rc): $(grep -m1 -E 'ERROR:|runtime error|fuzz invariant|Test unit written' "$log" || true)"
    result+=" -> $(ls -t "$art" | head -1); log $log"
  fi
  printf '%-16s %12s %10s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${rss:-?}" "$result"
done
exit $status
