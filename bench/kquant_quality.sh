#!/bin/bash
# Quality of llmq's K-quant quantizers against llama.cpp's (llama-quantize), from the same
# F32 source, measured by the same engine (llmq) against the same reference (llama.cpp on the
# F32 weights): WikiText-2 perplexity and mean KL divergence (bench/kld_llamacpp.cpp).
#   bench/kquant_quality.sh GGUF [TYPES="q4_k_m q5_k_m q6_k"] [CTX=512] [CHUNKS=20]
# The F32 source is the GGUF dequantized (bench/gguf_to_f32.py): no F16 checkpoint of the real
# models reaches this machine, so both quantizers start from already-quantized values (state this
# beside the numbers). Prints one JSON line per type and quantizer.
set -euo pipefail
cd "$(dirname "$0")/.."
PEER_BIN=${PEER_BIN:-build-peer/cpu/bin}
[ -x "$PEER_BIN/llama-quantize" ] || { echo "build the peer's llama-quantize first (scripts/peer_cpu.sh)" >&2; exit 2; }
gguf=$1
types=${2:-q4_k_m q5_k_m q6_k}
ctx=${3:-512}
chunks=${4:-20}
mkdir -p bench/tmp
name=$(basename "$gguf" .gguf)
f32=bench/tmp/$name.f32.gguf
[ -f "$f32" ] || .venv/bin/python bench/gguf_to_f32.py "$gguf" "$f32"
KLD_BUILD_ONLY=1 bash bench/kld_llamacpp.sh  # builds bench/tmp/kld_llamacpp
for t in $types; do
  T=$(echo "$t" | tr a-z A-Z)
  ours=bench/tmp/$name.llmq-$t.llmq
  peer_gguf=bench/tmp/$name.peer-$t.gguf
  peer=bench/tmp/$name.peer-$t.llmq
  build/llmq-convert "$f32" --type "$t" -o "$ours" -f --no-progress 2>/dev/null
  "$PEER_BIN/llama-quantize" "$f32" "$peer_gguf" "$T" 2 >/dev/null 2>&1
  build/llmq-convert "$peer_gguf" -o "$peer" -f --no-progress 2>/dev/null
  for q in llmq:$ours llama.cpp:$peer; do
    line=$(bench/tmp/kld_llamacpp "$f32" "${q#*:}" ../shared/text/wikitext2-test.txt "$ctx" "$chunks" 2 2>/dev/null)
    echo "{\"model\": \"$name\", \"type\": \"$t\", \"quantizer\": \"${q%%:*}\", \"bytes\": $(stat -c %s "${q#*:}"), ${line#\{}"
  done
done
