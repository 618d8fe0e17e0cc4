#!/usr/bin/env python3
"""Peak GPU memory of training Llama-shaped models in PyTorch, against `llmq-mem train --framework pytorch`.

Each configuration runs in a fresh child process: a Llama-shaped model with random weights (multi-head
attention, RMSNorm, RoPE, SwiGLU, untied output) trains for a few steps on random tokens, and the child
reports torch.cuda.max_memory_allocated(). The parent then asks `llmq-mem train --framework pytorch --json`
for its prediction of the same number and prints a Markdown table with the error, for bench/RESULTS.md.

    python3 bench/train_mem.py --llmq-mem build/llmq-mem            # all configurations
    python3 bench/train_mem.py --only 0,3 --steps 3 --json out.json  # a subset

Needs a CUDA GPU and PyTorch >= 2.1 (scaled_dot_product_attention, foreach AdamW).

What the model saves for backward is deliberately explicit, so that the estimator can count it tensor by
tensor (mem/train.cpp, pytorch_estimate): the RMSNorm is an autograd.Function that keeps its input and the
fp32 reciprocal RMS only; the normalized activations are cast once to the compute dtype and shared by the
projections that read them; attention is F.scaled_dot_product_attention (FlashAttention for 16-bit,
memory-efficient attention for fp32). Mixed precision is torch.autocast(bfloat16) over fp32 parameters;
"pure-bf16" converts the model to bfloat16. The optimizers are torch.optim.AdamW / SGD / Adafactor with foreach=True.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# name: (dim, hidden, layers, heads, vocab); multi-head attention (kv heads = heads), untied output.
SIZES = {
    "llama-134m": (768, 2048, 12, 12, 32000),
    "llama-374m": (1024, 2816, 24, 16, 32000),
    "llama-953m": (2048, 5632, 16, 16, 32000),
}

# At least 8 configurations: fp32 vs bf16 autocast (and pure bf16), AdamW vs SGD (and Adafactor), checkpointing on/off,
# batch and sequence variations, three model sizes.
CONFIGS = [
    {"size": "llama-134m", "precision": "fp32", "optimizer": "adamw", "ckpt": "none", "b": 4, "s": 512},
    {"size": "llama-134m", "precision": "bf16", "optimizer": "adamw", "ckpt": "none", "b": 4, "s": 512},
    {"size": "llama-134m", "precision": "bf16", "optimizer": "sgd", "ckpt": "none", "b": 8, "s": 1024},
    {"size": "llama-134m", "precision": "fp32", "optimizer": "sgd-momentum", "ckpt": "full", "b": 8, "s": 1024},
    {"size": "llama-374m", "precision": "bf16", "optimizer": "adamw", "ckpt": "none", "b": 2, "s": 1024},
    {"size": "llama-374m", "precision": "bf16", "optimizer": "adamw", "ckpt": "full", "b": 8, "s": 2048},
    {"size": "llama-374m", "precision": "fp32", "optimizer": "adamw", "ckpt": "none", "b": 1, "s": 2048},
    {"size": "llama-953m", "precision": "bf16", "optimizer": "adamw", "ckpt": "none", "b": 1, "s": 2048},
    {"size": "llama-953m", "precision": "bf16", "optimizer": "adamw", "ckpt": "full", "b": 8, "s": 2048},
    {"size": "llama-953m", "precision": "pure-bf16", "optimizer": "adamw", "ckpt": "none", "b": 2, "s": 1024},
    {"size": "llama-953m", "precision": "fp32", "optimizer": "sgd", "ckpt": "none", "b": 1, "s": 1024},
    # torch.optim.Adafactor (PyTorch >= 2.5), foreach: factored second moments, no momentum.
    {"size": "llama-374m", "precision": "fp32", "optimizer": "adafactor", "ckpt": "none", "b": 2, "s": 1024},
    {"size": "llama-953m", "precision": "bf16", "optimizer": "adafactor", "ckpt": "none", "b": 1, "s": 2048},
]


def hf_config(size):
    dim, hidden, layers, heads, vocab = SIZES[size]
    return {
        "_name_or_path": size,
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


# ----------------------------------------------------------------------------- the measured run (child)


def run_one(cfg, steps):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class RMSNormFn(torch.autograd.Function):
        """y = x / rms(x) * w, computed in fp32; saves x and the fp32 1/rms only."""

        @staticmethod
        def forward(ctx, x, w, eps):
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, w, rstd)
            return (x.float() * rstd * w.float()).to(x.dtype)

        @staticmethod
        def backward(ctx, grad):
            x, w, rstd = ctx.saved_tensors
            xhat = x.float() * rstd
            g = grad.float()
            gw = (g * xhat).sum(dim=tuple(range(g.dim() - 1)))
            gxh = g * w.float()
            gx = rstd * (gxh - xhat * (gxh * xhat).mean(-1, keepdim=True))
            return gx.to(x.dtype), gw.to(w.dtype), None

    def rope(x, cos, sin):  # x [b, s, heads, hd]; rotate-half pairs (i, i + hd/2)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Block(nn.Module):
        def __init__(self, dim, hidden, heads, cdt):
            super().__init__()
            self.heads, self.cdt = heads, cdt
            self.attn_norm = nn.Parameter(torch.ones(dim))
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.ffn_norm = nn.Parameter(torch.ones(dim))
            self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
            self.w3 = nn.Linear(dim, hidden, bias=False)  # up
            self.w2 = nn.Linear(hidden, dim, bias=False)  # down

        def forward(self, x, cos, sin):
            b, s, d = x.shape
            hd = d // self.heads
            xn = RMSNormFn.apply(x, self.attn_norm, 1e-5).to(self.cdt)  # one copy shared by q, k, v
            q = rope(self.wq(xn).view(b, s, self.heads, hd), cos, sin)
            k = rope(self.wk(xn).view(b, s, self.heads, hd), cos, sin)
            v = self.wv(xn).view(b, s, self.heads, hd)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, d))
            xn = RMSNormFn.apply(x, self.ffn_norm, 1e-5).to(self.cdt)
            return x + self.w2(F.silu(self.w1(xn)) * self.w3(xn))

    class Llama(nn.Module):
        def __init__(self, dim, hidden, layers, heads, vocab, cdt, ckpt):
            super().__init__()
            self.cdt, self.ckpt, self.heads = cdt, ckpt, heads
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim, hidden, heads, cdt) for _ in range(layers))
            self.norm = nn.Parameter(torch.ones(dim))
            self.out = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            b, s = ids.shape
            hd = self.embed.embedding_dim // self.heads
            inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=ids.device, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(s, device=ids.device, dtype=torch.float32), inv)
            ang = torch.cat((ang, ang), dim=-1)[:, None, :]  # [s, 1, hd]
            cos, sin = ang.cos().to(self.cdt), ang.sin().to(self.cdt)
            x = self.embed(ids)
            for blk in self.blocks:
                x = checkpoint(blk, x, cos, sin, use_reentrant=False) if self.ckpt else blk(x, cos, sin)
            return self.out(RMSNormFn.apply(x, self.norm, 1e-5).to(self.cdt))

    torch.manual_seed(0)
    dev = "cuda"
    dim, hidden, layers, heads, vocab = SIZES[cfg["size"]]
    mixed, pure = cfg["precision"] == "bf16", cfg["precision"] == "pure-bf16"
    cdt = torch.bfloat16 if (mixed or pure) else torch.float32
    model = Llama(dim, hidden, layers, heads, vocab, cdt, cfg["ckpt"] == "full").to(dev)
    if pure:
        model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    if cfg["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    elif cfg["optimizer"] == "adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9 if cfg["optimizer"] == "sgd-momentum" else 0.0,
                              foreach=True)
    b, s = cfg["b"], cfg["s"]
    data = torch.randint(0, vocab, (steps, b, s + 1), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        inp, tgt = data[i, :, :-1], data[i, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
            loss = F.cross_entropy(model(inp).float().view(-1, vocab), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "device_used": total - free,  # the CUDA context, cuBLAS and everything the caching allocator holds
        "params": params,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "loss": float(loss),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


# ----------------------------------------------------------------------------- prediction and table (parent)


def predict(llmq_mem, cfg, workdir, gpu):
    path = os.path.join(workdir, cfg["size"] + ".json")
    with open(path, "w") as f:
        json.dump(hf_config(cfg["size"]), f)
    cmd = [llmq_mem, "train", path, "--framework", "pytorch", "--precision", cfg["precision"], "--optimizer", cfg["optimizer"],
           "-b", str(cfg["b"]), "-s", str(cfg["s"]), "--checkpointing", cfg["ckpt"], "--gpu", gpu, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    return j["predicted_max_memory_allocated"], j.get("peak_phase", ""), j["params"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llmq-mem", default=os.path.join(os.path.dirname(__file__), "..", "build", "llmq-mem"))
    ap.add_argument("--steps", type=int, default=3, help="training steps per configuration (>= 2: optimizer states exist)")
    ap.add_argument("--only", default="", help="comma-separated configuration indices")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child mode: one configuration as JSON
    args = ap.parse_args()

    if args.one:
        print(json.dumps(run_one(json.loads(args.one), args.steps)))
        return 0

    picks = [int(i) for i in args.only.split(",") if i] or list(range(len(CONFIGS)))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i in picks:
            cfg = CONFIGS[i]
            child = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", json.dumps(cfg)],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                print(f"config {i} failed:\n{child.stderr}", file=sys.stderr)
                rows.append({"index": i, **cfg, "error": child.stderr.strip().splitlines()[-1:]})
                continue
            m = json.loads(child.stdout.strip().splitlines()[-1])
            pred, phase, pred_params = predict(args.llmq_mem, cfg, work, m["gpu"])  # the GPU sizes cuBLAS's workspace
            if m["params"] != pred_params:
                print(f"config {i}: parameter count differs: torch {m['params']}, llmq-mem {pred_params}", file=sys.stderr)
            err = 100.0 * (pred - m["max_memory_allocated"]) / m["max_memory_allocated"]
            rows.append({"index": i, **cfg, **m, "predicted": pred, "peak_phase": phase, "error_pct": err})
            print(f"[{i}] {cfg} measured {m['max_memory_allocated'] / 2**20:.1f} MiB, predicted {pred / 2**20:.1f} MiB, "
                  f"error {err:+.2f}%", file=sys.stderr)

    ok = [r for r in rows if "error_pct" in r]
    if ok:
        print(f"\nGPU: {ok[0]['gpu']}, PyTorch {ok[0]['torch']}, {args.steps} steps per configuration\n")
    print("| # | model | params | precision | optimizer | checkpointing | b | s | measured max_memory_allocated | "
          "llmq-mem predicted | error | predicted peak phase |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error_pct" not in r:
            print(f"| {r['index']} | {r['size']} | | {r['precision']} | {r['optimizer']} | {r['ckpt']} | {r['b']} | {r['s']} | "
                  f"failed: {r['error']} | | | |")
            continue
        print(f"| {r['index']} | {r['size']} | {r['params'] / 1e6:.0f}M | {r['precision']} | {r['optimizer']} | {r['ckpt']} | "
              f"{r['b']} | {r['s']} | {r['max_memory_allocated'] / 2**20:.1f} MiB | {r['predicted'] / 2**20:.1f} MiB | "
              f"{r['error_pct']:+.2f}% | {r['peak_phase']} |")
    if ok:
        worst = max(abs(r["error_pct"]) for r in ok)
        mean = sum(abs(r["error_pct"]) for r in ok) / len(ok)
        print(f"\nmean |error| {mean:.2f}%, worst {worst:.2f}% over {len(ok)} configurations (target: within 5%, aim 3%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok and len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
