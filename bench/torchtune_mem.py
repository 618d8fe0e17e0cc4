#!/usr/bin/env python3
"""Peak memory of one training step of torchtune's own recipes, measured on the CPU, beside
`llmq-mem train --framework torchtune` at the same shape. A lab for issue 23's torchtune rows
(the README's "optimization flags" table for Llama 3.2 3B), not a test: needs `pip install
torchtune==0.4.0 torchao==0.7.0` (it pulls torch) in a venv of its own.

What is measured: the step of recipes/full_finetune_single_device.py and
lora_finetune_single_device.py (torchtune 0.4.0) rebuilt from torchtune's components — a Llama 3.2
decoder (tied embedding, GQA, SwiGLU, RMSNorm in fp32) in bf16, the loss (torch CrossEntropyLoss
on fp32 logits, or CEWithChunkedOutputLoss with 8 chunks), activation checkpointing per layer,
torch.compile per layer and of the loss, the optimizer step fused into the backward, LoRA / QLoRA
(torchao NF4) adapters. The CPU allocator reports every allocation to the profiler
(profile_memory), so the peak is the most bytes live at once during the second step, over the
bytes live before it (parameters, optimizer states). Activation offloading moves saved tensors off
the device, which a CPU has no separate memory for: the lab stores them in numpy arrays, which
the profiler does not see, and copies them back into torch when the backward unpacks them, as
torchtune's OffloadActivations does (tensors of 1 KiB and more, not parameters, not the output
projection's).

    python bench/torchtune_mem.py [--layers 4] [--dim 256] [--heads 8] [--kv 2] [--ffn 704]
                                  [--vocab 10688] [--batch 2] [--seq 256] [--rows all]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from torchtune import training
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params

# The README's rows, each adding its technique to the one before (LoRA / QLoRA: their own recipe).
ROWS = {
    "packed": dict(),
    "compile": dict(compile=True),
    "chunked-ce": dict(compile=True, chunked=True),
    "ac": dict(compile=True, chunked=True, ac=True),
    "opt-in-bwd": dict(compile=True, chunked=True, ac=True, opt_in_bwd=True),
    "offload": dict(compile=True, chunked=True, ac=True, opt_in_bwd=True, offload=True),
    "lora": dict(compile=True, chunked=True, ac=True, offload=True, lora=True),
    "qlora": dict(compile=True, chunked=True, ac=True, offload=True, lora=True, qlora=True),
    # without compile, for the eager formulas
    "eager-chunked": dict(chunked=True),
    "eager-ac": dict(chunked=True, ac=True),
    "eager-lora": dict(chunked=True, ac=True, lora=True),
}


class NumpyOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of 1 KiB and more (not parameters) leave torch's memory in the forward and
    come back as a fresh copy in the backward: torchtune's OffloadActivations on a CPU."""

    def __init__(self):
        def pack(t):
            if isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < 1024 or not hasattr(t, "view"):
                return ("keep", t)
            try:
                raw = t.detach().contiguous().view(torch.uint8).numpy().copy()
            except (RuntimeError, TypeError):  # tensor subclasses (NF4) stay
                return ("keep", t)
            return ("np", raw, t.dtype, t.shape)

        def unpack(p):
            if p[0] == "keep":
                return p[1]
            _, raw, dtype, shape = p
            return torch.from_numpy(raw).clone().view(dtype).view(shape)

        super().__init__(pack, unpack)


class NoOffload(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)


