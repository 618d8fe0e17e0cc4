#!/usr/bin/env python3
"""LitGPT's fine-tuning peak measured on a GPU: the training step of litgpt 0.5's finetune/lora.py
and finetune/full.py (forward, chunked cross-entropy, backward, torch AdamW step, zero_grad),
replayed on random weights and random tokens at a published recipe's full sequence length,
and torch.cuda.max_memory_allocated printed beside the published figure (mem/validation/
cases.jsonl, the config hub's A10G table). A lab for issue 23's LitGPT rows, not a test: it
asks whether the rows llmq-mem over-predicts ran at the recipe's max_seq_length, or whether the
block formula is wrong. Needs torch with CUDA and litgpt (gpu_check.sh's train phase installs
the wheels gpu_pack.sh packed).

    python bench/litgpt_peak.py [--cases lg-ch-tinyllama-lora,lg-ch-tinyllama-full] [--json out.json]

What the replay keeps from LitGPT (litgpt 0.5.13 finetune/lora.py fit, finetune/full.py fit):
- the model in bf16 ("bf16-true"), LoRA adapters from the recipe, mark_only_lora_as_trainable;
- model.max_seq_length = the recipe's sequence (the RoPE cache's size);
- LoRA: model(x, lm_head_chunk_size=128), the last chunk shortened by one position;
  full: model(x), the logits shortened; then chunked_cross_entropy (chunks of 128);
- loss / gradient accumulation, backward; torch.optim.AdamW over the trainable parameters
  (foreach, LitGPT's default optimizer) every accumulation boundary, then zero_grad.
What it leaves out: the data (every micro-batch is the recipe's full length; Alpaca2k's batches
are padded to their longest sample, at most max_seq_length), the validation and the generated
example (both without gradients), Fabric (a single device: backward is loss.backward()).
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


def build(case: dict):
    """The recipe's model in bf16 on the GPU, random weights; returns (model, trainable parameters)."""
    r = case["recipe"]
    lora = r.get("lora")
    torch.set_default_dtype(torch.bfloat16)
    if lora:
        from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
        flags = {f: t in lora["targets"] for t, f in TARGET_FLAGS.items()}
        cfg = Config.from_name(case["model"]["name"], lora_r=lora["rank"], lora_alpha=lora["alpha"],
                               lora_dropout=lora["dropout"], **flags)
        with torch.device("cuda"):
            m = GPT(cfg)
        mark_only_lora_as_trainable(m)
    else:
        from litgpt.model import GPT, Config
        cfg = Config.from_name(case["model"]["name"])
        with torch.device("cuda"):
            m = GPT(cfg)
    torch.set_default_dtype(torch.float32)
    m.max_seq_length = r["seq"]
    return m, [p for p in m.parameters() if p.requires_grad]


def replay(case: dict, steps: int) -> dict:
    from litgpt.utils import chunked_cross_entropy
    r = case["recipe"]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    m, trainable = build(case)
    m.train()
    weights = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0)
    accum = min(r.get("grad_accum", 1), 2)  # the peak repeats after the second micro-batch of a step
    b, s = r["micro_batch"], r["seq"]
    vocab = m.config.padded_vocab_size
    t0 = time.time()
    for it in range(steps * accum):
        x = torch.randint(0, vocab, (b, s), device="cuda")
        y = torch.randint(0, vocab, (b, s), device="cuda")
        if r.get("lora"):
            logits = m(x, lm_head_chunk_size=128)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, y[..., 1:])
        else:
            logits = m(x)
            loss = chunked_cross_entropy(logits[..., :-1, :], y[..., 1:])
        (loss / accum).backward()
        del logits, loss
        if (it + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    out = {"case": case["id"], "model": case["model"]["name"], "micro_batch": b, "seq": s, "accum_replayed": accum,
           "trainable_params": sum(p.numel() for p in trainable), "weights_gb": weights / 1e9, "peak_gb": peak / 1e9,
           "reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "published_gb": case["measured_gb"],
           "seconds": round(time.time() - t0, 1)}
    del m, opt, trainable
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT, help="comma-separated case ids from mem/validation/cases.jsonl")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per case (the first allocates AdamW's states)")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    cases = {c["id"]: c for c in map(json.loads, open(CASES))}
    rows = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for cid in a.cases.split(","):
        try:
            row = replay(cases[cid], a.steps)
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
