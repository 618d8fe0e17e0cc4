#!/bin/sh
# Builds the GPU kernel lab against build-gpu's libraries (scripts/gpu_pack.sh makes build-gpu;
# or: cmake -S . -B build-gpu -DLLMQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release &&
#     cmake --build build-gpu -j2 --target llmq_cuda).
# llmq_core holds the MPI communicator, hence Open MPI on the link line.
# Output: build-gpu/dev/<lab>, run on the GPU machine (scripts/gpu_check.sh lab).
set -e
cd "$(dirname "$0")/../.."
mkdir -p build-gpu/dev
for lab in ${LABS:-gemv gemv_k mmq attn}; do
  [ -f dev/cuda/$lab.cu ] || continue
  nvcc -std=c++17 -O3 -I. -gencode arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v dev/cuda/$lab.cu -o build-gpu/dev/$lab \
    build-gpu/libllmq_cuda.a build-gpu/libllmq_core.a -lcublas -lfmt $(pkg-config --libs sentencepiece libxxhash ompi) \
    2> build-gpu/dev/$lab.ptxas.txt || { cat build-gpu/dev/$lab.ptxas.txt; exit 1; }
  grep -E "registers|spill" build-gpu/dev/$lab.ptxas.txt | sort | uniq -c | sort -rn | head -5
done
