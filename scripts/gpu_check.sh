#!/usr/bin/env bash
# The checks a GPU session runs (issues 4, 6, 7, 25), in phases, on the GPU machine from the
# repository root, on what scripts/gpu_pack.sh packed into .gpu/ (carried there: the machine
# has no network). Each step's output goes to $RES/<phase>/<step>.txt (RES: /tmp/gpu-check), a
# step that fails is recorded and the next one runs; $RES/<phase>/summary.txt lists every step
# with its exit code and seconds, and the last lines printed are every phase's summary. After
# each phase $RES is packed into $OUT/gpu-check.tgz: the device tool brings back only a few
# files from $OUT (a third GPU session lost its lab and peer outputs to that), and a call cut
# short still brings back the phases it finished.
#
#   bash scripts/gpu_check.sh            # the default: one device call of at most 9 minutes
#                                        # (info tests tools peer train bench sanitizer)
#   bash scripts/gpu_check.sh lab bench  # named phases, in order:
#     info       nvidia-smi
#     kernels    the kernel parity cases alone (MMQ, matmul, norms, attention)
#     tests      parity: every [cuda] case (kernel x type, whole models, TP, server paths), and again
#                without programmatic dependent launch, the default on Hopper (PDL=0: not again)
#     sanitizer  compute-sanitizer memcheck over the kernel tests; racecheck over MMQ and attention
#     lab        the kernel labs (dev/cuda): GEMV (Q4_0/Q8_0, and K-quants: gemv_k), MMQ and attention
#                against the engine's (LABS=...; LABS=sweep: MMQ's K splits x pipeline depths, 10 s)
#     bench      llmq-bench --synthetic llama-2-7b, Q4_0, Q8_0, Q4_K, Q6_K and Q5_0 (BENCH_TYPES=...), with --profile
#                and --batch 32
#                (NO_MMQ=1: MMQ off once more; MMQ_ALL="q6_k ...": those types with MMQ forced; DECODE_ATTN=0: without llama-2-7b's and llama-3-8b's
#                Q4_0 on decode attention version 1 forced, against the default's version 3, at
#                640 and at 4,096 positions;
#                PDL=0: without the Q4_0 and Q8_0 runs without programmatic dependent launch,
#                LLMQ_CUDA_PDL=0)
#     where      a graphed Q4_0 decode step's split: llmq-bench on llama-2-7b with each op class of the
#                layers not launched (LLMQ_CUDA_SKIP, engine/cuda/session.cpp parse_skip; the output is
#                wrong, the time is what the class costs inside the graph), then all but the products
#                and the products alone (WHERE_TYPES=...: other types; WHERE_BATCH=1: a batch of 32 too)
#     blocks     decode attention version 3's block target end to end (LLMQ_CUDA_V3_BLOCKS; the attn
#                lab times it alone): llama-2-7b Q4_0 at 640 and 4,096 positions, llama-3-8b, and a
#                batch of 32, the targets interleaved twice
#     mmqh       MMQ on fp16 tiles (mmq_h, LLMQ_CUDA_MMQ_F16=1) against the int8 MMQ: the mmq lab on
#                Q4_0 and Q8_0, then llama-2-7b batches of 32 (Q4_0, Q8_0; interleaved, twice), 16 and 64 (Q4_0)
#     peer       one GGUF per type (random llama-2-7b weights, scripts/peer_gguf.py: Q4_0, Q5_0, Q8_0,
#                the Q4_K_M mix and the Q3_K_M mix: Q3_K, Q4_K, Q5_K and Q6_K; PEER_TYPES=...),
#                read by both llama.cpp's llama-bench and llmq-bench (after
#                llmq-convert), interleaved; llmq-run's GPU peak (nvidia-smi) against llmq-mem infer
#                on each; and test-backend-ops perf on the MUL_MAT shapes of the issue (PEER_OPS=0: without)
#     ops        the op harness's matmul on llama.cpp's test-backend-ops table (llmq-ops --perf
#                --peer-shapes: Q4_0/Q8_0/Q4_K/Q6_K/F16, 4096 x 14336, n = 1, 8, 512; about 2 minutes,
#                most of it quantizing the host weights), beside the peer phase's test-backend-ops
#     tools      llmq-run (offload, --tp 2, ranks as processes), llmq-server
#     train      bench/train_mem.py: PyTorch's peak vs llmq-mem train; bench/generate_mem.py:
#                transformers' generate() peak vs llmq-mem generate; bench/litgpt_saved.py: LitGPT's
#                saved tensors on the GPU; bench/litgpt_peak.py: LitGPT's fine-tuning peak on the config
#                hub's recipes (TRAIN_STEPS="train generate litgpt peak": a subset)
#   DRY=1 bash scripts/gpu_check.sh ...  # print the commands only
# The default order puts what a session has not measured yet before what it re-measures, so a
# call cut short by its time limit still brings back the new numbers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
RES=${RES:-/tmp/gpu-check}
# A machine may keep /tmp between loans (the seventh GPU session's archive held another day's
# files): each call's archive holds only its own steps.
[ "${DRY:-0}" = 1 ] || rm -rf "$RES"
G=$PWD/.gpu
# gpu_pack.sh's archive (what travels: the device tool carries at most 64 MiB)
[ -d "$G" ] || [ ! -f .gpu-pack/gpu.tar.xz ] || [ "${DRY:-0}" = 1 ] || tar -xJf .gpu-pack/gpu.tar.xz
export LD_LIBRARY_PATH=$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LLMQ_SHARED_DIR=$G/shared LLMQ_BIN_DIR=$G/bin
export LLMQ_TEST_TMP=${LLMQ_TEST_TMP:-/tmp/llmq-tests}
# Open MPI for the GPU ranks as processes: the machine's own mpirun, else the runtime gpu_pack.sh
# packed (scripts/pack_openmpi.sh: relocated by OPAL_PREFIX).
if ! command -v mpirun >/dev/null && [ -x "$G/ompi/bin/mpirun" ]; then
  export OPAL_PREFIX=$G/ompi PMIX_INSTALL_PREFIX=$G/ompi/pmix2 PATH=$G/ompi/bin:$PATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$G/ompi/lib
