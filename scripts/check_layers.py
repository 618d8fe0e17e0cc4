#!/usr/bin/env python3
"""The layering check (issue 19): product code includes only its own folder and the folders of
lower layers, so no two folders include each other and nothing below reaches up. Layers, lowest
first (docs/ARCHITECTURE.md explains each):

  0 base             errors, buffers, mapped files, the thread pool
  1 formats          the .llmq file, block types, the stored vocabulary
  2 models           architectures: hyper-parameters, tensor tables
  3 formats/readers  GGUF, safetensors, llama2.c, Hugging Face readers and the converter
  3 text             tokenizers, Unicode tables, chat templates
  3 engine/cpu       CPU kernels (scalar, AVX2, AVX-512)
  4 engine           forward pass, KV cache, sampler, generation, memory plan, the CPU runner
  5 engine/parallel  ranks in separate processes (sockets, rendezvous)
  5 engine/cuda      the CUDA backend (engine/cuda/emu: its emulator, layer 6)
  6 engine/runner    picks the CPU or CUDA runner for the tools
  7 mem              llmq-mem's reports and planners
  8 cli              what the tools and the server share
  9 server, tools    programs

Also: no folder of product code holds more than 20 source files. Tests, fuzz targets and the
dev/ labs may include anything. Exit 1 with one line per violation; 0 when clean.

  python3 scripts/check_layers.py [repository root]
"""
import os
import re
import sys

LAYERS = {
    "base": 0, "formats": 1, "models": 2, "formats/readers": 3, "text": 3, "engine/cpu": 3, "engine": 4,
    "engine/parallel": 5, "engine/cuda": 5, "engine/cuda/emu": 6, "engine/runner": 6, "mem": 7, "cli": 8,
    "server": 9, "tools": 9,
}
SOURCE = (".h", ".cpp", ".cu", ".cuh")
MAX_FILES = 20


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    bad = []
    for folder, rank in sorted(LAYERS.items()):
        path = os.path.join(root, folder)
        if not os.path.isdir(path):
            bad.append(f"{folder}: listed as a layer but missing")
            continue
        files = sorted(f for f in os.listdir(path) if f.endswith(SOURCE))
        if len(files) > MAX_FILES:
            bad.append(f"{folder}: {len(files)} source files (at most {MAX_FILES})")
        for f in files:
            for n, line in enumerate(open(os.path.join(path, f), encoding="utf-8", errors="replace"), 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                if not m or "/" not in m.group(1):
                    continue
                target = os.path.dirname(m.group(1))
                if target == folder:
                    continue
                if target not in LAYERS:
                    bad.append(f"{folder}/{f}:{n}: includes {m.group(1)}, which is in no layer")
                elif LAYERS[target] >= rank:
                    bad.append(f"{folder}/{f}:{n}: includes {m.group(1)} ({target}, layer {LAYERS[target]}) from layer {rank}")
    for folder in sorted(os.listdir(root)):  # a product folder nobody placed
        if folder in ("tests", "fuzz", "dev", "build", "scripts", "docs", "bench") or folder.startswith((".", "build")):
            continue
        p = os.path.join(root, folder)
        if os.path.isdir(p) and any(f.endswith(SOURCE) for f in os.listdir(p)) and folder not in LAYERS:
            bad.append(f"{folder}: source files in a folder that has no layer")
    for b in bad:
        print("check_layers:", b)
    if not bad:
        print(f"check_layers: {len(LAYERS)} layers, every include points down")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
