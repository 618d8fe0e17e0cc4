#!/usr/bin/env python3
"""llm-analysis (PyPI `llm-analysis`, github.com/cli99/llm-analysis) on the cases of cases.jsonl, for a
side-by-side with `llmq-mem` in error_table.py: for every case, llm-analysis's per-GPU memory
prediction for what the case measured, or why llm-analysis cannot express the recipe.

    python3 mem/validation/llm_analysis.py [--json OUT] [--cases FILE]

The first run creates build/venv-llm-analysis (python3 -m venv) and pip-installs the pinned versions in
PINS there, then re-runs itself inside that venv; later runs reuse it. Running it directly as
`build/venv-llm-analysis/bin/python mem/validation/llm_analysis.py` works too.

How a case becomes an llm-analysis query (its Python API, llm_analysis/analysis.py, LLMAnalysis):
- ModelConfig is built from the case's dims (hidden, layers, heads, kv_heads, vocab), not by name.
  llm-analysis counts two MLP matrices (2*hidden*ffn); a gated MLP (gate/up/down) is expressed as its
  parameter equivalent ffn_embed_dim = 1.5*ffn (what llm-analysis's own Llama-2 config does with 4*hidden),
  plus mlp_gated_linear_units=True.
- Precision -> DtypeConfig bits for weights/activations/embedding (fp16/bf16-mixed and pure-bf16:
  16/16/16; int8: 8/16/16; nf4: 4/16/16; fp32 is refused by llm-analysis's own assert),
  master_weights_dtype_bytes (4 for *-mixed, 2 for pure-bf16; llm-analysis also counts the gradients at
  this size) and other_op_bytes (AdamW: two states of 4 bytes, or 2 bytes in pure-bf16, or 1 byte for
  8-bit AdamW). llm-analysis always adds a master-weight copy to the optimizer state, also in pure-bf16.
- checkpointing -> ActivationRecomputation NONE/FULL; sharding zero1/2/3, fsdp-full -> DSZeRO with
  dp_size = gpus; flash_attention -> flash_attn.
- Training: LLMAnalysis.training(); the compared number is its
  "(weight+op_state+grad+act)_memory_per_gpu". Inference: LLMAnalysis.inference() has no total, so the
  compared number is weight_memory_per_gpu + max(prefill_activation_memory_per_gpu,
  kv_cache_memory_per_gpu + decode_activation_memory_per_gpu), with the case's seq as KV-cache length
  after a 1-token prompt (the cases' prompts are a few tokens; the split is not a case field).
- GPU: the case's card from llm-analysis's gpu_configs, or one with the same memory. Capacity only
  gates llm-analysis's fit asserts; when it says the case does not fit, the estimate is taken again
  with the capacity lifted and the settings say so.
- llm-analysis has no LoRA/QLoRA, no CPU offload, no factored optimizers and no encoder-decoder
  models: those cases get a reason instead of a number.

The error is compared like error_table.py: measured_bytes() is imported from it. llm-analysis has no
CUDA context term, so nvidia-smi cases are compared with the same total.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENV = ROOT / "build" / "venv-llm-analysis"
VERSION = "0.2.2"  # latest llm-analysis on PyPI
# llm-analysis and everything it pulls in, as resolved on Python 3.11 (Debian 12).
PINS = [f"llm-analysis=={VERSION}", "fire==0.5.0", "huggingface-hub==0.14.1", "transformers==4.31.0",
        "tokenizers==0.13.3", "termcolor==3.3.0", "six==1.17.0", "numpy==2.4.6", "PyYAML==6.0.4",
        "regex==2026.11.19", "safetensors==0.8.0", "tqdm==4.70.1", "filelock==4.3.1", "fsspec==2026.9.0",
        "packaging==26.4", "typing_extensions==4.16.0", "requests==2.34.2", "certifi==2026.10.19.post1",
        "charset-normalizer==3.5.3", "idna==3.20", "urllib3==2.8.0"]

# The case's card -> llm-analysis gpu_configs name (same memory where llm-analysis lacks the card).
# v100-sxm-16gb is not used: its json says 32 GB.
GPUS = {"A100-40GB": "a100-sxm-40gb", "A100-80GB": "a100-sxm-80gb", "A10G-24GB": "a10g-pcie-24gb",
        "V100-16GB": "v100-pcie-16gb", "L40S-48GB": "a6000-48gb", "RTX4090-24GB": "a10g-pcie-24gb",
        "RTXA6000-48GB": "a6000-48gb"}
DEFAULT_GPU = "a100-sxm-80gb"  # card not stated, or "A100" without its memory
ENCODER_DECODER = {"t5", "mt5", "bart"}
ZERO = {"zero1": "STAGE_1", "zero2": "STAGE_2", "zero3": "STAGE_3", "fsdp-full": "STAGE_3"}
# optimizer -> (number of states, bytes per state or None for "the weights' dtype")
OPTIMIZERS = {"adamw": (2, None), "paged-adamw-32bit": (2, 4), "adamw-8bit": (2, 1), "paged-adamw-8bit": (2, 1)}
# precision -> (weight, activation, embedding bits)
DTYPES = {"fp16-mixed": (16, 16, 16), "bf16-mixed": (16, 16, 16), "pure-bf16": (16, 16, 16),
          "int8": (8, 16, 16), "nf4": (4, 16, 16)}
TRAIN_FIELD = "(weight+op_state+grad+act)_memory_per_gpu"
INFER_FIELD = ("weight_memory_per_gpu + max(prefill_activation_memory_per_gpu, "
               "kv_cache_memory_per_gpu + decode_activation_memory_per_gpu)")
NO_CAP_GB = 1e6
FIT_WORDS = ("max_batch_size_per_gpu", "too large")  # llm-analysis's asserts that the case fits the GPU


# ---- environment -----------------------------------------------------------------------------

def in_venv() -> bool:
    """True when this interpreter is the one of VENV."""
    return Path(sys.prefix).resolve() == VENV.resolve()


def venv_has_pins(python: Path) -> bool:
    """True when VENV's python imports the pinned llm-analysis version."""
    probe = "import importlib.metadata as m; print(m.version('llm-analysis'))"
    p = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return p.returncode == 0 and p.stdout.strip() == VERSION


