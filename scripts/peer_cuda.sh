#!/usr/bin/env bash
# Builds the side-by-side peer for the GPU checks: llama.cpp's CUDA test-backend-ops and
# llama-bench, from the source inside the PyPI sdist llama-cpp-python==0.3.36 (llama.cpp 0c1e570),
# on this machine (a CPU with the CUDA toolkit; about 30 min on 2 cores), for sm_90 (H100/H200).
# Output: .gpu/peer/ (git-ignored): bin/ with the two tools and their shared libraries, and
# gguf-py (the sdist's GGUF writer, which scripts/gpu_check.sh uses on the GPU machine to write
# the random-weight llama-2-7b-shaped GGUFs both engines read). Nothing of llama.cpp is committed.
# FlashAttention kernels are left out (GGML_CUDA_FA=OFF), which halves the build; llama-bench
# then runs llama.cpp's cuBLAS attention path. The CPU part is built for plain AVX2 (the GPU
# machine's CPU is another model).
set -euo pipefail
cd "$(dirname "$0")/.."
ver=0.3.36
src=build-peer/llama_cpp_python-$ver
mkdir -p build-peer
if [ ! -d "$src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d build-peer
  tar xzf "build-peer/llama_cpp_python-$ver.tar.gz" -C build-peer
fi
# No driver here: link against the toolkit's stub libcuda (the GPU machine has the real one).
mkdir -p build-peer/stubs && ln -sf "$(dirname "$(command -v nvcc)")/../lib64/stubs/libcuda.so" build-peer/stubs/libcuda.so.1
cmake -S "$src/vendor/llama.cpp" -B build-peer/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$PWD/build-peer/stubs" \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=ON \
  -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build-peer/cuda -j"${JOBS:-$(nproc)}" --target test-backend-ops llama-bench
rm -rf .gpu/peer && mkdir -p .gpu/peer/bin
cp build-peer/cuda/bin/test-backend-ops build-peer/cuda/bin/llama-bench .gpu/peer/bin/
cp -P build-peer/cuda/bin/*.so* .gpu/peer/bin/ 2>/dev/null || find build-peer/cuda -name '*.so*' -exec cp -P {} .gpu/peer/bin/ \;
strip .gpu/peer/bin/* 2>/dev/null || true
cp -r "$src/vendor/llama.cpp/gguf-py" .gpu/peer/gguf-py
du -sh .gpu/peer
