#!/usr/bin/env bash
# Packs what a GPU machine without network needs to run the CUDA tests and benchmarks: a build
# made here (the same CUDA toolkit), the shared libraries it needs beyond the CUDA driver and
# toolkit, and stories260K. Writes .gpu/ (git-ignored), to be carried (the device tool's carry).
# On the GPU machine, from the repository root:
#   export LD_LIBRARY_PATH=$PWD/.gpu/lib LLMQ_SHARED_DIR=$PWD/.gpu/shared LLMQ_BIN_DIR=$PWD/.gpu/bin LLMQ_TEST_TMP=/tmp/llmq-tests
#   .gpu/bin/llmq-tests "[cuda]"
#   compute-sanitizer --tool memcheck .gpu/bin/llmq-tests "[cuda]"
#   .gpu/bin/llmq-bench --device cuda --synthetic llama-2-7b --type q4_0
set -euo pipefail
cd "$(dirname "$0")/.."
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-gpu -DLLMQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target llmq-tests llmq-bench llmq-run llmq-convert llmq-mem llmq-server
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/shared/models
cp build-gpu/tests/llmq-tests build-gpu/llmq-bench build-gpu/llmq-run build-gpu/llmq-convert build-gpu/llmq-mem build-gpu/llmq-server .gpu/bin/
strip .gpu/bin/* || true
# Libraries from Debian packages (the GPU machine's image may lack them); not the CUDA ones.
for b in .gpu/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -Ev 'libc\.so|libm\.so|libgcc_s|libstdc\+\+|ld-linux|libpthread|libdl|librt|cuda|cublas|nvidia' || true
done | sort -u | while read -r lib; do cp -L "$lib" .gpu/lib/; done
cp -r ../shared/models/stories260K .gpu/shared/models/
du -sh .gpu
