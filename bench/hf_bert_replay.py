#!/usr/bin/env python3
"""Hugging Face's BERT-large fine-tuning runs (the single-GPU training guide: V100-16GB,
nvidia-smi after `trainer.train()`), replayed without a GPU: the step's allocations are recorded
on meta tensors and fed to a model of PyTorch's CUDA caching allocator, which gives the peak of
allocated and of reserved bytes. A lab for issue 23's nine `hf-bert-large-*` cases, not a test:
needs `pip install torch` in a venv of its own (the PyPI wheel; no GPU used).

    python bench/hf_bert_replay.py [-b 4] [-s 512] [--fp16] [--gc] [--accum 4] [--torch110]

What it models, each written from the code of the time (transformers 4.15-4.27, PyTorch 1.10):
- the BertForSequenceClassification forward as transformers 4.2x writes it (eager attention, an
  fp32 extended mask added to the scores, dropout 0.1 as CUDA's fused kernel runs it: a 1-byte
  mask; GELU; post-LayerNorm), with torch.autocast's casts written out under --fp16 (16-bit
  matmuls, their weight casts cached until the forward ends; softmax, LayerNorm and the loss in
  fp32);
- --gc: per-layer reentrant checkpointing; --accum: gradient accumulation;
- the Trainer's step: backward, clip_grad_norm_, transformers.AdamW (per parameter; its
  sqrt(v) + eps is a temporary), zero_grad without set_to_none (gradients persist);
- --torch110: PyTorch <= 1.10's softmax, whose autograd node kept its input too;
- two cuBLAS workspaces (8 MiB + 128 KiB each, from the caching allocator): the forward's and the
  backward thread's handle;
- the allocator: bench/torch_replay.py's model of CUDACachingAllocator.

The reading to compare is reserved + the CUDA context the guide measured (1343 MiB).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torch_replay import MIB, Trace, cublas_workspace_bytes, cuda_dropout, replay, workspace

DEV = "meta"


# ---------------------------------------------------------------- BERT as transformers 4.2x runs it
class Amp:
    """torch.autocast's casts on CUDA, written out (meta tensors have no autocast)."""
    on, cache = False, {}

    @classmethod
    def h(cls, t):  # a lower_precision_fp op's argument; leaf weights' casts cached
        if not cls.on or t is None or t.dtype == torch.float16:
            return t
        if t.is_leaf and t.requires_grad:
            return cls.cache.setdefault(t, t.to(torch.float16))
        return t.to(torch.float16)

    @classmethod
    def f(cls, t):  # an fp32 op's argument
        return t.float() if cls.on and t.dtype == torch.float16 else t


class OldSoftmax(torch.autograd.Function):
    """PyTorch <= 1.10: _softmax_backward_data(grad, result, dim, self) kept `self` alive."""

    @staticmethod
    def forward(ctx, x, dtype):
        y = torch.softmax(x, -1, dtype=dtype)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return torch._softmax_backward_data(g, y, -1, x.dtype), None


OPTS = argparse.Namespace(torch110=False)


def linear(x, lin):
    return F.linear(Amp.h(x), Amp.h(lin.weight), Amp.h(lin.bias))


dropout = cuda_dropout


