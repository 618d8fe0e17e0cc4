#!/usr/bin/env python3
"""Peak GPU memory of Hugging Face transformers' generate() with bf16 weights, against
`llmq-mem generate --framework transformers --weights bf16`.

Each configuration runs in a fresh child process: a model of a published architecture's shapes
(Llama-2-7B, TinyLlama-1.1B, Qwen2.5-1.5B, Mistral-7B) is built with random weights directly on the
GPU (AutoModelForCausalLM.from_config, bfloat16, default SDPA attention), then generates a fixed
number of tokens greedily from random prompt tokens; the child reports
torch.cuda.max_memory_allocated() over the generation (the weights are allocated throughout, so
they are in it). The parent asks `llmq-mem generate ... --json` for the same number (its device
total, without the gpu-other lines) and prints a Markdown table with the error, for
bench/RESULTS.md.

    python3 bench/generate_mem.py --llmq-mem build/llmq-mem [--only 0,2] [--json out.json]

Needs a CUDA GPU, PyTorch and transformers (no checkpoint: the weights are random).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# name: Hugging Face config fields (the model's published shapes).
MODELS = {
    "llama-2-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "tinyllama-1.1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
                       "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5},
}

CONFIGS = [
    {"model": "llama-2-7b", "b": 1, "prompt": 512, "new": 64},
    {"model": "llama-2-7b", "b": 8, "prompt": 1024, "new": 64},
    {"model": "tinyllama-1.1b", "b": 1, "prompt": 2048, "new": 128},
    {"model": "tinyllama-1.1b", "b": 16, "prompt": 512, "new": 64},
    {"model": "qwen2.5-1.5b", "b": 4, "prompt": 1024, "new": 64},
    {"model": "mistral-7b", "b": 1, "prompt": 4096, "new": 64},
]


def run_one(cfg):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MODELS[cfg["model"]])
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(hf, torch_dtype=torch.bfloat16)
    model.eval()
    ids = torch.randint(10, hf.vocab_size, (cfg["b"], cfg["prompt"]), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg["new"], min_new_tokens=cfg["new"],
                             do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"generated": int(out.shape[1] - ids.shape[1]), "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(), "device_used": total - free,
            "attn": getattr(model.config, "_attn_implementation", ""), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name()}


def predict(llmq_mem, cfg, workdir, gpu, transformers_version):
    path = os.path.join(workdir, cfg["model"] + ".json")
    with open(path, "w") as f:
        json.dump(MODELS[cfg["model"]], f)
    cmd = [llmq_mem, "generate", path, "--framework", "transformers", "--weights", "bf16", "-b", str(cfg["b"]), "--prompt",
           str(cfg["prompt"]), "--new-tokens", str(cfg["new"]), "--gpu", gpu, "--json",
           "--transformers-version", ".".join(transformers_version.split(".")[:2])]  # which prompt positions' logits
    j = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return j["totals"]["device"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llmq-mem", default=os.path.join(os.path.dirname(__file__), "..", "build", "llmq-mem"))
    ap.add_argument("--only", default="", help="comma-separated configuration indices")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    picks = [int(i) for i in args.only.split(",") if i] or list(range(len(CONFIGS)))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i in picks:
            cfg = CONFIGS[i]
            child = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True)
            if child.returncode != 0:
                print(f"config {i} failed:\n{child.stderr}", file=sys.stderr)
                rows.append({"index": i, **cfg, "error": child.stderr.strip().splitlines()[-1:]})
                continue
            m = json.loads(child.stdout.strip().splitlines()[-1])
            pred = predict(args.llmq_mem, cfg, work, m["gpu"], m["transformers"])
            err = 100.0 * (pred - m["max_memory_allocated"]) / m["max_memory_allocated"]
            rows.append({"index": i, **cfg, **m, "predicted": pred, "error_pct": err})
            print(f"[{i}] {cfg} measured {m['max_memory_allocated'] / 2**20:.1f} MiB, predicted {pred / 2**20:.1f} MiB, "
                  f"error {err:+.2f}%", file=sys.stderr)
    ok = [r for r in rows if "error_pct" in r]
    if ok:
        print(f"\nGPU: {ok[0]['gpu']}, PyTorch {ok[0]['torch']}, transformers {ok[0]['transformers']}, attention {ok[0]['attn']}\n")
    print("| # | model | b | prompt | new | measured max_memory_allocated | llmq-mem predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error_pct" not in r:
            print(f"| {r['index']} | {r['model']} | {r['b']} | {r['prompt']} | {r['new']} | failed: {r['error']} | | |")
            continue
        print(f"| {r['index']} | {r['model']} | {r['b']} | {r['prompt']} | {r['new']} | {r['max_memory_allocated'] / 2**20:.1f} MiB | "
              f"{r['predicted'] / 2**20:.1f} MiB | {r['error_pct']:+.2f}% |")
    if ok:
        errs = sorted(abs(r["error_pct"]) for r in ok)
        print(f"\nmedian |error| {errs[len(errs) // 2]:.2f}%, worst {errs[-1]:.2f}% over {len(ok)} configurations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok and len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
