#!/usr/bin/env python3
"""Writes tests/fixtures/transformers/: tiny random-weight checkpoints of every architecture llmq
reads from Hugging Face directories, made by transformers' own model classes, with their float32
reference logits. tests/test_transformers.cpp converts each with llmq-convert and checks llmq's
F32 logits against these to 1e-4 relative.

Run it through scripts/make_arch_fixtures.sh (it makes a venv with torch and transformers; CI
does not need them: configs, manifests and expected logits are committed, the weights regenerated).

Each fixture directory holds config.json (in transformers 5's form, with `rope_parameters`),
manifest.json (the tensors' names and shapes; the weights themselves are not committed: they
come from a fixed generator, scripts/arch_fixture_files.py, which the test runs), config_legacy.json (the same model in the older form most Hub
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
from safetensors import safe_open
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


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arch_fixture_files  # noqa: E402  (the weights, written the same way here and in CI)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/transformers"
    tok512 = sys.argv[2] if len(sys.argv) > 2 else "../shared/models/stories260K/tok512.bin"
    torch.manual_seed(0)
    for name, cls, cfg, cases in models():
        d = os.path.join(root, name)
        shutil.rmtree(d, ignore_errors=True)
        cls(cfg).float().save_pretrained(d, safe_serialization=True)  # config.json, and the names and shapes
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            names = [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump({"tensors": names, "gguf": name in ("phi3", "qwen3", "llama")}, f, indent=1)
        # The weights CI regenerates (scripts/arch_fixture_files.py), loaded back: the logits are theirs.
        arch_fixture_files.write(d, d, tok512)
        model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
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
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(out, f)
        for weights in ("model.safetensors", name + ".gguf"):  # not committed: CI writes them again
            if os.path.exists(os.path.join(d, weights)):
                os.remove(os.path.join(d, weights))
        size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
        print(f"{name}: {size / 1024:.0f} KiB, cases {[(n, c) for n, c in cases]}")


if __name__ == "__main__":
    main()
