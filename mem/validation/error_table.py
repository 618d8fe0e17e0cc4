#!/usr/bin/env python3
"""The error table of `llmq-mem train` against the published measurements in cases.jsonl
(issue 23): for every case, whether llmq-mem can express its recipe (and if not, why), the
measured peak, llmq-mem's prediction for what was measured, and the error; then the median and
largest absolute error over the expressible cases and their share of all cases.

What is compared: torch.cuda.max_memory_allocated / active peaks / max_memory_reserved count the
PyTorch allocator's memory, so they are compared with llmq-mem's per-GPU total without the CUDA
context ("device"); nvidia-smi readings with the total including it ("device_total"); an
unstated measure with "device".

A training case whose published peak is below the weights and optimizer states its own recipe
must hold (llmq-mem's lines of those names) cannot come from that recipe: it is marked in the
table and left out of the median and max, which are printed with it as well.

    python3 mem/validation/error_table.py [--llmq-mem build/llmq-mem] [--json out.json] [--peer llm_analysis.json]

--peer adds llm-analysis's column: `python3 mem/validation/llm_analysis.py --json llm_analysis.json` first.

Sources of the cases: SOURCES.md beside this file. Needs only python3 and a built llmq-mem.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

GATED = {"llama", "mistral", "gemma", "gemma2", "phi3", "qwen2", "qwen3"}  # gate/up/down MLP blocks
GPT_STYLE = {"bert", "bloom"}  # LayerNorm + GELU blocks with biases llmq-mem's shape knows (mem/shape.cpp)
# LitGPT block recipes llmq-mem's --framework litgpt knows (--block), by the case's arch.
LITGPT_BLOCKS = {"llama": "llama", "mistral": "mistral", "gemma": "gemma", "gemma2": "gemma2", "phi3": "phi3", "qwen2": "qwen2",
                 "gpt_neox": "gpt-neox", "phi": "phi", "falcon": "falcon"}
# "lora-fa": PEFT's LoRA-FA optimizer keeps AdamW's moments for lora_B alone, but as PEFT's method comparison
# runs it every lora_A trains again as far as autograd goes (SOURCES.md), so it is LoRA with AdamW less A's
# moments: llmq-mem's AdamW counts those too (8 B per A parameter, 44 MB for its Llama-3.2-3B row).
OPTIMIZERS = {"adamw": "adamw", "paged-adamw-32bit": "adamw", "adamw-8bit": "adam8bit", "paged-adamw-8bit": "adam8bit",
              "sgd": "sgd", "adafactor": "adafactor", "lora-fa": "adamw"}
PRECISIONS = {"fp32": "fp32", "fp16-mixed": "amp", "bf16-mixed": "amp", "pure-bf16": "pure-bf16", "nf4": "pure-bf16"}
TARGETS = {"q": "q", "q_proj": "q", "query": "q", "k": "k", "k_proj": "k", "key": "k", "v": "v", "v_proj": "v", "value": "v",
           "proj": "o", "o_proj": "o", "output_proj": "o", "mlp": "gate,up,down", "head": "head",
           "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
           "all-linear": "q,k,v,o,gate,up,down", "query_key_value": "qkv"}


def measured_bytes(case: dict) -> float:
    """The published value in bytes, from the unit the source used (unit_note)."""
    v, note = float(case["measured_gb"]), case.get("unit_note", "")
    if "measured_gb = MiB/1024" in note:  # nvidia-smi's MiB, already divided into GiB
        return v * 2**30
    if "1024**2" in note or "MiB" in note:
        return v * 2**20
    if "1024**3" in note or "2**30" in note or note.startswith("GiB"):
        return v * 2**30
    return v * 1e9


def why_not(case: dict) -> str | None:
    """None when llmq-mem train can express the case, else the reason."""
    r, m = case["recipe"], case["model"]
    if case["kind"] == "infer":
        if r["seq"] is None:
            return "prompt length not published"
        if r["precision"] not in ("pure-bf16", "int8", "nf4"):
            return f"precision {r['precision']}"
        return None
    litgpt = r.get("framework") == "litgpt" and m["arch"] in LITGPT_BLOCKS
    if m["arch"] not in GATED and m["arch"] not in GPT_STYLE and not litgpt:
        return f"{m['arch']} blocks (non-Llama MLP/attention)"
    if r["optimizer"] not in OPTIMIZERS:
        return f"optimizer {r['optimizer']}"
    if r["precision"] not in PRECISIONS:
        return f"precision {r['precision']}"
    if r["micro_batch"] is None or r["seq"] is None:
        return "batch or sequence length not published"
    if r["checkpointing"] not in ("none", "full", "selective"):
        return f"checkpointing {r['checkpointing']}"
    if r["offload"] == "cpu-params" and r["sharding"] not in ("zero3", "fsdp-full"):
        return "parameter offload without ZeRO-3 / FSDP full sharding"
    if r["offload"] not in ("none", "cpu-optimizer", "cpu-params"):
        return f"offload {r['offload']}"
    lora = r.get("lora")
    if lora and any(t not in TARGETS for t in lora.get("targets") or []):
        return f"LoRA targets {lora['targets']}"
    if None in (m.get("hidden"), m.get("layers"), m.get("heads"), m.get("ffn"), m.get("vocab")):
        return "model dimensions missing"
    return None


def config_json(case: dict, folder: Path) -> Path:
    m = case["model"]
    path = folder / f"{case['id']}.json"
    path.write_text(json.dumps({"_name_or_path": m["name"], "hidden_size": m["hidden"], "intermediate_size": m["ffn"],
                                "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
                                "num_key_value_heads": m.get("kv_heads") or m["heads"], "vocab_size": m["vocab"],
                                "max_position_embeddings": max(4096, case["recipe"]["seq"]),
                                "model_type": m["arch"], **({"head_dim": m["head_dim"]} if m.get("head_dim") else {}),
                                "tie_word_embeddings": bool(m.get("tied_embeddings", False)),
                                **({"architectures": ["BertForSequenceClassification"], "num_labels": m.get("labels", 2)}
                                   if m.get("task") == "sequence-classification" else {})}))
    return path


def litgpt_version(case: dict) -> str:
    """2023 for the lit-gpt 8641822 runs (resource tables), else 2024 (litgpt 00af8b0d, config hub)."""
    return "2023" if "8641822" in case["notes"] + case["source"].get("where", "") else "2024"


def transformers_framework(case: dict) -> bool:
    """PEFT / transformers runs that --framework transformers models: a Llama-family model on one GPU
    in pure bf16 or fp32, fully or with LoRA / DoRA, no sharding, no QLoRA (the PEFT method
    comparison's rows, run on transformers 5.13.1)."""
    r, m = case["recipe"], case["model"]
    targets = {t for name in (r.get("lora") or {}).get("targets") or [] for t in TARGETS.get(name, "?").split(",")}
    gqa = (m.get("kv_heads") or m["heads"]) != m["heads"]
    return (r.get("framework") == "peft" and m["arch"] in ("llama", "mistral", "qwen2") and (r.get("gpus") or 1) == 1
            and r["sharding"] == "none" and r["offload"] == "none" and not r.get("qlora")
            and r["precision"] in ("pure-bf16", "fp32") and r.get("transformers_version", "").startswith("5.")
            and r["optimizer"] in ("adamw", "sgd", "lora-fa") and r["checkpointing"] in ("none", "full")
            and targets <= {"q", "k", "v", "o", "gate", "up", "down"} and r.get("flash_attention") is not False
            and not (r["precision"] == "fp32" and gqa and not r.get("padded")))


def framework_flags(case: dict) -> list[str]:
    """--framework and its recipe flags: LitGPT's block recipe, torchtune's levers; none for the analytic formula."""
    r = case["recipe"]
    if r.get("framework") == "litgpt" and case["model"]["arch"] in LITGPT_BLOCKS and r["precision"] != "bf16-mixed":
        out = ["--framework", "litgpt", "--block", LITGPT_BLOCKS[case["model"]["arch"]], "--litgpt-version", litgpt_version(case)]
        return out + (["--lora-dropout", str(r["lora"].get("dropout", 0.05))] if r.get("lora") else [])
    if transformers_framework(case):
        return ["--framework", "transformers"] + (["--padded"] if r.get("padded") else [])
    if r.get("framework") == "torchtune" and "compile" in r:
        out = ["--framework", "torchtune", "--ce-chunks", str(r.get("ce_chunks") or 0)]
        out += ["--compile"] if r["compile"] else []
        out += ["--optimizer-in-backward"] if r.get("optimizer_in_bwd") else []
        out += ["--offload-activations"] if r.get("activation_offload") else []
        return out + (["--paged-optimizer"] if r["optimizer"].startswith("paged-") else [])
    return []


def adapter_flags(case: dict) -> list[str]:
    """LoRA's rank and targets (PEFT's fp32 adapter inputs on a bf16 base; DoRA), QLoRA's NF4 base."""
    r, out = case["recipe"], []
    lora = r.get("lora")
    if lora:
        targets = sorted({t for name in lora.get("targets") or ["q", "v"] for t in TARGETS[name].split(",")})
        out += ["--lora-rank", str(lora["rank"]), "--lora-targets", ",".join(targets)]
        if transformers_framework(case):  # PEFT's LoRA tensor by tensor: its dropout (LoraConfig's default 0) matters
            out += ["--lora-dropout", str(lora.get("dropout") or 0)]
        elif r.get("framework") == "peft" and r["precision"] == "pure-bf16" and not r.get("qlora"):
            out.append("--lora-fp32-inputs")  # PEFT's fp32 adapters on a bf16 base (autocast_adapter_dtype)
        if lora.get("dora"):  # PEFT's use_dora; its dropout decides what the base output is computed from
            out += ["--dora"] + ([] if transformers_framework(case) else ["--lora-dropout", str(lora.get("dropout") or 0)])
    if r["precision"] == "nf4" or r.get("qlora"):
        out.append("--qlora")
        if r.get("qlora") and r["qlora"].get("double_quant") is False:
            out.append("--no-double-quant")
    return out


SHARDING = {"fsdp-full": ["--fsdp", "full"], "zero3": ["--zero", "3"], "zero2": ["--zero", "2"], "zero1": ["--zero", "1"]}


def sharding_flags(case: dict) -> list[str]:
    """Ranks, who shards (DeepSpeed's ZeRO stage or FSDP's units) and what is offloaded."""
    r = case["recipe"]
    gpus = r.get("gpus") or 1
    out = ["--dp", str(gpus)] if gpus > 1 else []
    if gpus > 1 or r["offload"] != "none":  # every one-GPU sharded case in the set offloads
        out += SHARDING.get(r["sharding"], [])
        out += ["--fsdp-embedding-units"] if r["sharding"] == "fsdp-full" and r.get("fsdp_embedding_units") else []
    if r["offload"] in ("cpu-optimizer", "cpu-params"):
        out += ["--offload-optimizer", "cpu"]
    return out + (["--offload-params", "cpu"] if r["offload"] == "cpu-params" else [])


def flags(case: dict) -> list[str]:
    """llmq-mem train's flags for a training case."""
    r = case["recipe"]
    out = ["--precision", PRECISIONS[r["precision"]], "--optimizer", OPTIMIZERS[r["optimizer"]], "-b", str(r["micro_batch"]),
           "-s", str(r["seq"]), "--checkpointing", r["checkpointing"]]
    if case.get("gpu"):
        out += ["--gpu", case["gpu"]]  # PyTorch's cuBLAS workspace size depends on it (sm_90 or not)
    if r.get("torch_version"):  # before 1.11, softmax keeps its input for the backward
        out += ["--torch-version", r["torch_version"]]
    if r.get("cuda_context_mib"):  # measured by the same source (e.g. nvidia-smi after CUDA init)
        out += ["--cuda-context", str(r["cuda_context_mib"])]
    out += framework_flags(case)
    if r.get("grad_accum"):
        out += ["--grad-accum", str(r["grad_accum"])]
    if r.get("flash_attention") is False:
        out.append("--no-flash")
    return out + adapter_flags(case) + sharding_flags(case)


def generate_flags(case: dict) -> list[str]:
    """llmq-mem generate's flags for an inference case: the framework, the weight format, the
    prompt and KV-cache length (torchtune: its static cache; LitGPT: prompt + 50 new tokens)."""
    r = case["recipe"]
    fw = {"hf-transformers": "transformers", "litgpt": "litgpt", "torchtune": "torchtune"}[r["framework"]]
    weights = {"pure-bf16": "bf16", "int8": "int8"}.get(r["precision"])
    if weights is None:  # 4-bit: transformers' load_in_4bit of 2023 was FP4 with float32 compute
        dq = (r.get("qlora") or {}).get("double_quant")
        weights = "fp4" if fw == "transformers" else "nf4-dq" if dq else "nf4"
    out = ["--framework", fw, "--weights", weights, "-b", str(r["micro_batch"] or 1)]
    if case.get("gpu"):
        out += ["--gpu", case["gpu"]]
    if fw == "torchtune":
        out += ["--prompt", "6", "--kv-len", str(r["seq"])]
    else:
        new = 60 if fw == "transformers" else 50
        out += ["--prompt", str(max(1, r["seq"] - new)), "--new-tokens", str(new)]
    if fw == "transformers" and weights == "fp4":
        out += ["--compute-bytes", "4"]
    if fw == "transformers" and r.get("transformers_version"):  # which prompt positions' logits the prefill computes
        out += ["--transformers-version", r["transformers_version"]]
    if not r.get("flash_attention"):
        out.append("--no-flash")
    return out


def predict(llmq_mem: str, case: dict, folder: Path) -> tuple[float | None, str, float]:
    if case["kind"] == "infer":
        cmd = [llmq_mem, "generate", str(config_json(case, folder)), *generate_flags(case), "--json"]
    else:
        cmd = [llmq_mem, "train", str(config_json(case, folder)), *flags(case), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, "llmq-mem refused: " + (p.stderr.strip().splitlines() or ["?"])[-1], 0.0
    report = json.loads(p.stdout)
    key = "device_total" if case["measured_what"] == "nvidia-smi" else "device"
    return float(report["totals"][key]), " ".join(cmd[2:]), states_floor(case, report)


def states_floor(case: dict, report: dict) -> float:
    """Bytes a training step cannot run without: the device's weights and optimizer states (0 for
    inference). A published peak below it cannot come from the recipe the source names."""
    if case["kind"] == "infer":
        return 0.0
    return sum(line["bytes"] for line in report["lines"]
               if line["place"] == "device" and line["name"].startswith(("parameters", "optimizer states")))


def evaluate(cases: list[dict], llmq_mem: str, peer: dict) -> list[dict]:
    """A row per case: measured bytes, and llmq-mem's prediction and error or why it cannot express the case; a
    case measured below its own weights + optimizer states is marked inconsistent; llm-analysis's prediction when given."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            row = {"id": c["id"], "kind": c["kind"], "model": c["model"]["name"], "measured": measured_bytes(c),
                   "what": c["measured_what"]}
            reason = why_not(c)
            if reason is None:
                pred, how, floor = predict(llmq_mem, c, Path(tmp))
                if pred is None:
                    reason = how
                else:
                    row.update(predicted=pred, error=pred / row["measured"] - 1, flags=how)
                    if row["measured"] < floor:
                        row["inconsistent"] = (f"measured below the recipe's own weights + optimizer states "
                                               f"({floor / 1e9:.2f} GB)")
            row["not_expressible"] = reason
            p = peer.get(c["id"], {}).get("predicted_bytes")
            if p is not None:
                row["peer"] = p
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| case | kind | measured (GB) | llmq-mem (GB) | error | llm-analysis (GB) | error | compared with |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        pe = f"{r['peer'] / 1e9:.2f} | {100 * (r['peer'] / r['measured'] - 1):+.1f}%" if "peer" in r else "– | –"
        if r["not_expressible"]:
            print(f"| {r['id']} | {r['kind']} | {r['measured'] / 1e9:.2f} | – | – | {pe} | not expressible: {r['not_expressible']} |")
        else:
            print(f"| {r['id']} | {r['kind']} | {r['measured'] / 1e9:.2f} | {r['predicted'] / 1e9:.2f} | {100 * r['error']:+.1f}% | "
                  f"{pe} | {r['what']}{'; ' + r['inconsistent'] if 'inconsistent' in r else ''} |")


def print_summary(name: str, errs: list[float], inconsistent: list[float], n: int) -> None:
    if name == "llmq-mem":
        print(f"\n{name}: expressible {len(errs) + len(inconsistent)} of {n} cases "
              f"({100 * (len(errs) + len(inconsistent)) / n:.0f}%); {len(inconsistent)} of them measure less than their "
              f"recipe's own weights + optimizer states (marked in the table)")
        if inconsistent:
            every = errs + inconsistent
            print(f"all {len(every)}: median {100 * statistics.median(every):.1f}%, max {100 * max(every):.1f}%")
            print(f"the {len(errs)} consistent ones: ", end="")
    else:
        print(f"\n{name}: expressible {len(errs)} of {n} cases ({100 * len(errs) / n:.0f}%)")
    if errs:
        print(f"absolute error: median {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%; "
              f"within 3%: {sum(e <= 0.03 for e in errs)}, within 10%: {sum(e <= 0.10 for e in errs)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llmq-mem", default=str(ROOT / "build" / "llmq-mem"))
    ap.add_argument("--cases", default=str(HERE / "cases.jsonl"))
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--peer", help="llm_analysis.py --json output: llm-analysis's column beside llmq-mem's")
    ap.add_argument("--check", metavar="N,MEDIAN", help="exit 1 unless at least N cases are expressible and their median "
                    "absolute error is at most MEDIAN (a fraction): the regression test's floor, e.g. 105,0.101")
    a = ap.parse_args()
    peer = json.loads(Path(a.peer).read_text())["rows"] if a.peer else {}
    rows = evaluate([json.loads(line) for line in open(a.cases) if line.strip()], a.llmq_mem, peer)
    predicted = [r for r in rows if not r["not_expressible"]]
    errors = [abs(r["error"]) for r in predicted if "inconsistent" not in r]
    inconsistent = [abs(r["error"]) for r in predicted if "inconsistent" in r]
    print_table(rows)
    print_summary("llmq-mem", errors, inconsistent, len(rows))
    if peer:
        print_summary("llm-analysis", [abs(r["peer"] / r["measured"] - 1) for r in rows if "peer" in r], [], len(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.check:
        n_min, med_max = a.check.split(",")
        if len(errors) + len(inconsistent) < int(n_min) or not errors or statistics.median(errors) > float(med_max):
            print(f"check failed: want >= {n_min} expressible with median <= {float(med_max):.3f}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
