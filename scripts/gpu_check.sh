#!/usr/bin/env bash
# Everything a GPU session has to run for issues 4, 6 and 7, in phases that each fit one device
# call (10 minutes). Runs on the GPU machine from the repository root, on the binaries that
# scripts/gpu_pack.sh packed into .gpu/ (carried there: the machine has no network). Each step's
# output goes to $OUT/<phase>/<step>.txt (or .json), a step that fails is recorded and the next
# one runs; $OUT/<phase>/summary.txt lists every step with its exit code and seconds.
#
#   bash scripts/gpu_check.sh tests      # parity: every kernel x type, whole models, TP, server paths
#   bash scripts/gpu_check.sh sanitizer  # compute-sanitizer memcheck over the kernel tests
#   bash scripts/gpu_check.sh bench      # llmq-bench --synthetic llama-2-7b / llama-3-8b x q4_0, q8_0, f16
#   bash scripts/gpu_check.sh tools      # llmq-run (offload, --tp 2, ranks as processes), llmq-server
#   bash scripts/gpu_check.sh train      # bench/train_mem.py: PyTorch's peak vs llmq-mem train
#   DRY=1 bash scripts/gpu_check.sh all  # print the commands only
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
G=$PWD/.gpu
export LD_LIBRARY_PATH=$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LLMQ_SHARED_DIR=$G/shared LLMQ_BIN_DIR=$G/bin
export LLMQ_TEST_TMP=${LLMQ_TEST_TMP:-/tmp/llmq-tests}
S=/tmp/llmq-gpu-stories.llmq
export G S

# step NAME SECONDS CMD...: runs CMD under `timeout`, output to $dir/NAME.txt, one summary line.
step() {
  local name=$1 secs=$2
  shift 2
  if [ "${DRY:-0}" = 1 ]; then
    echo "[$phase] $name: $*"
    return 0
  fi
  local t0=$SECONDS rc
  timeout "$secs" bash -o pipefail -c "$*" >"$dir/$name.txt" 2>&1
  rc=$?
  printf '%-28s rc %-4s %5d s\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$dir/summary.txt"
}

# llmq-server on the GPU: four greedy completions at once (continuous batching), then /metrics.
server_check() {
  "$G/bin/llmq-server" -m "$S" --device cuda --parallel 4 --port 18080 &
  local pid=$! pids=() i p
  for i in $(seq 150); do curl -sf localhost:18080/health >/dev/null && break; sleep 0.2; done
  for p in "Once upon" "The cat" "Lily went" "One day"; do
    curl -s localhost:18080/v1/completions -H 'Content-Type: application/json' \
      -d "{\"prompt\": \"$p\", \"max_tokens\": 32, \"temperature\": 0}" &
    pids+=($!)
  done
  wait "${pids[@]}"
  echo
  curl -s localhost:18080/metrics | grep -E '^llmq_(requests|generated)'
  kill "$pid"
  wait "$pid"
}
export -f server_check

need_model() {
  [ "${DRY:-0}" = 1 ] || [ -f "$S" ] || "$G/bin/llmq-convert" "$G/shared/models/stories260K/stories260K.bin" \
    --tokenizer "$G/shared/models/stories260K/tok512.bin" --type f32 -o "$S" >/dev/null 2>&1
}

run_phase() {
  phase=$1
  dir=$OUT/$phase
  if [ "${DRY:-0}" != 1 ]; then
    mkdir -p "$dir" "$LLMQ_TEST_TMP"
    : >"$dir/summary.txt"
  fi
  case "$phase" in
    tests)
      step nvidia-smi 30 "nvidia-smi; nvidia-smi -q -d CLOCK,MEMORY | head -60"
      step cuda-tests 540 "$G/bin/llmq-tests '[cuda]' -s -r compact | tail -400"
      step tp-process-tests 120 "$G/bin/llmq-tests '[tp_process]'"
      ;;
    sanitizer)
      step memcheck-kernels 540 "compute-sanitizer --tool memcheck --error-exitcode 9 $G/bin/llmq-tests '[cuda]~[model]'"
      ;;
    bench)
      for m in llama-2-7b llama-3-8b; do
        for t in q4_0 q8_0 f16; do
          step "bench-$m-$t" 150 "$G/bin/llmq-bench --device cuda --synthetic $m --type $t -p 512 -n 128 -r 3"
        done
      done
      ;;
    tools)
      need_model
      step run-gpu 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda && echo && $G/bin/llmq-run -m $S -p Once -n 32 --temp 0"
      step run-offload 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --gpu-layers 2"
      step run-tp2 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 2"
      step run-tp3-uneven-gqa 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 3"
      step run-tp2-processes 90 "rm -f /tmp/llmq-rv; export LLMQ_TP_TIMEOUT=60;
        $G/bin/llmq-run -m $S --device cuda --tp 2 --tp-rank 1 --tp-init file:///tmp/llmq-rv & p=\$!;
        LLMQ_TP_COMM=host $G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 2 --tp-init file:///tmp/llmq-rv; r=\$?;
        wait \$p || r=1; exit \$r"
      step mem-plan 30 "$G/bin/llmq-mem infer -m $S --device cuda --ctx 512 --parallel 4 && $G/bin/llmq-mem infer -m $S --device cuda --tp 2"
      step server 120 server_check
      ;;
    train)
      step train-mem 590 "python3 bench/train_mem.py --llmq-mem $G/bin/llmq-mem --json $dir/train_mem.json"
      ;;
    *)
      echo "gpu_check.sh: unknown phase '$phase' (tests, sanitizer, bench, tools, train, all)" >&2
      exit 1
      ;;
  esac
  [ "${DRY:-0}" = 1 ] || cat "$dir/summary.txt"
}

if [ "$phase" = all ]; then
  for p in tests sanitizer bench tools train; do run_phase "$p"; done
else
  run_phase "$phase"
fi
