#!/usr/bin/env python3
"""LitGPT's fine-tuning peak, measured on a GPU or replayed without one: the training step of
litgpt 0.5's finetune/lora.py and finetune/full.py (forward, chunked cross-entropy, backward,
AdamW step, zero_grad) on random weights and tokens at a published recipe's full sequence length,
its torch.cuda.max_memory_allocated printed beside the published figure (mem/validation/
cases.jsonl, the config hub's A10G table). A lab for issue 23's LitGPT rows, not a test. Needs
torch and litgpt (on a GPU: gpu_check.sh's train phase installs the wheels gpu_pack.sh packed).

    python bench/litgpt_peak.py [--cases lg-ch-tinyllama-lora,lg-ch-tinyllama-full] [--json out.json]
    python bench/litgpt_peak.py --meta [--gpu A10G] [--cases ...]   # no GPU: the same step on meta
        # tensors, its allocations replayed through bench/torch_replay.py's caching-allocator model

What the replay keeps from LitGPT (litgpt 0.5.13 finetune/lora.py fit, finetune/full.py fit):
- the model in bf16 ("bf16-true"), LoRA adapters from the recipe, mark_only_lora_as_trainable;
- model.max_seq_length = the recipe's sequence (the RoPE cache's size);
- LoRA: model(x, lm_head_chunk_size=128), the last chunk shortened by one position;
  full: model(x), the logits shortened; then chunked_cross_entropy (chunks of 128);
- loss / gradient accumulation, backward; torch.optim.AdamW over the trainable parameters
  (foreach, LitGPT's default optimizer) every accumulation boundary, then zero_grad;
- the loop's references: `loss` becomes a float when it is logged, but `logits` (and through
  their grad_fn the whole graph of that micro-batch) live until the next forward returns
  (--free-logits deletes them after the backward, as the twenty-eighth session's replay did);
- --validate: validate() after the last step (no gradients, whole logits, two batches).
--meta replaces what a meta tensor would run otherwise than the GPU does: SDPA is the flash /
cuDNN kernels' footprint (the output and an fp32 log-sum-exp kept, q, k and v's gradients made by
the backward), dropout is CUDA's fused kernel (native_dropout: a 1-byte mask) and AdamW runs
foreach as on CUDA; cuBLAS's workspaces (one per handle, the forward's and the backward thread's)
are 32 MiB on sm_90 and 8 MiB + 128 KiB elsewhere (--gpu). QLoRA (--meta only) is Lightning's
BitsandbytesPrecision("nf4") over bitsandbytes 0.42.0, LitGPT's pin: every nn.Linear an NF4
Linear4bit (no double quantization) whose MatMul4Bit dequantizes to fp16 (Lightning quantizes a
.half() copy) and casts to bf16 for each product, and keeps its input as a Python attribute of
the node (ctx.tensors), which autograd does not free when the node's backward has run; the
optimizer is bitsandbytes' PagedAdamW (32-bit): a fused step, states in CUDA managed memory
(outside torch's counters) but for tensors under 1e5 elements.
What it leaves out: the data (every micro-batch is the recipe's full length; Alpaca2k's batches
are padded to their longest sample, at most max_seq_length), the generated example, Fabric (a
single device: backward is loss.backward()).
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "..", "mem", "validation", "cases.jsonl")
DEFAULT = ("lg-ch-tinyllama-full,lg-ch-tinyllama-lora,lg-ch-phi3-lora,lg-ch-mistral7b-lora,lg-ch-falcon7b-lora,"
           "lg-ch-gemma2b-lora")
TARGET_FLAGS = {"q": "lora_query", "k": "lora_key", "v": "lora_value", "proj": "lora_projection", "mlp": "lora_mlp",
                "head": "lora_head"}


def config_named(Config, name: str, **kw):
    """LitGPT's config by its Hugging Face name, or by the bare name older releases used."""
    try:
        return Config.from_name(name, **kw)
    except ValueError:
        return Config.from_name(name.split("/")[-1], **kw)


def build(case: dict, device: str = "cuda"):
    """The recipe's model in bf16 on `device`, random weights; returns (model, trainable parameters)."""
    r = case["recipe"]
    lora = r.get("lora")
    torch.set_default_dtype(torch.bfloat16)
    if lora:
        from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
        flags = {f: t in lora["targets"] for t, f in TARGET_FLAGS.items()}
        cfg = config_named(Config, case["model"]["name"], lora_r=lora["rank"], lora_alpha=lora["alpha"],
                           lora_dropout=lora["dropout"], **flags)
        with torch.device(device):
            m = GPT(cfg)
        mark_only_lora_as_trainable(m)
    else:
        from litgpt.model import GPT, Config
        cfg = config_named(Config, case["model"]["name"])
        with torch.device(device):
            m = GPT(cfg)
    torch.set_default_dtype(torch.float32)
    m.max_seq_length = r["seq"]
    return m, [p for p in m.parameters() if p.requires_grad]