def ensure_venv() -> None:
    """Create VENV with PINS when needed, then re-exec this script inside it (no return)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not venv_has_pins(python):
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS], check=True)
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


def import_llm_analysis():
    """The llm_analysis.analysis module. This file's folder is dropped from sys.path first, since this
    file is itself named llm_analysis.py and would shadow the package."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers warns that torch is absent
    import logging

    from llm_analysis import analysis
    from llm_analysis.logger import logger
    logger.setLevel(logging.ERROR)
    return analysis


def load_error_table():
    """error_table.py as a module (for measured_bytes), loaded by path."""
    spec = importlib.util.spec_from_file_location("error_table", HERE / "error_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- mapping a case ----------------------------------------------------------------------------

def why_not(case: dict) -> str | None:
    """None when llm-analysis can express the case, else the reason."""
    r, m = case["recipe"], case["model"]
    if case["kind"] == "qlora":  # (inference cases reuse the qlora field for NF4 double quantization)
        return "QLoRA (llm-analysis models full fine-tuning only)"
    if case["kind"] == "lora" or r.get("lora"):
        return "LoRA (llm-analysis models full fine-tuning only)"
    if m.get("encoder_decoder") or m["arch"] in ENCODER_DECODER:
        return f"encoder-decoder model ({m['arch']})"
    if r["offload"] != "none":
        return f"offload {r['offload']} (no CPU offload in llm-analysis)"
    if case["kind"] != "infer" and r["optimizer"] not in OPTIMIZERS:
        return f"optimizer {r['optimizer']} (only Adam-like per-parameter states)"
    if r["precision"] == "fp32":
        return "precision fp32 (llm-analysis asserts weight/activation bits of 4, 8 or 16)"
    if r["precision"] not in DTYPES:
        return f"precision {r['precision']}"
    if r["sharding"] not in ("none", *ZERO):
        return f"sharding {r['sharding']}"
    if r["micro_batch"] is None or r["seq"] is None:
        return "batch or sequence length not published"
    if r["checkpointing"] not in ("none", "full"):
        return f"checkpointing {r['checkpointing']}"
    if None in (m.get("hidden"), m.get("layers"), m.get("heads"), m.get("ffn"), m.get("vocab")):
        return "model dimensions missing"
    return None


def model_config(la, case: dict):
    """llm-analysis ModelConfig from the case's dims; a gated MLP as its parameter equivalent."""
    m = case["model"]
    ffn = m["ffn"] * 3 // 2 if m.get("gated_mlp") else m["ffn"]
    return la.ModelConfig(name=m["name"], num_layers=m["layers"], n_head=m["heads"], hidden_dim=m["hidden"],
                          vocab_size=m["vocab"], max_seq_len=case["recipe"]["seq"],
                          num_key_value_heads=m.get("kv_heads") or m["heads"], ffn_embed_dim=ffn,
                          expansion_ratio=ffn / m["hidden"], model_type=m["arch"])


def dtype_config(la, precision: str):
    """DtypeConfig (bits of weights, activations, embedding) for the recipe's precision."""
    w, a, e = DTYPES[precision]
    return la.DtypeConfig(name=f"w{w}a{a}e{e}", weight_bits=w, activation_bits=a, embedding_bits=e)


def gpu_config(la, case: dict, no_cap: bool = False):
    """The case's card from llm-analysis's gpu_configs (or a same-memory one); no_cap lifts its memory."""
    gpu = la.get_gpu_config_by_name(GPUS.get(case.get("gpu"), DEFAULT_GPU))
    return dataclasses.replace(gpu, mem_per_GPU_in_GB=NO_CAP_GB) if no_cap else gpu


def parallelism(la, case: dict):
    """ParallelismConfig (data parallel only) and the DSZeRO stage of the recipe."""
    r = case["recipe"]
    return la.ParallelismConfig(dp_size=r.get("gpus") or 1), la.DSZeRO[ZERO.get(r["sharding"], "NONE")]


def optimizer_bytes(case: dict) -> tuple[int, int]:
    """(master_weights_dtype_bytes, other_op_bytes): llm-analysis counts the master weights (and the
    gradients) at master_weights_dtype_bytes and the optimizer states at other_op_bytes."""
    r = case["recipe"]
    pure16 = r["precision"] == "pure-bf16"
    master = 2 if pure16 else 4
    states, size = OPTIMIZERS[r["optimizer"]]
    return master, states * (size or master)


def training_kwargs(la, case: dict) -> dict:
    """Arguments of LLMAnalysis.training() for a full fine-tuning case."""
    r, m = case["recipe"], case["model"]
    master, other = optimizer_bytes(case)
    return dict(batch_size_per_gpu=r["micro_batch"], gradient_accumulation_steps=r.get("grad_accum") or 1,
                seq_len=r["seq"], activation_recomputation=la.ActivationRecomputation[r["checkpointing"].upper()],
                master_weights_dtype_bytes=master, other_op_bytes=other,
                flash_attn=bool(r.get("flash_attention")), mlp_gated_linear_units=bool(m.get("gated_mlp")))


def inference_kwargs(case: dict) -> dict:
    """Arguments of LLMAnalysis.inference(): KV cache of seq tokens after a 1-token prompt."""
    r = case["recipe"]
    return dict(batch_size_per_gpu=r["micro_batch"], seq_len=1, num_tokens_to_generate=max(r["seq"] - 1, 1),
                use_kv_cache=True)


def inference_peak(summary: dict) -> float:
    """Peak bytes per GPU from an inference summary (see INFER_FIELD)."""
    return summary["weight_memory_per_gpu"] + max(
        summary["prefill_activation_memory_per_gpu"],
        summary["kv_cache_memory_per_gpu"] + summary["decode_activation_memory_per_gpu"])


def run_query(la, case: dict, no_cap: bool) -> tuple[float, dict]:
    """Run llm-analysis on one expressible case: (predicted bytes, settings as a dict)."""
    par, zero = parallelism(la, case)
    gpu = gpu_config(la, case, no_cap)
    analysis = la.LLMAnalysis(model_config(la, case), gpu, dtype_config(la, case["recipe"]["precision"]), par)
    settings = {"gpu": gpu.name, "dtype": analysis.dtype_config.name, "dp_size": par.dp_size,
                "ffn_embed_dim": analysis.model_config.ffn_embed_dim}
    if case["kind"] == "infer":
        kwargs = inference_kwargs(case)
        predicted = inference_peak(analysis.inference(ds_zero=zero, **kwargs))
    else:
        kwargs = training_kwargs(la, case)
        predicted = analysis.training(ds_zero=zero, **kwargs)[TRAIN_FIELD]
    kwargs["ds_zero"] = zero
    settings.update({k: (v.name if hasattr(v, "name") else v) for k, v in kwargs.items()})
    return float(predicted), settings


def predict(la, case: dict) -> dict:
    """The output row of one case: predicted_bytes, reason, field, settings."""
    reason = why_not(case)
    if reason:
        return {"predicted_bytes": None, "reason": f"not expressible: {reason}", "field": None, "settings": None}
    field = INFER_FIELD if case["kind"] == "infer" else TRAIN_FIELD
    note = ""
    try:
        predicted, settings = run_query(la, case, no_cap=False)
    except AssertionError as capped:
        if not any(word in str(capped) for word in FIT_WORDS):
            return {"predicted_bytes": None, "reason": f"llm-analysis refused: {capped}", "field": field,
                    "settings": None}
        note = f"; llm-analysis says it does not fit in {GPUS.get(case.get('gpu'), DEFAULT_GPU)}, estimate with capacity lifted"
        try:
            predicted, settings = run_query(la, case, no_cap=True)
        except AssertionError as e:
            return {"predicted_bytes": None, "reason": f"llm-analysis refused: {e}", "field": field, "settings": None}
    text = ", ".join(f"{k}={v}" for k, v in settings.items()) + note
    return {"predicted_bytes": predicted, "reason": None, "field": field, "settings": text}


# ---- report ------------------------------------------------------------------------------------

def errors(cases: list[dict], rows: dict, measured_bytes) -> list[tuple[float, dict]]:
    """(relative error, case) for every case with a prediction."""
    out = []
    for c in cases:
        p = rows[c["id"]]["predicted_bytes"]
        if p is not None:
            out.append((p / measured_bytes(c) - 1, c))
    return out


def print_summary(cases: list[dict], rows: dict, measured_bytes, version: str, top: int = 10) -> None:
    """Expressible count, median/max absolute error, the largest errors and the reasons."""
    errs = errors(cases, rows, measured_bytes)
    print(f"llm-analysis {version}: expressible {len(errs)} of {len(cases)} cases")
    if errs:
        abs_rel = [abs(e) for e, _ in errs]
        abs_gb = [abs(rows[c["id"]]["predicted_bytes"] - measured_bytes(c)) / 1e9 for _, c in errs]
        print(f"absolute error: median {100 * statistics.median(abs_rel):.1f}%, max {100 * max(abs_rel):.1f}% "
              f"(median {statistics.median(abs_gb):.2f} GB, max {max(abs_gb):.2f} GB); "
              f"within 10%: {sum(e <= 0.10 for e in abs_rel)}, within 25%: {sum(e <= 0.25 for e in abs_rel)}")
        print(f"largest {min(top, len(errs))}: (case, measured GB, llm-analysis GB, error)")
        for e, c in sorted(errs, key=lambda x: -abs(x[0]))[:top]:
            print(f"  {c['id']}: {measured_bytes(c) / 1e9:.2f} {rows[c['id']]['predicted_bytes'] / 1e9:.2f} {100 * e:+.1f}%")
    tiny = [c["id"] for _, c in errs if measured_bytes(c) < 1e8]
    if tiny:
        print(f"  check: measured_bytes() gives under 0.1 GB for {', '.join(tiny)} (unit_note conversion?)")
    reasons: dict[str, int] = {}
    for r in rows.values():
        if r["reason"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    for reason, n in sorted(reasons.items(), key=lambda x: -x[1]):
        print(f"  {n:3d} {reason}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=str(HERE / "cases.jsonl"))
    ap.add_argument("--json", help="write {version, rows} here")
    a = ap.parse_args()
    if not in_venv():
        ensure_venv()
    la = import_llm_analysis()
    measured_bytes = load_error_table().measured_bytes
    from importlib.metadata import version as dist_version
    version = dist_version("llm-analysis")
    cases = [json.loads(line) for line in open(a.cases) if line.strip()]
    rows = {c["id"]: predict(la, c) for c in cases}
    print_summary(cases, rows, measured_bytes, version)
    if a.json:
        Path(a.json).write_text(json.dumps({"version": version, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
