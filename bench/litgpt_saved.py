#!/usr/bin/env python3
"""What autograd keeps per transformer block in LitGPT's own model, counted on the CPU: the
bytes of every distinct tensor storage the forward saves for backward (torch.autograd.graph.
saved_tensors_hooks), parameters excluded, for 2 blocks minus 1 block (the first block's input
needs no gradient, so it saves less). Compares with llmq-mem's LitGPT 2024 block formula
(mem/train_litgpt.cpp block_saved) for the same shape. A lab for issue 23's LitGPT rows, not a
test: needs `pip install litgpt` (it pulls torch) in a venv of its own.

    python bench/litgpt_saved.py [--T 64] [--h 256] [--H 688] [--heads 8] [--device cuda]
    python bench/litgpt_saved.py --lora-all   # LoRA on every Linear, then QLoRA as bitsandbytes 0.42 runs it
    python bench/litgpt_saved.py --list       # and every saved storage, to tell the CPU's list from the GPU's

--lora-all: LoRA on q, k, v, proj, MLP and head (the config hub's tiny-llama recipe), and the same
model with each frozen Linear keeping its input for the backward as bitsandbytes 0.42.0's
MatMul4Bit does (`ctx.tensors = (A, B)`; LitGPT pins that version; 0.43.2 stopped keeping A).
Its extra bytes per block are what QLoRA's 4-bit layers add to LoRA's saved tensors.
"""
import argparse

import torch
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable


class KeepInput(torch.autograd.Function):
    """A frozen Linear that keeps its input until the backward, as bitsandbytes 0.42.0's MatMul4Bit."""

    @staticmethod
    def forward(ctx, x, w):
        if ctx.needs_input_grad[0]:  # MatMul4Bit: if any(ctx.needs_input_grad[:2]), and B (4-bit) needs none
            ctx.save_for_backward(x)
        ctx.w = w
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w, None


def keep_frozen_inputs(m: torch.nn.Module) -> None:
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear) and not mod.weight.requires_grad and mod.bias is None:
            mod.forward = lambda x, w=mod.weight: KeepInput.apply(x, w)


def saved_bytes(n_layer: int, lora: bool, a, every: bool = False, bnb042: bool = False) -> int:
    on = dict(lora_query=lora, lora_value=lora, lora_key=lora and every, lora_projection=lora and every,
              lora_mlp=lora and every, lora_head=lora and every)
    cfg = Config(name="lab", block_size=4 * a.T, vocab_size=512, padded_vocab_size=512, n_layer=n_layer, n_head=a.heads,
                 n_query_groups=a.heads, n_embd=a.h, intermediate_size=a.H, mlp_class_name="LLaMAMLP",
                 norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0,
                 lora_r=8 if lora else 0, lora_alpha=16, lora_dropout=0.05, **on)
    torch.manual_seed(0)
    m = GPT(cfg).to(device=a.device, dtype=torch.bfloat16)
    if lora:
        mark_only_lora_as_trainable(m)
    if bnb042:
        keep_frozen_inputs(m)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}
    what: dict[int, str] = {}  # --list: each storage's first saved view

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in params:
            seen[p] = max(seen.get(p, 0), t.untyped_storage().nbytes())
            what.setdefault(p, f"{str(t.dtype):<15} {tuple(t.shape)} via {type(t.grad_fn).__name__ if t.grad_fn else 'leaf'}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(torch.randint(0, 512, (1, a.T), device=a.device))
    if a.list:
        print(f"-- {n_layer} block(s), LoRA {lora}, every {every}, bnb 0.42 {bnb042}: {len(seen)} storages, {sum(seen.values())} B")
        for p, n in seen.items():
            print(f"   {n:>12} B  {what[p]}")
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
    ap.add_argument("--lora-all", action="store_true", help="LoRA on every Linear, and QLoRA with bitsandbytes 0.42's kept inputs")
    ap.add_argument("--list", action="store_true", help="print every saved storage (bytes, dtype, shape, the op that made it)")
    a = ap.parse_args()
    if a.lora_all:
        lora = saved_bytes(2, True, a, every=True) - saved_bytes(1, True, a, every=True)
        qlora = saved_bytes(2, True, a, every=True, bnb042=True) - saved_bytes(1, True, a, every=True, bnb042=True)
        eth = 2 * a.T * a.h
        print(f"LoRA on every Linear: saved per block {lora} B (eTh x {lora / eth:.2f}); with bitsandbytes 0.42's kept inputs "
              f"{qlora} B: +{qlora - lora} B (eTh x {(qlora - lora) / eth:.2f}, eTH x {(qlora - lora) / (2 * a.T * a.H):.2f})")
        return
    for lora in (True, False):
        got = saved_bytes(2, lora, a) - saved_bytes(1, lora, a)
        want = modelled(lora, a)
        print(f"{'LoRA q,v' if lora else 'full FT '}: saved per block {got} B (eTh x {got / (2 * a.T * a.h):.2f}); "
              f"llmq-mem {want} B ({(want - got) / got:+.1%})")


if __name__ == "__main__":
    main()
