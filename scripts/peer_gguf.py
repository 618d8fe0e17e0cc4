#!/usr/bin/env python3
"""Writes a GGUF with random weights in the shapes of a Llama preset (llama-2-7b by default) for
side-by-side runs of llama.cpp and llmq on one file (scripts/gpu_check.sh): every matrix in one
block type (Q4_0 or Q8_0), norms 1.0 in F32, the tokenizer copied from a vocabulary GGUF
(llama.cpp's ggml-vocab-llama-spm.gguf for a 32000-token Llama). Quants are random bytes, block
scales drawn so the weights have a trained Llama's spread (std ~0.01-0.02), as llmq-bench
--synthetic does. Needs numpy and the gguf-py package (the llama-cpp-python sdist's, put on
sys.path with --gguf-py).

  python3 scripts/peer_gguf.py --gguf-py .gpu/peer/gguf-py --vocab VOCAB.gguf --type q4_0 -o out.gguf
"""
import argparse
import os
import sys

import numpy as np

PRESETS = {  # dim, hidden, layers, heads, kv_heads, vocab
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000),
    "tiny": (256, 512, 2, 4, 2, 32000),  # for checking the script itself
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-2-7b")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf  # noqa: E402

    dim, hidden, layers, heads, kv_heads, vocab = PRESETS[a.preset]
    qt = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}[a.type]
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[a.type]
    block_bytes = 18 if a.type == "q4_0" else 34
    scale = 4e-3 if a.type == "q4_0" else 2.5e-4  # |q| ~ 4 (Q4_0 around 8) or ~64 (Q8_0)

    r = gguf.GGUFReader(a.vocab)
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]) for i in f["tokenizer.ggml.tokens"].data]
    if len(tokens) != vocab:
        sys.exit(f"peer_gguf: the vocabulary has {len(tokens)} tokens, the preset {vocab}")
    scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
    ttypes = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]

    tmp = a.out + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"random {a.preset} {a.type}")
    w.add_context_length(4096)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(dim // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_file_type(ftype)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id), ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id)):
        if key in f:
            add(int(f[key].parts[f[key].data[0]][0]))

    # One pool of random bytes; each matrix takes a window at its own offset (fast to make, and
    # no two matrices alike). Block scales are written over the first two bytes of every block.
    rng = np.random.default_rng(1234)
    pool = rng.integers(0, 256, size=64 << 20, dtype=np.uint8)
    d_pool = (scale * (0.5 + rng.random(1 << 20))).astype(np.float16).view(np.uint8).reshape(-1, 2)
    mats = [("token_embd.weight", vocab, dim)]
    for i in range(layers):
        hd = dim // heads
        mats += [(f"blk.{i}.attn_q.weight", dim, dim), (f"blk.{i}.attn_k.weight", kv_heads * hd, dim),
                 (f"blk.{i}.attn_v.weight", kv_heads * hd, dim), (f"blk.{i}.attn_output.weight", dim, dim),
                 (f"blk.{i}.ffn_gate.weight", hidden, dim), (f"blk.{i}.ffn_up.weight", hidden, dim),
                 (f"blk.{i}.ffn_down.weight", dim, hidden)]
    mats.append(("output.weight", vocab, dim))
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(layers) for n in ("attn", "ffn")]

    def matrix(k, rows, cols):
        n_blocks = rows * cols // 32
        nbytes = n_blocks * block_bytes
        start = (k * 7919 * 64) % (pool.size - 1)
        raw = np.resize(np.roll(pool, -start)[: min(pool.size, nbytes)], nbytes).reshape(n_blocks, block_bytes)
        raw[:, 0:2] = np.resize(np.roll(d_pool, -k * 31, axis=0), (n_blocks, 2))
        return raw.reshape(rows, cols // 32 * block_bytes)

    for name, rows, cols in mats:
        w.add_tensor_info(name, (rows, cols // 32 * block_bytes), np.dtype(np.uint8), rows * cols // 32 * block_bytes, raw_dtype=qt)
    for name in norms:
        w.add_tensor_info(name, (dim,), np.dtype(np.float32), dim * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (name, rows, cols) in enumerate(mats):
        w.write_tensor_data(matrix(k, rows, cols))
    for name in norms:
        w.write_tensor_data(np.ones(dim, dtype=np.float32))
    w.close()
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
