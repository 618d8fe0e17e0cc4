#!/usr/bin/env python3
"""Which prompt positions' logits transformers' generate() computes in its prefill, measured on the
CPU: the growth of the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs)
over the loaded model while generate() runs on a random-weight model whose vocabulary dwarfs the
rest (2 layers of width 256, 128,256 tokens), beside the sizes of every position's logits and the
last position's. Checks `llmq-mem generate --transformers-version` (mem/generate.cpp
all_logits_bytes, last_logits_since) without a GPU. Linux only; needs torch and transformers.

    python3 bench/generate_logits_cpu.py [--batch 4] [--prompt 512] [--model-type llama|gpt_bigcode]
    # another release beside the installed one (tokenizers must match it):
    pip install --target /tmp/tf444 "transformers==4.44.2" "tokenizers<0.20" "huggingface_hub<1.0"
    PYTHONPATH=/tmp/tf444 python3 bench/generate_logits_cpu.py
"""
import argparse
import json


def status(key: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def model(kind: str, vocab: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    if kind == "llama":
        cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    else:  # StarCoder / OctoCoder's architecture
        cfg = AutoConfig.for_model("gpt_bigcode", n_embd=256, n_inner=1024, n_layer=2, n_head=4, multi_query=True, vocab_size=vocab,
                                   n_positions=4096)
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    except TypeError:  # transformers < 4.56 names it torch_dtype
        return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--model-type", default="llama", choices=["llama", "gpt_bigcode"])
    a = ap.parse_args()
    import torch
    import transformers
    torch.set_num_threads(2)
    vocab = 128256
    m = model(a.model_type, vocab)
    ids = torch.randint(10, vocab, (a.batch, a.prompt))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        m.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), **kw)  # warm-up: allocator, kernels
        base = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    mib = 2.0**20
    print(json.dumps({"transformers": transformers.__version__, "model_type": a.model_type, "batch": a.batch, "prompt": a.prompt,
                      "vocab": vocab, "peak_growth_MiB": round((status("VmHWM") - base) / mib, 1),
                      "every_position_16bit_MiB": round(a.batch * a.prompt * vocab * 2 / mib, 1),
                      "last_position_fp32_MiB": round(a.batch * vocab * 4 / mib, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