fi
S=/tmp/llmq-gpu-stories.llmq
B7="--device cuda --synthetic llama-2-7b -p 512 -n 128 -r 3"
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

# gpu_peak CMD...: runs CMD, sampling the GPU's used memory (nvidia-smi, every 50 ms; the process
# is alone on the GPU) and prints the largest sample in MiB: the CUDA context, the libraries'
# workspaces and every allocation, which llmq-mem infer --device cuda is compared against.
gpu_peak() {
  local base peak=0 u
  base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "$u" -gt "$peak" ] && peak=$u
    sleep 0.05
  done
  wait "$pid"
  echo "gpu_peak: $((peak - base)) MiB above the idle GPU's $base MiB (nvidia-smi memory.used): $*"
}

# The memory check on one converted file: llmq-mem's plan, then llmq-run's measured peak.
mem_check() {
  local m=$1 ctx
  for ctx in 512 4096; do
    "$G/bin/llmq-mem" infer -m "$m" --device cuda --ctx "$ctx"
    local t0; t0=$(date +%s.%N)
    gpu_peak "$G/bin/llmq-run" -m "$m" -p Once -n 16 --temp 0 --device cuda --ctx "$ctx"
    echo "llmq-run wall (load, upload, 16 tokens): $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b - a}') s"
  done
}

# The same GGUF through llama.cpp's llama-bench and llmq-bench, two rounds, interleaved.
peer_bench() {
  local t=$1 gguf=/tmp/peer-$1.gguf llmq=/tmp/peer-$1.llmq r
  python3 "$G/peer_gguf.py" --gguf-py "$G/peer/gguf-py" --vocab "$G/shared/tokenizers/ggml-vocab-llama-spm.gguf" --type "$t" -o "$gguf" || return 1
  "$G/bin/llmq-convert" "$gguf" -o "$llmq" >/dev/null || return 1
  for r in 1 2; do
    echo "== round $r: llama-bench"
    LD_LIBRARY_PATH=$G/peer/bin:$LD_LIBRARY_PATH "$G/peer/bin/llama-bench" -m "$gguf" -p 512 -n 128 -r 3 -ngl 99 -o json
    echo "== round $r: llmq-bench"
    "$G/bin/llmq-bench" --device cuda -m "$llmq" -p 512 -n 128 -r 3 --no-verify
  done
  echo "== memory"
  mem_check "$llmq"
  rm -f "$gguf" "$llmq"
}
export -f server_check peer_bench gpu_peak mem_check

