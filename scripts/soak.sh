#!/usr/bin/env bash
# Server soak (issue 8; not in CI): converts stories260K (../shared) to Q8_0, starts llmq-server on
# it, runs scripts/soak.py against it (mixed valid, invalid, cancelled and overload traffic), and
# stops the server with SIGTERM (soak.py checks for a clean exit). Needs only python3.
#
#   bash scripts/soak.sh [--minutes 30] [--clients 16] [other soak.py options]
#
# Environment: BUILD_DIR (default build: llmq-server, llmq-convert), LLMQ_SHARED_DIR (default
# ../shared), SOAK_DIR (default $BUILD_DIR/soak: the model, the server log and soak.json),
# SERVER_ARGS (default "-t 1 --parallel 8 --max-queue 16 --ctx 2048 --chat-template chatml").
# Exit code: soak.py's (0 when every check passed).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$repo/build}
shared=${LLMQ_SHARED_DIR:-$repo/../shared}
out=${SOAK_DIR:-$build/soak}
server_args=${SERVER_ARGS:--t 1 --parallel 8 --max-queue 16 --ctx 2048 --chat-template chatml}
for tool in llmq-server llmq-convert; do
  [ -x "$build/$tool" ] || { echo "soak.sh: $build/$tool missing: cmake --build $build --target $tool" >&2; exit 1; }
done
mkdir -p "$out"
model=$out/stories260K-q8_0.llmq
"$build/llmq-convert" "$shared/models/stories260K/stories260K.bin" --tokenizer "$shared/models/stories260K/tok512.bin" \
  --type q8_0 -o "$model" -f >/dev/null
exec python3 "$repo/scripts/soak.py" --server "$build/llmq-server" --model "$model" --server-args="$server_args" \
  --log "$out/server.log" --json "$out/soak.json" "$@"
