#!/usr/bin/env bash
# Builds the side-by-side CPU peer: llama.cpp's llama-bench, llama-perplexity and
# llama-completion (and libllama, which bench/kld_llamacpp.sh links), from the source inside the
# PyPI sdist llama-cpp-python==0.3.36 (llama.cpp 0c1e570), into the git-ignored build-peer/
# (about 9 minutes on 2 cores; ../shared/LIBRARIES.md has the facts). Nothing of llama.cpp is
# committed.
#   scripts/peer_cpu.sh [native|avx2]   native (default): this CPU's ISA, into build-peer/cpu;
#                                       avx2: AVX2 + FMA + F16C only, into build-peer/cpu-avx2
set -euo pipefail
cd "$(dirname "$0")/.."
ver=0.3.36
src=build-peer/llama_cpp_python-$ver
level=${1:-native}
mkdir -p build-peer
if [ ! -d "$src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d build-peer
  tar xzf "build-peer/llama_cpp_python-$ver.tar.gz" -C build-peer
fi
if [ "$level" = avx2 ]; then
  out=build-peer/cpu-avx2
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
else
  out=build-peer/cpu
  isa=(-DGGML_NATIVE=ON)
fi
command -v ninja >/dev/null || { echo "peer_cpu.sh: needs ninja (apt-get install ninja-build)" >&2; exit 2; }
cmake -S "$src/vendor/llama.cpp" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$out" -j"${JOBS:-$(nproc)}" --target llama-bench llama-perplexity llama-completion
echo "peer built in $out/bin"
