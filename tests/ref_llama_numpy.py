#!/usr/bin/env python3
"""An independent Llama/Qwen2 forward pass in NumPy (float64), for checking the engine.

    ref_llama_numpy.py HF_DIR TOKEN_IDS OUT_FILE

HF_DIR is a Hugging Face checkpoint directory (config.json + model.safetensors, F32) in the
layout transformers uses: q/k rows in rotate-half RoPE order, optional attention biases
(self_attn.{q,k,v,o}_proj.bias), tied or separate lm_head. TOKEN_IDS is a comma-separated list;
OUT_FILE receives the logits of every position as raw little-endian float32 [T, vocab].

The arithmetic follows transformers' modeling_llama.py / modeling_qwen2.py: RMSNorm
x / sqrt(mean(x^2) + eps) * w; q = x Wq^T + bq (and k, v); RoPE on (i, i + d/2) pairs with
inv_freq = theta^(-2i/d); causal softmax attention with GQA (query head h reads KV head
h // (heads / kv_heads)); o = attn Wo^T + bo; SwiGLU MLP down(silu(gate(x)) * up(x)).
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_rotate_half(x, pos, theta):
    """x: [T, heads, d]; pairs (i, i + d/2) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = pos[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def forward(w, cfg, ids):
    dim = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", dim // heads)
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 10000.0)
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), k=1)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        if name + ".bias" in w:
            y = y + w[name + ".bias"]
        return y

    x = w["model.embed_tokens.weight"][ids]  # [T, dim]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").reshape(T, heads, hd)
        k = lin(h, p + "self_attn.k_proj").reshape(T, kv_heads, hd)
        v = lin(h, p + "self_attn.v_proj").reshape(T, kv_heads, hd)
        q, k = rope_rotate_half(q, pos, theta), rope_rotate_half(k, pos, theta)
        out = np.empty((T, heads, hd))
        for hh in range(heads):
            kvh = hh // (heads // kv_heads)
            s = q[:, hh, :] @ k[:, kvh, :].T / np.sqrt(hd) + mask  # [T, T]
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, hh, :] = s @ v[:, kvh, :]
        x = x + lin(out.reshape(T, heads * hd), p + "self_attn.o_proj")
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = lin(h, p + "mlp.gate_proj")
        x = x + lin(g / (1.0 + np.exp(-g)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rmsnorm(x, w["model.norm.weight"], eps)
    out_w = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ out_w.T  # [T, vocab]


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: ref_llama_numpy.py HF_DIR TOKEN_IDS OUT_FILE")
    d, ids, out = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3]
    with open(d + "/config.json") as f:
        cfg = json.load(f)
    w = {k: v.astype(np.float64) for k, v in load_file(d + "/model.safetensors").items()}
    logits = forward(w, cfg, np.array(ids))
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()