def layer_norm(x, ln):
    return F.layer_norm(Amp.f(x), ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def softmax(x):
    dtype = torch.float32 if Amp.on else None
    return OldSoftmax.apply(x, dtype) if OPTS.torch110 else F.softmax(x, dim=-1, dtype=dtype)


class Layer(nn.Module):
    def __init__(self, h, a, ffn, p):
        super().__init__()
        self.a, self.p = a, p
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-12), nn.LayerNorm(h, eps=1e-12)
        self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def heads(self, x):  # transpose_for_scores
        b, s, h = x.shape
        return x.view(b, s, self.a, h // self.a).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = (self.heads(linear(x, m)) for m in (self.q, self.k, self.v))
        scores = torch.matmul(Amp.h(q), Amp.h(k.transpose(-1, -2))) / math.sqrt(h // self.a) + mask
        probs = dropout(softmax(scores), self.p, self.training)
        ctx = torch.matmul(Amp.h(probs), Amp.h(v)).permute(0, 2, 1, 3).contiguous().view(b, s, h)
        att = layer_norm(dropout(linear(ctx, self.o), self.p, self.training) + x, self.ln1)
        mid = F.gelu(linear(att, self.up))
        return layer_norm(dropout(linear(mid, self.down), self.p, self.training) + att, self.ln2)


class Bert(nn.Module):
    """bert-large-uncased with a 2-label classification head (335M parameters)."""

    def __init__(self, h=1024, layers=24, a=16, ffn=4096, vocab=30522, labels=2, p=0.1):
        super().__init__()
        self.p, self.gc = p, False
        self.word, self.pos, self.tok_type = nn.Embedding(vocab, h), nn.Embedding(512, h), nn.Embedding(2, h)
        self.ln = nn.LayerNorm(h, eps=1e-12)
        self.layers = nn.ModuleList(Layer(h, a, ffn, p) for _ in range(layers))
        self.pool, self.cls = nn.Linear(h, h), nn.Linear(h, labels)
        self.register_buffer("pos_ids", torch.arange(512).expand(1, -1))
        self.register_buffer("type_ids", torch.zeros(1, 512, dtype=torch.long))

    def forward(self, ids, labels):
        b, s = ids.shape
        mask = torch.ones(b, s, device=ids.device)[:, None, None, :]  # get_extended_attention_mask, fp32
        mask = (1.0 - mask) * torch.finfo(torch.float32).min
        x = self.word(ids) + self.tok_type(self.type_ids[:, :s].expand(b, s)) + self.pos(self.pos_ids[:, :s])
        x = dropout(layer_norm(x, self.ln), self.p, self.training)
        for layer in self.layers:
            x = checkpoint(layer, x, mask, use_reentrant=True) if self.gc else layer(x, mask)
        logits = linear(dropout(torch.tanh(linear(x[:, 0], self.pool)), self.p, self.training), self.cls)
        return F.cross_entropy(Amp.f(logits), labels)


class HFAdamW:
    """transformers.optimization.AdamW's step (the Trainer's default optimizer then)."""

    def __init__(self, params, lr=5e-5, b1=0.9, b2=0.999, eps=1e-6):
        self.params, self.state = [p for p in params if p.requires_grad], {}
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    @torch.no_grad()
    def step(self):
        for p in self.params:
            st = self.state.get(p) or self.state.setdefault(p, {"m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            st["m"].mul_(self.b1).add_(p.grad, alpha=1 - self.b1)
            st["v"].mul_(self.b2).addcmul_(p.grad, p.grad, value=1 - self.b2)
            p.addcdiv_(st["m"], st["v"].sqrt().add_(self.eps), value=-self.lr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-b", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("-s", type=int, default=512, help="sequence length")
    ap.add_argument("--fp16", action="store_true", help="fp16=True (torch.amp)")
    ap.add_argument("--gc", action="store_true", help="gradient_checkpointing=True")
    ap.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--torch110", action="store_true", help="PyTorch <= 1.10's softmax (keeps its input)")
    ap.add_argument("--capacity-mib", type=float, default=16160 - 1343, help="V100-16GB less the measured context")
    ap.add_argument("--context-mib", type=float, default=1343, help="the guide's measured CUDA context")
    a = ap.parse_args(namespace=OPTS)
    trace = Trace()
    with trace:
        with torch.device(DEV):
            model = Bert()
        model.gc = a.gc
        opt = HFAdamW(model.parameters())
        workspaces = [workspace(cublas_workspace_bytes("V100"))]  # the forward's cuBLAS handle
        for _ in range(a.steps):
            for _ in range(a.accum):
                ids = torch.randint(0, 30522, (a.b, a.s), device=DEV)
                labels = torch.randint(0, 2, (a.b,), device=DEV)
                Amp.on = a.fp16
                loss = model(ids, labels)
                Amp.on, Amp.cache = False, {}
                loss = loss * (65536.0 if a.fp16 else 1.0) / a.accum  # GradScaler.scale
                if len(workspaces) == 1:  # the backward thread's cuBLAS handle
                    workspaces.append(workspace(cublas_workspace_bytes("V100")))
                loss.backward()
                del loss, ids, labels
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            model.zero_grad(set_to_none=False)
    alloc = replay(trace.events, a.capacity_mib * MIB)
    print(f"{len(trace.events)} events; peak allocated {alloc.peak_allocated / 2**30:.3f} GiB, peak reserved "
          f"{alloc.peak_reserved / 2**30:.3f} GiB, reserved at the end {alloc.reserved / 2**30:.3f} GiB "
          f"({alloc.releases} cache releases); with the context: {(alloc.reserved + a.context_mib * MIB) / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
