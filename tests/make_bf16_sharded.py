#!/usr/bin/env python3
"""Writes a BF16, two-shard copy of a Hugging Face checkpoint that is one F32 model.safetensors.

    make_bf16_sharded.py SRC_DIR OUT_DIR

OUT_DIR gets config.json and generation_config.json (copied; torch_dtype set to bfloat16),
model-00001-of-00002.safetensors and model-00002-of-00002.safetensors (every tensor rounded
to bfloat16 with round-to-nearest-even, split in file order so the first shard holds about
half the bytes) and model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}),
the layout transformers' save_pretrained writes for a sharded checkpoint.

The shards are written by the safetensors library itself (not by llmq), so the test reads a
file from an independent writer. Needs the `safetensors` and `numpy` packages.
"""
import json
import os
import shutil
import sys

import numpy as np
import safetensors
from safetensors.numpy import load_file


def to_bf16_bits(x):
    """float32 array -> uint16 array of bfloat16 bit patterns (round to nearest, ties to even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def save(tensors, path):
    """tensors: name -> (safetensors dtype name, shape, contiguous numpy array of the bytes)."""
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8: raw pointers
        spec = {
            name: safetensors.TensorSpec(dtype=dtype, shape=list(shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes)
            for name, (dtype, shape, arr) in tensors.items()
        }
    else:  # older releases: dicts with the bytes
        spec = {
            name: {"dtype": dtype, "shape": list(shape), "data": arr.tobytes()}
            for name, (dtype, shape, arr) in tensors.items()
        }
    safetensors.serialize_file(spec, path, metadata={"format": "pt"})


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: make_bf16_sharded.py SRC_DIR OUT_DIR")
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))

    # File order of the source (by data offset), read from its header.
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])

    bf16 = {k: to_bf16_bits(weights[k]) for k in names}
    total = sum(a.nbytes for a in bf16.values())
    shards = [{}, {}]
    done = 0
    for k in names:
        shards[0 if done < total // 2 else 1][k] = ("bfloat16", weights[k].shape, bf16[k])
        done += bf16[k].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        save(shard, os.path.join(out, fname))
        for k in shard:
            weight_map[k] = fname
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = os.path.join(src, "generation_config.json")
    if os.path.exists(gen):
        shutil.copyfile(gen, os.path.join(out, "generation_config.json"))
    print("wrote %s: %d tensors, %d bytes of BF16 in %d shards" % (out, len(names), total, len(shards)))


if __name__ == "__main__":
    main()
