#!/usr/bin/env bash
# Packs what a GPU machine without network needs to run the CUDA tests and benchmarks: a build
# made here (the same CUDA toolkit), the shared libraries it needs beyond the CUDA driver and
# toolkit, Open MPI's runtime (scripts/pack_openmpi.sh), stories260K, the kernel labs and the peer
# (scripts/peer_cuda.sh). Writes .gpu/ and its
# archive .gpu-pack/gpu.tar.xz (both git-ignored); carry .gpu-pack (the device tool's carry), and
# scripts/gpu_check.sh unpacks it there. By hand, on the GPU machine, from the repository root:
#   export LD_LIBRARY_PATH=$PWD/.gpu/lib LLMQ_SHARED_DIR=$PWD/.gpu/shared LLMQ_BIN_DIR=$PWD/.gpu/bin LLMQ_TEST_TMP=/tmp/llmq-tests
#   .gpu/bin/llmq-tests "[cuda]"
#   compute-sanitizer --tool memcheck .gpu/bin/llmq-tests "[cuda]"
#   .gpu/bin/llmq-bench --device cuda --synthetic llama-2-7b --type q4_0
set -euo pipefail
cd "$(dirname "$0")/.."
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-gpu -DLLMQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target llmq-tests llmq-ops llmq-bench llmq-run llmq-convert llmq-mem llmq-server llmq-cuda llmq-mpi-check
peer_keep=$(mktemp -d); [ -d .gpu/peer ] && mv .gpu/peer "$peer_keep/"  # scripts/peer_cuda.sh's output survives a repack
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/shared/models
[ -d "$peer_keep/peer" ] && mv "$peer_keep/peer" .gpu/; rmdir "$peer_keep" 2>/dev/null || true
cp build-gpu/tests/llmq-tests build-gpu/tests/llmq-ops build-gpu/llmq-bench build-gpu/llmq-run build-gpu/llmq-convert build-gpu/llmq-mem build-gpu/llmq-server build-gpu/llmq-mpi-check .gpu/bin/
cp build-gpu/libllmq-cuda.so .gpu/bin/  # the CUDA backend plugin llmq-run/-server/-mem open beside themselves
strip .gpu/bin/* || true
# Libraries from Debian packages (the GPU machine's image may lack them); not the CUDA ones.
for b in .gpu/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -Ev 'libc\.so|libm\.so|libgcc_s|libstdc\+\+|ld-linux|libpthread|libdl|librt|cuda|cublas|nvidia' || true
done | sort -u | while read -r lib; do cp -L "$lib" .gpu/lib/; done
cp -r ../shared/models/stories260K .gpu/shared/models/
# Open MPI's runtime (mpirun, orted, plugins) for GPU ranks as processes where the machine has none.
bash scripts/pack_openmpi.sh .gpu/ompi >/dev/null
# The kernel labs (dev/cuda), the vocabulary for scripts/peer_gguf.py, and the peer (llama.cpp's
# CUDA tools and gguf-py) when scripts/peer_cuda.sh has built it.
bash dev/cuda/build.sh >/dev/null
mkdir -p .gpu/dev
for l in gemv gemv_k mmq attn; do
  if [ -f build-gpu/dev/$l ]; then cp build-gpu/dev/$l .gpu/dev/ && strip .gpu/dev/$l; fi
done
mkdir -p .gpu/shared/tokenizers && cp ../shared/tokenizers/llamacpp-vocab/ggml-vocab-llama-spm.gguf .gpu/shared/tokenizers/
if [ -d build-peer/cuda/bin ] && [ ! -d .gpu/peer ]; then bash scripts/peer_cuda.sh; fi
cp scripts/peer_gguf.py .gpu/
# LitGPT for bench/litgpt_saved.py --device cuda (its other needs are in the GPU image: torch,
# lightning, huggingface_hub, safetensors, tokenizers, psutil, tqdm, PyYAML); pure-Python wheels.
mkdir -p .gpu/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d .gpu/wheels litgpt==0.5.13 jsonargparse==4.41.0 docstring-parser==0.18.0 typeshed-client==2.15.0 ||
  echo "gpu_pack.sh: no LitGPT wheels (pip could not download them): the train phase skips bench/litgpt_saved.py" >&2
du -sh .gpu .gpu/*
# One archive to carry (the device tool takes at most 64 MiB; the binaries share their kernels,
# which xz's 64 MiB window folds): gpu_check.sh unpacks it where .gpu/ is missing.
mkdir -p .gpu-pack && tar -cf - .gpu | xz -9 -T2 > .gpu-pack/gpu.tar.xz && du -sh .gpu-pack/gpu.tar.xz
