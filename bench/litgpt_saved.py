#!/usr/bin/env python3
"""What autograd keeps per transformer block in LitGPT's own model, counted on the CPU: the
bytes of every distinct tensor storage the forward saves for backward (torch.autograd.graph.
saved_tensors_hooks), parameters excluded, for 2 blocks minus 1 block (the first block's input
needs no gradient, so it saves less). Compares with llmq-mem's LitGPT 2024 block formula
(mem/train_litgpt.cpp block_saved) for the same shape. A lab for issue 23's LitGPT rows, not a
test: needs `pip install litgpt` (it pulls torch) in a venv of its own.

    python bench/litgpt_saved.py [--T 64] [--h 256] [--H 688] [--heads 8] [--device cuda]
"""
import argparse

import torch
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable


def saved_bytes(n_layer: int, lora: bool, a) -> int:
    cfg = Config(name="lab", block_size=4 * a.T, vocab_size=512, padded_vocab_size=512, n_layer=n_layer, n_head=a.heads,
                 n_query_groups=a.heads, n_embd=a.h, intermediate_size=a.H, mlp_class_name="LLaMAMLP",
                 norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0,
                 lora_r=8 if lora else 0, lora_alpha=16, lora_dropout=0.05, lora_query=lora, lora_value=lora)
    torch.manual_seed(0)
    m = GPT(cfg).to(device=a.device, dtype=torch.bfloat16)
    if lora:
        mark_only_lora_as_trainable(m)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in params:
            seen[p] = max(seen.get(p, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(torch.randint(0, 512, (1, a.T), device=a.device))
    return sum(seen.values())


def modelled(lora: bool, a) -> int:
    """mem/train_litgpt.cpp block_saved, 2024 version, Llama block, LoRA on q and v with dropout."""
    e, T, h, H = 2, a.T, a.h, a.H
    norm = 8 * T * h
    attn = e * T * h + ((1 + e) * T * h if lora else 0) + e * T * 4 * h + e * T * h
    return norm + attn + (norm + e * T * h) + 4 * e * T * H


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--h", type=int, default=256)
    ap.add_argument("--H", type=int, default=688)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (FlashAttention's saved tensors on a GPU)")
    a = ap.parse_args()
    for lora in (True, False):
        got = saved_bytes(2, lora, a) - saved_bytes(1, lora, a)
        want = modelled(lora, a)
        print(f"{'LoRA q,v' if lora else 'full FT '}: saved per block {got} B (eTh x {got / (2 * a.T * a.h):.2f}); "
              f"llmq-mem {want} B ({(want - got) / got:+.1%})")


if __name__ == "__main__":
    main()