def validate(case: dict, m, device: str, batches: int = 2) -> None:
    """LitGPT's validate(): no gradients, the whole logits (no lm_head chunks) and the loss on one
    chunk; a batch's logits live until the next batch's forward returns."""
    from litgpt.utils import chunked_cross_entropy
    r = case["recipe"]
    m.eval()
    with torch.no_grad():
        for _ in range(batches):
            x = torch.randint(0, m.config.padded_vocab_size, (r["micro_batch"], r["seq"]), device=device)
            logits = m(x)
            loss = chunked_cross_entropy(logits[..., :-1, :], x[..., 1:], chunk_size=0)
    del logits, loss
    m.train()


def train_steps(case: dict, m, trainable, steps: int, device: str, keep_logits: bool = False, optimizer: bool = True,
                validation: bool = False) -> int:
    """LitGPT's fit loop, `steps` optimizer steps (at most 2 micro-batches each); returns accum.
    keep_logits: as LitGPT's own loop, the `logits` of a micro-batch (and through their grad_fn its
    graph) stay referenced until the next forward returns; else they are deleted after the
    backward. optimizer False: bitsandbytes' PagedAdamW (32-bit), a fused step whose states live in
    CUDA managed memory, outside torch's counters, except for tensors under 1e5 elements."""
    from litgpt.utils import chunked_cross_entropy
    r = case["recipe"]
    opt = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0, foreach=True)
    accum = min(r.get("grad_accum", 1), 2)  # the peak repeats after the second micro-batch of a step
    b, s = r["micro_batch"], r["seq"]
    vocab = m.config.padded_vocab_size
    paged = []
    for it in range(steps * accum):
        x = torch.randint(0, vocab, (b, s), device=device)
        y = torch.randint(0, vocab, (b, s), device=device)
        if r.get("lora"):
            logits = m(x, lm_head_chunk_size=128)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, y[..., 1:])
        else:
            logits = m(x)
            loss = chunked_cross_entropy(logits[..., :-1, :], y[..., 1:])
        (loss / accum).backward()
        del loss  # LitGPT rebinds it to a float when it logs (log_interval 1)
        if not keep_logits:
            del logits
        if (it + 1) % accum == 0:
            if optimizer:
                opt.step()
            elif not paged:  # bitsandbytes 0.42 get_state_buffer: torch memory below 1e5 elements, else managed
                paged = [torch.zeros_like(p, dtype=torch.float32) for p in trainable if p.numel() < 1e5 for _ in range(2)]
            opt.zero_grad()
    if validation:  # LitGPT validates after an optimizer step, this micro-batch's logits still held
        validate(case, m, device)
    return accum


def replay(case: dict, steps: int, keep_logits: bool) -> dict:
    r = case["recipe"]
    if r.get("qlora") is not None or r["precision"] == "nf4":
        raise ValueError("QLoRA needs bitsandbytes on the GPU; --meta emulates it")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    m, trainable = build(case)
    m.train()
    weights = torch.cuda.memory_allocated()
    b, s = r["micro_batch"], r["seq"]
    t0 = time.time()
    accum = train_steps(case, m, trainable, steps, "cuda", keep_logits)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    out = {"case": case["id"], "model": case["model"]["name"], "micro_batch": b, "seq": s, "accum_replayed": accum,
           "trainable_params": sum(p.numel() for p in trainable), "weights_gb": weights / 1e9, "peak_gb": peak / 1e9,
           "reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "published_gb": case["measured_gb"],
           "seconds": round(time.time() - t0, 1)}
    del m, trainable
    torch.cuda.empty_cache()
    return out


class NF4Matmul(torch.autograd.Function):
    """bitsandbytes 0.42.0's MatMul4Bit (autograd/_functions.py) on meta tensors: the weight
    dequantized to fp16 and cast to the input's bf16 for the product, both dropped after it, the input A kept as a Python attribute of
    the node (ctx.tensors = (A, B), not save_for_backward) when it needs a gradient; the backward
    dequantizes again for A's gradient."""

    @staticmethod
    def forward(ctx, A, B, rows, bias):
        out = torch.nn.functional.linear(A, dequantize(B, (rows, A.shape[-1])).to(A.dtype), bias)
        ctx.shape, ctx.tensors = (rows, A.shape[-1]), (A, B) if ctx.needs_input_grad[0] else (None, None)
        return out

    @staticmethod
    def backward(ctx, g):
        grad_a = torch.matmul(g, dequantize(ctx.tensors[1], ctx.shape).to(g.dtype)) if ctx.needs_input_grad[0] else None
        return grad_a, None, None, None


