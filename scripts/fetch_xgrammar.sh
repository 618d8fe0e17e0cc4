#!/usr/bin/env bash
# Fetches xgrammar's C++ core (the PyPI sdist xgrammar==0.2.8, Apache-2.0: grammar-constrained
# decoding for structured outputs) into the git-ignored third_party/ and builds its static library
# without Python (about 70 s on 2 cores). CMake finds it there (LLMQ_XGRAMMAR_DIR). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=0.2.8
dir=third_party/xgrammar-$VER
lib=third_party/xgrammar-build/libxgrammar.a
[ -f "$lib" ] && [ -f "$dir/include/xgrammar/xgrammar.h" ] && exit 0
mkdir -p third_party
if [ ! -d "$dir" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary xgrammar "xgrammar==$VER" -d "$tmp"
  echo "$(cat scripts/xgrammar.sha256)  $tmp/xgrammar-$VER.tar.gz" | sha256sum -c --quiet
  tar xzf "$tmp/xgrammar-$VER.tar.gz" -C third_party
  rm -rf "$tmp"
fi
mkdir -p third_party/xgrammar-build
# The sdist's cmake/config.cmake turns the Python bindings on; a config.cmake in the build folder wins.
printf 'set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)\nset(XGRAMMAR_BUILD_CXX_TESTS OFF)\n' > third_party/xgrammar-build/config.cmake
# -fno-lto after the project's -flto=auto: plain objects, so our binaries (and the sanitizer
# build) link the archive without GCC's LTO plugin.
cmake -S "$dir" -B third_party/xgrammar-build -DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  -DCMAKE_CXX_FLAGS="-fno-lto -Wno-error" >/dev/null
cmake --build third_party/xgrammar-build -j"$(nproc 2>/dev/null || echo 2)" --target xgrammar
echo "fetch_xgrammar: built $lib"
