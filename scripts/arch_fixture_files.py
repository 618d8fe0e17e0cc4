#!/usr/bin/env python3
"""Writes the weights of a transformers fixture (tests/fixtures/transformers/<name>/), which are
not committed: model.safetensors, and for fixtures whose manifest asks for it the GGUF laid out as
llama.cpp's converter writes it. The values come from a fixed generator (Python's random, seeded
by fixture and tensor name), so the files are the same on every machine; the fixture's
manifest.json names the tensors and shapes, expected.json holds transformers' logits for exactly
these weights (scripts/make_arch_fixtures.py). Standard library only (CI runs it).

    scripts/arch_fixture_files.py FIXTURE_DIR OUT_DIR TOK512
"""
import json
import math
import os
import random
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fuzz"))
import make_seeds  # noqa: E402  (its GGUF and safetensors writers)

# Hugging Face tensor names -> llama.cpp's GGUF names, as its converter (convert_hf_to_gguf.py)
# writes them; Phi-3's fused projections stay fused (attn_qkv, ffn_up holding gate and up).
GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def values(fixture, name, shape, gemma):
    """Every parameter random, so nothing is a no-op: norms near 1 (near 0 for Gemma's 1 + w),
    embeddings N(0, 0.25), projections N(0, 1/fan_in)."""
    rng = random.Random(fixture + "/" + name)
    n = math.prod(shape)
    if "norm" in name:
        return [(0.0 if gemma else 1.0) + 0.2 * rng.gauss(0, 1) for _ in range(n)]
    scale = 0.5 if ("embed_tokens" in name or "lm_head" in name) else 1 / math.sqrt(shape[-1])
    return [scale * rng.gauss(0, 1) for _ in range(n)]


def spm_vocab(tok512):
    """The stories260K tokenizer (llama2.c's format) as a GGUF SentencePiece vocabulary."""
    b = open(tok512, "rb").read()
    o, toks = 4, []
    while o < len(b):
        score, n = struct.unpack("<fi", b[o:o + 8])
        piece = b[o + 8:o + 8 + n].decode("utf-8", "replace").strip("\n")
        toks.append((piece.replace(" ", "\u2581"), score))
        o += 8 + n
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t, _ in toks]
    return [t for t, _ in toks], [sc for _, sc in toks], types


def llama3_factors(rp, head_dim):
    """Llama 3.1's frequency scaling as divisors of the plain frequencies (transformers'
    _compute_llama3_parameters, written as llama.cpp's converter stores it)."""
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    orig = rp["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rp["rope_theta"] ** (i / head_dim)
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def f32(xs):
    return struct.pack("<%df" % len(xs), *xs)


def interleave_rows(xs, rows, cols, heads):
    """Meta's interleaved RoPE pairs from rotate-half rows (llama.cpp's converter's permute)."""
    half = rows // heads // 2
    out = []
    for h in range(heads):
        for j in range(half):
            for part in (0, 1):
                r = h * 2 * half + part * half + j
                out += xs[r * cols:(r + 1) * cols]
    return out


def gguf_file(name, cfg, tensors, tok512):
    """The model as llama.cpp's converter writes a GGUF of it (F32)."""
    a = name
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rp = cfg["rope_parameters"]
    tokens, scores, types = spm_vocab(tok512)
    kv = {"general.architecture": a, "general.alignment": 32, "general.file_type": 0,
          a + ".context_length": cfg["max_position_embeddings"], a + ".embedding_length": cfg["hidden_size"],
          a + ".feed_forward_length": cfg["intermediate_size"], a + ".block_count": cfg["num_hidden_layers"],
          a + ".attention.head_count": cfg["num_attention_heads"], a + ".attention.head_count_kv": cfg["num_key_value_heads"],
          a + ".attention.key_length": head_dim, a + ".attention.value_length": head_dim,
          a + ".attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"], a + ".rope.dimension_count": head_dim,
          a + ".rope.freq_base": float(rp["rope_theta"]),
          "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ("str", tokens), "tokenizer.ggml.scores": ("f32", scores),
          "tokenizer.ggml.token_type": ("i32", types), "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    out = []
    if name == "phi3":
        orig = rp["original_max_position_embeddings"]
        kv[a + ".rope.scaling.original_context_length"] = orig
        kv[a + ".attention.sliding_window"] = cfg.get("sliding_window") or 0
        kv[a + ".rope.scaling.attn_factor"] = math.sqrt(1 + math.log(cfg["max_position_embeddings"] / orig) / math.log(orig))
        out += [("rope_factors_long.weight", [head_dim // 2], 0, f32(rp["long_factor"])),
                ("rope_factors_short.weight", [head_dim // 2], 0, f32(rp["short_factor"]))]
    if rp.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", [head_dim // 2], 0, f32(llama3_factors(rp, head_dim))))
    for hf, shape, xs in tensors:
        if hf.startswith("model.layers."):
            layer, rest = hf[len("model.layers."):].split(".", 1)
            stem, kind = rest.rsplit(".", 1)
            gname = "blk.%s.%s.%s" % (layer, GGUF_LAYER[stem], kind)
            if name == "llama" and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if stem == "self_attn.q_proj" else cfg["num_key_value_heads"]
                xs = interleave_rows(xs, shape[0], shape[1], heads)
        else:
            gname = GGUF_GLOBAL[hf]
        out.append((gname, shape, 0, f32(xs)))
    return make_seeds.gguf(kv, out)


def write(fixture_dir, out_dir, tok512):
    name = os.path.basename(os.path.normpath(fixture_dir))
    manifest = json.load(open(os.path.join(fixture_dir, "manifest.json")))
    cfg = json.load(open(os.path.join(fixture_dir, "config.json")))
    tensors = [(t, shape, values(name, t, shape, name == "gemma3")) for t, shape in manifest["tensors"]]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(make_seeds.safetensors([(t, "F32", shape, 4, f32(xs)) for t, shape, xs in tensors], meta={"format": "pt"}))
    if manifest.get("gguf"):
        with open(os.path.join(out_dir, name + ".gguf"), "wb") as f:
            f.write(gguf_file(name, cfg, tensors, tok512))


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2], sys.argv[3])
