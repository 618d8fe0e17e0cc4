#!/usr/bin/env python3
"""Writes a GGUF with random weights in the shapes of a Llama preset (llama-2-7b by default) for
side-by-side runs of llama.cpp and llmq on one file (scripts/gpu_check.sh): every matrix in one
block type (Q4_0, Q5_0 or Q8_0), norms 1.0 in F32, the tokenizer copied from a vocabulary GGUF
(llama.cpp's ggml-vocab-llama-spm.gguf for a 32000-token Llama). `--type q4_k_m` writes the mix
llama.cpp's Q4_K_M gives a Llama: Q6_K for output.weight and for attn_v / ffn_down in the layers
its use_more_bits rule picks (the first and last eighth, and every third between), Q4_K for the
rest (the policy llmq-convert --type q4_k_m follows, written again here because this script
writes the GGUF both engines read). `--type q3_k_m` writes llama.cpp's Q3_K_M for a Llama
(llama-quant.cpp): Q6_K output.weight, attn_v Q5_K in the first two layers and Q4_K after,
ffn_down Q5_K in the first sixteenth and Q4_K after, attn_output Q4_K, Q3_K for the rest; `--type
q2_k` its Q2_K: Q6_K output.weight, attn_v Q4_K (GQA of 4 or more, else Q3_K), ffn_down and
attn_output Q3_K, Q2_K for the rest. Quants are random bytes, the f16 block scales drawn so the
weights have a trained Llama's spread (std ~0.01-0.02), as llmq-bench --synthetic does. Needs
numpy and the gguf-py package (the llama-cpp-python sdist's, put on sys.path with --gguf-py).

  python3 scripts/peer_gguf.py --gguf-py .gpu/peer/gguf-py --vocab VOCAB.gguf --type q4_0 -o out.gguf
"""
import argparse
import os
import sys

import numpy as np

PRESETS = {  # dim, hidden, layers, heads, kv_heads, vocab
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000),
    "tiny": (256, 512, 2, 4, 2, 32000),  # for checking the script itself
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--type", choices=["q4_0", "q5_0", "q8_0", "q4_k_m", "q3_k_m", "q2_k"], default="q4_0")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-2-7b")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf  # noqa: E402

    dim, hidden, layers, heads, kv_heads, vocab = PRESETS[a.preset]
    Q = gguf.GGMLQuantizationType
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q3_k_m": gguf.LlamaFileType.MOSTLY_Q3_K_M,
             "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K}[a.type]
    # type: (weights per block, bytes per block, [(byte offset of an f16 scale, its size)])
    # Q4_0: |q - 8| ~ 4; Q5_0: |q - 16| ~ 8; Q8_0: |q| ~ 64; Q4_K: d * 6-bit scale (~32) * q (0..15) - dmin * min;
    # Q6_K (d last, after ql, qh and 16 int8 scales ~64): d * scale * (q - 32); Q5_K as Q4_K with
    # q 0..31; Q3_K (d last): d * (6-bit scale - 32, ~16) * (q - 4, ~2); Q2_K (d, dmin last):
    # d * (4-bit scale) * q (0..3) - dmin * (4-bit min).
    layout = {Q.Q4_0: (32, 18, [(0, 4e-3)]), Q.Q5_0: (32, 22, [(0, 1.5e-3)]), Q.Q8_0: (32, 34, [(0, 2.5e-4)]),
              Q.Q4_K: (256, 144, [(0, 1e-4), (2, 1e-4)]), Q.Q6_K: (256, 210, [(208, 8e-6)]),
              Q.Q5_K: (256, 176, [(0, 5e-5), (2, 5e-5)]), Q.Q3_K: (256, 110, [(108, 5e-4)]),
              Q.Q2_K: (256, 84, [(80, 1e-3), (82, 1e-3)])}

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
    d_pool = (4e-3 * (0.5 + rng.random(1 << 20))).astype(np.float16).view(np.uint8).reshape(-1, 2)  # rescaled per type
    mats = [("token_embd.weight", vocab, dim)]
    for i in range(layers):
        hd = dim // heads
        mats += [(f"blk.{i}.attn_q.weight", dim, dim), (f"blk.{i}.attn_k.weight", kv_heads * hd, dim),
                 (f"blk.{i}.attn_v.weight", kv_heads * hd, dim), (f"blk.{i}.attn_output.weight", dim, dim),
                 (f"blk.{i}.ffn_gate.weight", hidden, dim), (f"blk.{i}.ffn_up.weight", hidden, dim),
                 (f"blk.{i}.ffn_down.weight", dim, hidden)]
    mats.append(("output.weight", vocab, dim))
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(layers) for n in ("attn", "ffn")]

    def use_more_bits(i):  # llama.cpp's rule for Q4_K_M's Q6_K layers (llama-quant.cpp)
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    def qtype(name):
        if a.type == "q2_k":
            if name == "output.weight":
                return Q.Q6_K
            if name.endswith("attn_v.weight"):
                return Q.Q4_K if heads // kv_heads >= 4 else Q.Q3_K
            return Q.Q3_K if name.endswith(("ffn_down.weight", "attn_output.weight")) else Q.Q2_K
        if a.type == "q3_k_m":
            i = int(name.split(".")[1]) if name.startswith("blk.") else -1
            if name == "output.weight":
                return Q.Q6_K
            if name.endswith("attn_v.weight"):
                return Q.Q5_K if i < 2 else Q.Q4_K
            if name.endswith("ffn_down.weight"):
                return Q.Q5_K if i < layers // 16 else Q.Q4_K
            return Q.Q4_K if name.endswith("attn_output.weight") else Q.Q3_K
        if a.type != "q4_k_m":
            return {"q4_0": Q.Q4_0, "q5_0": Q.Q5_0}.get(a.type, Q.Q8_0)
        if name == "output.weight":
            return Q.Q6_K
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1])):
            return Q.Q6_K
        return Q.Q4_K

    def matrix(k, name, rows, cols):
        per, block_bytes, scales = layout[qtype(name)]
        n_blocks = rows * cols // per
        nbytes = n_blocks * block_bytes
        start = (k * 7919 * 64) % (pool.size - 1)
        raw = np.resize(np.roll(pool, -start)[: min(pool.size, nbytes)], nbytes).reshape(n_blocks, block_bytes)
        for j, (off, sc) in enumerate(scales):
            raw[:, off:off + 2] = (np.resize(np.roll(d_pool, -k * 31 - j * 7, axis=0), (n_blocks, 2)).view(np.float16) * np.float16(sc / 4e-3)).view(np.uint8)
        return raw.reshape(rows, cols // per * block_bytes)

    for name, rows, cols in mats:
        per, block_bytes, _ = layout[qtype(name)]
        nbytes = rows * cols // per * block_bytes
        w.add_tensor_info(name, (rows, cols // per * block_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qtype(name))
    for name in norms:
        w.add_tensor_info(name, (dim,), np.dtype(np.float32), dim * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (name, rows, cols) in enumerate(mats):
        w.write_tensor_data(matrix(k, name, rows, cols))
    for name in norms:
        w.write_tensor_data(np.ones(dim, dtype=np.float32))
    w.close()
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
