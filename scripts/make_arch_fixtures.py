#!/usr/bin/env python3
"""Writes tests/fixtures/transformers/: tiny random-weight checkpoints of every architecture llmq
reads from Hugging Face directories, made by transformers' own model classes, with their float32
reference logits. tests/test_transformers.cpp converts each with llmq-convert and checks llmq's
F32 logits against these to 1e-4 relative.

Run it through scripts/make_arch_fixtures.sh (it makes a venv with torch and transformers; CI
does not need them: the fixtures are committed, each well under 2 MB).

Each fixture directory holds what save_pretrained writes (config.json in transformers 5's form,
with `rope_parameters`), config_legacy.json (the same model in the older form most Hub
checkpoints still use: rope_theta, rope_scaling, rope_local_base_freq), and expected.json:
{"cases": [{"ids": [...], "ctx": n, "rows": [positions], "logits": [[vocab floats] per row]}],
 "transformers": version, "torch": version}.
"""
import json
import math
import os
import shutil
import struct
import sys

import gguf

import torch
import transformers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

VOCAB = 512  # the stories260K tokenizer's (tests pass it with --tokenizer)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, attn_implementation="eager")


def models():
    """(name, model class, config, tokens per case and context) for every fixture."""
    head16 = dict(head_dim=16)
    yield "llama", LlamaForCausalLM, LlamaConfig(
        **COMMON, tie_word_embeddings=False, attention_bias=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32)), [(12, 64)]
    yield "mistral", MistralForCausalLM, MistralConfig(
        **COMMON, **head16, sliding_window=5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6)), [(12, 64)]
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(
        **COMMON, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6)), [(12, 64)]
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(
        **COMMON, head_dim=32, tie_word_embeddings=True, use_sliding_window=False, attention_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6)), [(12, 64)]
    gemma = dict(COMMON, head_dim=16)
    yield "gemma3", Gemma3ForCausalLM, Gemma3TextConfig(
        **gemma, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6)}), [(12, 64)]
    half = 8  # head_dim 16 / 2
    yield "phi3", Phi3ForCausalLM, Phi3Config(
        **COMMON, sliding_window=7, tie_word_embeddings=False, original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             short_factor=[1.0 + 0.15 * i for i in range(half)],
                             long_factor=[1.0 + 1.5 * i for i in range(half)])), [(12, 64), (80, 256)]


def randomize(model, gemma):
    """Every parameter random (norms near 1, or near 0 for Gemma's 1 + w), so nothing is a no-op."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def legacy(cfg: dict, name: str) -> dict:
    """The config in the older keys (rope_theta, rope_scaling, rope_local_base_freq)."""
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    rp = cfg["rope_parameters"]

    def scaling(p):
        s = {k: v for k, v in p.items() if k != "rope_theta"}
        return None if s.get("rope_type") == "default" else dict(s, type=s.pop("rope_type"))
    if name == "gemma3":
        out["rope_theta"] = rp["full_attention"]["rope_theta"]
        out["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        out["rope_scaling"] = scaling(rp["full_attention"])
        out["sliding_window_pattern"] = 2
        out.pop("layer_types", None)
        out.pop("_sliding_window_pattern", None)
    else:
        out["rope_theta"] = rp["rope_theta"]
        out["rope_scaling"] = scaling(rp)
    return out


# Hugging Face tensor names -> llama.cpp's GGUF names, as its converter (convert_hf_to_gguf.py)
# writes them; Phi-3's fused projections stay fused (attn_qkv, ffn_up holding gate and up).
GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


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


def write_gguf(d, name, model, cfg, tok512):
    """model as llama.cpp's converter writes a GGUF of it (F32), for the GGUF route's test."""
    w = gguf.GGUFWriter(os.path.join(d, name + ".gguf"), name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    rp = cfg.rope_parameters
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_file_type(0)
    if name == "phi3":
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rp["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rp["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", torch.tensor(rp["long_factor"], dtype=torch.float32).numpy())
        w.add_tensor("rope_factors_short.weight", torch.tensor(rp["short_factor"], dtype=torch.float32).numpy())
    if rp.get("rope_type") == "llama3":  # the converter's per-frequency divisors (conversion/llama.py)
        w.add_tensor("rope_freqs.weight", torch.tensor(llama3_factors(rp, head_dim), dtype=torch.float32).numpy())
    tokens, scores, types = spm_vocab(tok512)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf.startswith("model.layers."):
            layer, rest = hf[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{GGUF_LAYER[rest.rsplit('.', 1)[0]]}.{rest.rsplit('.', 1)[1]}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[hf]
        if name == "llama" and out.endswith(("attn_q.weight", "attn_k.weight")):  # Meta's interleaved pairs
            heads = cfg.num_attention_heads if out.endswith("attn_q.weight") else cfg.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(out, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/transformers"
    tok512 = sys.argv[2] if len(sys.argv) > 2 else "../shared/models/stories260K/tok512.bin"
    torch.manual_seed(0)
    for name, cls, cfg, cases in models():
        d = os.path.join(root, name)
        shutil.rmtree(d, ignore_errors=True)
        model = cls(cfg).float().eval()
        randomize(model, name == "gemma3")
        model.save_pretrained(d, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        with open(os.path.join(d, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(d, "config_legacy.json"), "w") as f:
            json.dump(legacy(saved, name), f, indent=2, sort_keys=True)
        out = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": []}
        g = torch.Generator().manual_seed(99)
        for n, ctx in cases:
            ids = torch.randint(3, VOCAB, (1, n), generator=g)
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            rows = list(range(n)) if n <= 16 else [0, 1, 31, 63, 64, n - 1]
            out["cases"].append({"ids": ids[0].tolist(), "ctx": ctx, "rows": rows,
                                 "logits": [[float(f"{x:.9g}") for x in logits[r].tolist()] for r in rows]})
        if name in ("phi3", "qwen3", "llama"):  # no real GGUF of these (llama: with 3.1 scaling) reaches this machine
            write_gguf(d, name, model, cfg, tok512)
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(out, f)
        size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
        print(f"{name}: {size / 1024:.0f} KiB, cases {[(n, c) for n, c in cases]}")


if __name__ == "__main__":
    main()