def dequantize(B, shape):
    """dequantize_4bit: the weight in its quant_state dtype, fp16 (Lightning quantizes a .half() copy)."""
    return B.new_empty(shape, dtype=torch.float16)


def nf4_linears(m) -> None:
    """Every nn.Linear as bitsandbytes' Linear4bit through Lightning's BitsandbytesPrecision
    ("bnb.nf4": NF4 in blocks of 64, an fp32 absmax each, no double quantization), on meta."""
    for mod in m.modules():
        if type(mod) is torch.nn.Linear:
            rows, cols = mod.weight.shape  # Params4bit: the packed codes and the absmax, as bytes
            mod.weight = torch.nn.Parameter(torch.empty(rows * cols // 2 + rows * cols // 64 * 4, dtype=torch.uint8, device="meta"),
                                            requires_grad=False)
            mod.forward = lambda x, mod=mod, rows=rows: NF4Matmul.apply(x, mod.weight, rows, mod.bias)


def materialize(m) -> None:
    """Every parameter and buffer allocated anew (inside a Trace: recorded as the model's memory)."""
    with torch.no_grad():
        for p in m.parameters():
            p.data = torch.empty_like(p.data)
        for mod in m.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = torch.empty_like(buf)


def replay_meta(case: dict, steps: int, gpu: str, keep_logits: bool, validation: bool = False) -> dict:
    """The same step on meta tensors, its allocations through the caching-allocator model."""
    from torch_replay import FlashSDPA, Trace, cublas_workspace_bytes, cuda_dropout, replay as allocator_replay, workspace
    F = torch.nn.functional
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention = lambda q, k, v, *args, **kw: FlashSDPA.apply(q, k, v)
    F.dropout = cuda_dropout
    # older chunked_cross_entropy divides by max(1, a count tensor): a meta scalar has no value to compare
    truth = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda t: True if t.device.type == "meta" else truth(t)
    ws = cublas_workspace_bytes(gpu)
    qlora = case["recipe"].get("qlora") is not None or case["recipe"]["precision"] == "nf4"
    trace = Trace()
    try:
        m, trainable = build(case, "meta")
        if qlora:
            nf4_linears(m)
        m.train()
        with trace:
            materialize(m)
            handles = [workspace(ws), workspace(ws)]  # the forward's and the backward thread's cuBLAS
            accum = train_steps(case, m, trainable, steps, "meta", keep_logits, optimizer=not qlora, validation=validation)
            del m, trainable, handles
    finally:
        F.scaled_dot_product_attention, F.dropout, torch.Tensor.__bool__ = sdpa, dropout, truth
    a = allocator_replay(trace.events, float("inf"))
    r = case["recipe"]
    return {"case": case["id"], "model": case["model"]["name"], "micro_batch": r["micro_batch"], "seq": r["seq"],
            "accum_replayed": accum, "keep_logits": keep_logits, "validation": validation, "peak_gb": a.peak_allocated / 1e9,
            "reserved_gb": a.peak_reserved / 1e9, "published_gb": case["measured_gb"], "gpu": gpu, "events": len(trace.events)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT, help="comma-separated case ids from mem/validation/cases.jsonl")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per case (the first allocates AdamW's states)")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--meta", action="store_true", help="no GPU: meta tensors and the caching-allocator model")
    ap.add_argument("--gpu", default="H200", help="with --meta: the GPU whose cuBLAS workspace size to use")
    ap.add_argument("--free-logits", action="store_true",
                    help="delete each micro-batch's logits after its backward (the twenty-eighth session's replay); by "
                         "default they live until the next forward returns, as in LitGPT's loop")
    ap.add_argument("--validate", action="store_true", help="with --meta: and LitGPT's validation after the last step")
    a = ap.parse_args()
    cases = {c["id"]: c for c in map(json.loads, open(CASES))}
    rows = []
    print(f"meta tensors as a {a.gpu}" if a.meta else torch.cuda.get_device_name(0), f"torch {torch.__version__}")
    for cid in a.cases.split(","):
        try:
            keep = not a.free_logits
            row = replay_meta(cases[cid], a.steps, a.gpu, keep, a.validate) if a.meta else replay(cases[cid], a.steps, keep)
        except Exception as e:  # one case's failure (an unknown config name, out of memory) leaves the others
            row = {"case": cid, "error": f"{type(e).__name__}: {e}"}
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0 if all("error" not in r for r in rows) else 1)


if __name__ == "__main__":
    main()