def build(a, row):
    torch.manual_seed(0)
    dims = dict(vocab_size=a.vocab, num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv, embed_dim=a.dim,
                max_seq_len=a.seq, intermediate_dim=a.ffn)
    with training.set_default_dtype(torch.bfloat16):
        if row.get("lora"):
            model = lora_llama3_2(["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, apply_lora_to_output=False,
                                  lora_rank=a.rank, lora_alpha=2 * a.rank, quantize_base=bool(row.get("qlora")), **dims)
            set_trainable_params(model, get_adapter_params(model))
        else:
            model = llama3_2(**dims)
    if row.get("ac"):
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    loss_fn = CEWithChunkedOutputLoss() if row.get("chunked") else torch.nn.CrossEntropyLoss()
    if row.get("chunked"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    if row.get("compile"):
        training.compile_model(model, verbose=False)
        loss_fn = training.compile_loss(loss_fn, verbose=False)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = dict(fused=True) if row.get("lora") else {}  # the LoRA configs set fused: True
    if row.get("opt_in_bwd"):
        optims = {p: torch.optim.AdamW([p], lr=1e-5, **fused) for p in params}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optims)
        opt = None
    else:
        opt = torch.optim.AdamW(params, lr=1e-5, **fused)
        optims = {}
    return model, loss_fn, opt, optims


def out_linear(model):
    return model.output.linear if hasattr(model.output, "linear") else model.output


def step(model, loss_fn, opt, row, tokens, ignore):
    offload = row.get("offload")
    ctx = NumpyOffload() if offload else NoOffload()
    if offload:  # torchtune keeps the output projection's saved tensors on the device
        lin = out_linear(model)
        noop = NoOffload()
        h1 = lin.register_forward_pre_hook(lambda *_: noop.__enter__())
        h2 = lin.register_forward_hook(lambda *_: noop.__exit__(None, None, None))
    labels = torch.hstack((tokens[..., 1:], ignore[: tokens.shape[0]]))
    with ctx:
        logits = model(tokens)
    if not isinstance(logits, list):
        labels, logits = labels.reshape(-1), logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    if offload:
        h1.remove(), h2.remove()


def live_bytes(model, opt, optims):
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        for s in ([t] if not hasattr(t, "quantized_data") else [t.quantized_data, t.quantized_scalers, t.quantization_factor,
                                                                    t.scaler_mean]):
            seen[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
    for o in ([opt] if opt else []) + list(optims.values()):
        for st in o.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def measure(a, name):
    row = ROWS[name]
    model, loss_fn, opt, optims = build(a, row)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    ignore = torch.full((a.batch, 1), -100)
    step(model, loss_fn, opt, row, tokens, ignore)  # creates the optimizer states, compiles
    base = live_bytes(model, opt, optims)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, loss_fn, opt, row, tokens, ignore)
    events = prof.profiler.kineto_results.events()
    ev = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    run = peak = 0
    at = 0
    for t, n in ev:
        run += n
        if run > peak:
            peak, at = run, t
    if a.debug:  # the ops around the peak, innermost last
        ops = sorted((e.start_ns(), e.name()) for e in events
                     if e.name() != "[memory]" and e.start_ns() <= at <= e.start_ns() + e.duration_ns())
        print(f"  {name}: peak inside", " > ".join(n for _, n in ops[-6:]))
    return base, peak


def predicted(a, name):
    """llmq-mem train --framework torchtune at the same shape, device bytes without the CUDA lines."""
    row = ROWS[name]
    cfg = {"hidden_size": a.dim, "intermediate_size": a.ffn, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
           "num_key_value_heads": a.kv, "vocab_size": a.vocab, "max_position_embeddings": a.seq, "model_type": "llama",
           "tie_word_embeddings": True}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    cmd = [a.llmq_mem, "train", f.name, "--framework", "torchtune", "--precision", "pure-bf16", "--optimizer", "adamw",
           "-b", str(a.batch), "-s", str(a.seq), "--checkpointing", "full" if row.get("ac") else "none"]
    cmd += ["--ce-chunks", "8"] if row.get("chunked") else []
    cmd += ["--compile"] if row.get("compile") else []
    cmd += ["--optimizer-in-backward"] if row.get("opt_in_bwd") else []
    cmd += ["--offload-activations"] if row.get("offload") else []
    if row.get("lora"):
        cmd += ["--lora-rank", str(a.rank), "--lora-targets", "q,v,o,gate,up,down", "--lora-dropout", "0"]
    cmd += ["--qlora"] if row.get("qlora") else []
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
    os.unlink(f.name)
    if p.returncode != 0:
        return None
    lines = json.loads(p.stdout)["lines"]
    return sum(l["bytes"] for l in lines if l["place"] == "device" and "cuBLAS" not in l["name"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in dict(layers=4, dim=256, heads=8, kv=2, ffn=704, vocab=10688, batch=2, seq=256, rank=16).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--rows", default="all")
    ap.add_argument("--debug", action="store_true", help="name the ops the peak falls in")
    ap.add_argument("--llmq-mem", default="build/llmq-mem")
    a = ap.parse_args()
    torch.set_num_threads(2)
    names = list(ROWS) if a.rows == "all" else a.rows.split(",")
    print(f"| row | before the step (MiB) | peak (MiB) | llmq-mem (MiB) | error |\n|---|---:|---:|---:|---:|")
    for n in names:
        base, peak = measure(a, n)
        pred = predicted(a, n)
        tot = base + peak
        err = f"{100 * (pred - tot) / tot:+.1f}%" if pred else "–"
        print(f"| {n} | {base / 2**20:.2f} | {tot / 2**20:.2f} | {pred / 2**20 if pred else 0:.2f} | {err} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