need_model() {
  [ "${DRY:-0}" = 1 ] || [ -f "$S" ] || "$G/bin/llmq-convert" "$G/shared/models/stories260K/stories260K.bin" \
    --tokenizer "$G/shared/models/stories260K/tok512.bin" --type f32 -o "$S" >/dev/null 2>&1
}

run_phase() {
  phase=$1
  dir=$RES/$phase
  if [ "${DRY:-0}" != 1 ]; then
    mkdir -p "$dir" "$LLMQ_TEST_TMP"
    : >"$dir/summary.txt"
  fi
  case "$phase" in
    info)
      step nvidia-smi 30 "nvidia-smi; nvidia-smi -q -d CLOCK,MEMORY | head -60; uname -a; nvcc --version | tail -2; python3 -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|bitsandbytes|accelerate|peft|numpy|triton) '"
      ;;
    kernels)  # the kernel parity cases alone (seconds)
      step kernel-tests 60 "$G/bin/llmq-tests 'CUDA MMQ*,CUDA matmul*,CUDA RMSNorm*,CUDA attention*,CUDA sliding-window*,CUDA paged*' -r compact"
      ;;
    tests)
      step cuda-tests 240 "$G/bin/llmq-tests '[cuda]' -r compact"
      step tp-process-tests 90 "$G/bin/llmq-tests '[tp_process]' -r compact"
      # programmatic dependent launch (engine/cuda/common.cuh pdl_begin), on by default on Hopper:
      # every case again with it off
      [ "${PDL:-1}" = 1 ] && step cuda-tests-no-pdl 240 "LLMQ_CUDA_PDL=0 $G/bin/llmq-tests '[cuda]' -r compact"
      ;;
    sanitizer)
      # racecheck first: the longer one (85 s on an H200), so a call cut short still brings its verdict
      step racecheck-mmq-attn 180 "compute-sanitizer --tool racecheck --error-exitcode 9 $G/bin/llmq-tests 'CUDA MMQ*,CUDA attention*,CUDA decode attention*,CUDA sliding-window*' -r compact"
      step memcheck-kernels 150 "compute-sanitizer --tool memcheck --error-exitcode 9 $G/bin/llmq-tests '[cuda]~[model]' -r compact"
      ;;
    lab)
      for l in ${LABS:-gemv gemv_k mmq attn}; do
        case $l in
          gemv) step lab-gemv 90 "$G/dev/gemv --reps 10" ;;
          gemv_k) step lab-gemv-k 90 "$G/dev/gemv_k --reps 10" ;;
          mmq) step lab-mmq 120 "$G/dev/mmq --reps 5" ;;
          sweep) step lab-mmq-sweep 60 "$G/dev/mmq --reps 5 --types q4_0,q8_0 --sweep" ;;
          attn) step lab-attn 60 "$G/dev/attn && LLMQ_CUDA_ATTN=0 $G/dev/attn" ;;
        esac
      done
      ;;
    bench)
      for t in ${BENCH_TYPES:-q4_0 q8_0 q4_k q6_k q5_0}; do
        step "bench-7b-$t" 90 "$G/bin/llmq-bench $B7 --type $t --profile --batch 32"
      done
      [ "${NO_MMQ:-0}" = 1 ] && step bench-7b-q4_0-no-mmq 60 "LLMQ_CUDA_MMQ=0 $G/bin/llmq-bench $B7 --type q4_0 --profile"
      # MMQ_ALL="q6_k ...": those types again with MMQ forced for every batch (LLMQ_CUDA_MMQ=1),
      # against the default's choice (engine/cuda/matmul.cu mmq_wins)
      for t in ${MMQ_ALL:-}; do step "bench-7b-$t-mmq" 90 "LLMQ_CUDA_MMQ=1 $G/bin/llmq-bench $B7 --type $t --batch 32"; done
      # programmatic dependent launch (the default on Hopper) off, end to end (decode graphs,
      # prefill, batch 32)
      if [ "${PDL:-1}" = 1 ]; then
        for t in q4_0 q8_0; do step "bench-7b-$t-no-pdl" 90 "LLMQ_CUDA_PDL=0 $G/bin/llmq-bench $B7 --type $t --batch 32"; done
      fi
      # decode attention (engine/cuda/attention.h set_decode_attention_version): the default's
      # version 3 above against version 1 forced, on llama-2-7b (MHA) and llama-3-8b (GQA)
      if [ "${DECODE_ATTN:-1}" = 1 ]; then
        for v in 1 3; do step "bench-8b-q4_0-decode-attn-$v" 60 "LLMQ_CUDA_DECODE_ATTN=$v $G/bin/llmq-bench ${B7/llama-2-7b/llama-3-8b} --type q4_0"; done
        step bench-7b-q4_0-decode-attn-1 60 "LLMQ_CUDA_DECODE_ATTN=1 $G/bin/llmq-bench $B7 --type q4_0 --batch 32"
        # a long context: decode attention reads 2.1 GB of K and V a token there, 0.56x the Q4_0 weights' 3.8 GB
        for v in 1 3; do step "bench-7b-q4_0-ctx4k-decode-attn-$v" 90 "LLMQ_CUDA_DECODE_ATTN=$v $G/bin/llmq-bench ${B7/-p 512/-p 3968} --type q4_0"; done
      fi
      ;;
    blocks)
      local b r
      for r in 1 2; do
        for b in 2048 264 528 1056; do
          step "blocks-7b-q4_0-b$b-r$r" 60 "LLMQ_CUDA_V3_BLOCKS=$b $G/bin/llmq-bench $B7 --type q4_0"
          step "blocks-7b-q4_0-ctx4k-b$b-r$r" 90 "LLMQ_CUDA_V3_BLOCKS=$b $G/bin/llmq-bench ${B7/-p 512/-p 3968} --type q4_0"
          step "blocks-8b-q4_0-b$b-r$r" 60 "LLMQ_CUDA_V3_BLOCKS=$b $G/bin/llmq-bench ${B7/llama-2-7b/llama-3-8b} --type q4_0"
          step "blocks-7b-q4_0-batch32-b$b-r$r" 60 "LLMQ_CUDA_V3_BLOCKS=$b $G/bin/llmq-bench $B7 --type q4_0 --batch 32"
        done
      done
      ;;
    where)
      local t sk
      for t in ${WHERE_TYPES:-q4_0}; do
        for sk in none norm rope_kv attention gated_act norm,rope_kv,attention,gated_act matmul; do
          step "where-7b-$t-skip-${sk//,/+}" 60 "LLMQ_CUDA_SKIP=$sk $G/bin/llmq-bench $B7 --type $t"
        done
      done
      # a batch of 32 (WHERE_BATCH=1): its step without attention, without the products, with only them
      if [ "${WHERE_BATCH:-0}" = 1 ]; then
        for sk in none attention matmul norm,rope_kv,attention,gated_act; do
          step "where-7b-q4_0-batch32-skip-${sk//,/+}" 60 "LLMQ_CUDA_SKIP=$sk $G/bin/llmq-bench $B7 --type q4_0 --batch 32"
        done
      fi
      ;;
    mmqh)
      local t f r n
      step lab-mmq-h 150 "$G/dev/mmq --types q4_0,q8_0 --reps 5"
      for r in 1 2; do
        for t in q4_0 q8_0; do
          for f in 0 1; do step "mmqh-7b-$t-batch32-f16-$f-r$r" 60 "LLMQ_CUDA_MMQ_F16=$f $G/bin/llmq-bench $B7 --type $t --batch 32"; done
        done
      done
      for n in 16 64; do
        for f in 0 1; do step "mmqh-7b-q4_0-batch$n-f16-$f" 60 "LLMQ_CUDA_MMQ_F16=$f $G/bin/llmq-bench $B7 --type q4_0 --batch $n"; done
      done
      ;;
    peer)
      if [ -x "$G/peer/bin/llama-bench" ]; then
        for t in ${PEER_TYPES:-q4_k_m q5_0 q4_0 q8_0 q3_k_m}; do step "peer-$t" 180 "peer_bench $t"; done
        [ "${PEER_OPS:-1}" = 1 ] && step peer-backend-ops 120 "LD_LIBRARY_PATH=$G/peer/bin:\$LD_LIBRARY_PATH $G/peer/bin/test-backend-ops perf -b CUDA0 -o MUL_MAT \
          -p 'type_a=(q4_0|q8_0|q4_K|q6_K|f16),type_b=f32,m=4096,n=(1|8|512),k=14336'"
      else
        echo "[peer] no .gpu/peer (scripts/peer_cuda.sh builds it): skipped" | tee -a "$dir/summary.txt"
      fi
      ;;
    ops)
      step ops-peer-shapes 240 "$G/bin/llmq-ops --peer-shapes --op matmul --backend cuda"
      ;;
    tools)
      need_model
      step run-gpu 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda && echo && $G/bin/llmq-run -m $S -p Once -n 32 --temp 0"
      step run-offload 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --gpu-layers 2"
      step run-tp2 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 2"
      step run-tp3-uneven-gqa 60 "$G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 3"
      # GPU ranks as MPI processes (one GPU per local rank; on one GPU, LLMQ_TP_COMM=host: the
      # all-reduce over MPI), their text against the same ranks in one process. Needs mpirun there.
      step run-tp2-processes 90 "if ! command -v mpirun >/dev/null; then echo 'no mpirun here or in .gpu/ompi (scripts/pack_openmpi.sh): skipped'; exit 0; fi;
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 -x LLMQ_TP_COMM=host $G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 2 >/tmp/llmq-mpi.txt &&
        $G/bin/llmq-run -m $S -p Once -n 32 --temp 0 --device cuda --tp 2 >/tmp/llmq-one.txt && cmp /tmp/llmq-mpi.txt /tmp/llmq-one.txt"
      # The CUDA context with cuBLAS loaded, measured: stories260K's allocations are a few MiB.
      step cuda-context 30 "gpu_peak $G/bin/llmq-run -m $S -p Once -n 4 --temp 0 --device cuda"
      step mem-plan 30 "$G/bin/llmq-mem infer -m $S --device cuda --ctx 512 --parallel 4 && $G/bin/llmq-mem infer -m $S --device cuda --tp 2"
      step server 120 server_check
      ;;
    train)
      local steps=" ${TRAIN_STEPS:-train generate litgpt peak} "
      # LitGPT from the wheels gpu_pack.sh packed, for the steps that import it
      local lit="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/wheels/*.whl && export PYTHONPATH=/tmp/site &&"
      [[ $steps == *" train "* ]] && step train-mem ${TRAIN_SECS:-240} "python3 bench/train_mem.py --llmq-mem $G/bin/llmq-mem --json $dir/train_mem.json"
      [[ $steps == *" generate "* ]] && step generate-mem ${GENERATE_SECS:-150} "python3 bench/generate_mem.py --llmq-mem $G/bin/llmq-mem --json $dir/generate_mem.json"
      # LitGPT's training step replayed on the config hub's recipes at their full sequence: the peak
      # against the published A10G figures (bench/litgpt_peak.py)
      [[ $steps == *" peak "* ]] && step litgpt-peak ${PEAK_SECS:-150} "$lit python3 bench/litgpt_peak.py --json $dir/litgpt_peak.json"
      # LitGPT's saved tensors per block on the GPU, beside the CPU's count (bench/RESULTS.md "LitGPT
      # on a GPU"). --list: every saved storage, on the CPU and on the GPU; --lora-all: QLoRA's kept
      # inputs on a TinyLlama-shaped block (the config hub's recipe: 8 x 512 tokens)
      [[ $steps == *" litgpt "* ]] && step litgpt-saved ${LITGPT_SECS:-150} "$lit \
        for d in cpu cuda; do python3 bench/litgpt_saved.py --device \$d --list; done && \
        for s in '1304 4096 11008 32' '4096 2048 5632 32'; do set -- \$s; python3 bench/litgpt_saved.py --T \$1 --h \$2 --H \$3 --heads \$4 --device cuda; \
          python3 bench/litgpt_saved.py --T \$1 --h \$2 --H \$3 --heads \$4 --device cuda --lora-all; done"
      ;;
    *)
      echo "gpu_check.sh: unknown phase '$phase' (info kernels tests sanitizer lab bench where blocks peer ops tools train)" >&2
      exit 1
      ;;
  esac
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(info tests tools peer train bench sanitizer)
for p in "${phases[@]}"; do
  run_phase "$p"
  [ "${DRY:-0}" = 1 ] || { mkdir -p "$OUT" && tar czf "$OUT/gpu-check.tgz" -C "$RES" .; }
done
if [ "${DRY:-0}" != 1 ]; then
  for p in "${phases[@]}"; do echo "== $p"; cat "$RES/$p/summary.txt"; done
fi
