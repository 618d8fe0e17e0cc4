#!/usr/bin/env python3
"""PEFT's method comparison (method_comparison/MetaMathQA/run.py at huggingface/peft d787f51bb, the
commit its July-2026 Llama-3.2-3B results name) replayed without a GPU: the real transformers
5.13.1 / PEFT code runs the run's training steps on meta tensors while bench/torch_replay.py
records every storage and feeds the sequence to its model of PyTorch's CUDA caching allocator.
A lab for issue 23's `peft-mc-*` cases (LoRA, DoRA, LoRA-FA, full fine-tuning) and the reference
that `llmq-mem train --framework transformers` is checked against (tests/test_mem.cpp), not a test.
Needs a venv with torch, transformers 5.13.1, accelerate and PEFT built from d787f51bb:

    pip install torch "transformers==5.13.1" "accelerate==1.12.0"
    git -C PEFT archive d787f51bb | tar -x -C peft_src && pip install --no-deps ./peft_src
    python bench/peft_mc_replay.py --method dora [--r 32] [--targets q_proj,v_proj] [--dropout 0.1] [--steps 3]
        [--no-mask] [--gc] [--vocab 8000] [--fp32] [--kv 24] [--untied] [--sgd] [--grad-accum 2] [-b 1] [-s 128]
        # lab knobs beyond the run: no padding, checkpointing, a small vocabulary, an fp32 model,
        # MHA, an untied lm_head, SGD, gradient accumulation

What runs as it ran (run.py / utils.py): Llama-3.2-3B in bf16, get_peft_model with
autocast_adapter_dtype=True (adapters in fp32), no gradient checkpointing, batch 4 right-padded
to 768 tokens (one row shorter, so an attention mask exists), labels with num_items_in_batch,
torch AdamW (lr 1e-4, weight decay 0.1; foreach, as on CUDA) or PEFT's LoRA-FA optimizer,
clip_grad_norm_ 1.0, `outputs` alive until the next step's forward returns; after the optimizer
is made, the inference-mode loss on a 4 x 768 batch with the adapters disabled (the run's wiki
loss; leaving `disable_adapter()` marks every adapter weight trainable again, LoRA-FA's frozen
lora_A included).
What is supplied, because a meta tensor has no CUDA kernel:
- scaled_dot_product_attention: the memory-efficient / flash kernels' footprint (output and an
  fp32 log-sum-exp kept with q, k, v; the mask's bf16 bias kept when a mask is given);
- torch.autocast (RoPE turns it off, and the meta device has none): a no-op;
- dropout: CUDA's fused kernel (an output and a 1-byte mask; on meta F.dropout would keep a noise
  tensor of the input's dtype);
- cuBLAS's workspace (8 MiB + 128 KiB, an L40S) at the first product.
Everything, weights included, is allocated inside the trace in the order the run creates it;
the printed peaks are what torch.cuda.max_memory_allocated / max_memory_reserved would say.
"""
import argparse
import contextlib
import sys
import types

import torch
import torch.nn.functional as F

from torch_replay import FlashSDPA, Trace, cublas_workspace_bytes, cuda_dropout, replay, workspace

# PEFT imports bitsandbytes where one is installed; 0.43 imports triton.ops, which newer triton lacks.
for name in ("triton.ops", "triton.ops.matmul_perf_model"):
    mod = types.ModuleType(name)
    mod.early_config_prune = mod.estimate_matmul_time = None
    sys.modules.setdefault(name, mod)

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils  # noqa: E402

# meta-llama/Llama-3.2-3B config.json
LLAMA32_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    bias = None
    if attn_mask is not None:  # SDPA turns a boolean mask into an additive bias of q's dtype
        bias = torch.empty(attn_mask.shape, dtype=q.dtype, device=q.device) if attn_mask.dtype == torch.bool else attn_mask
    return FlashSDPA.apply(q, k, v, bias)


def skeleton(a):
    """Llama-3.2-3B in bf16 on meta tensors, made outside the trace (the run loads it in bf16);
    --vocab replaces its vocabulary (a lab knob: where the peak moves when the logits are small)."""
    config = dict(LLAMA32_3B, vocab_size=a.vocab or LLAMA32_3B["vocab_size"], num_key_value_heads=a.kv or 8,
                  tie_word_embeddings=not a.untied)
    dtype = torch.float32 if a.fp32 else torch.bfloat16
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config, use_cache=False, dtype=dtype)).to(dtype)
    model.config._attn_implementation = "sdpa"
    return model


def build(a, model):
    """The base model's weights allocated one by one (as from_pretrained loads them), then PEFT."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = torch.empty_like(t.data)
    if a.gc:  # utils.py get_base_model with use_gc (transformers 5.13: non-reentrant checkpoints)
        model.enable_input_require_grads()
        model.gradient_checkpointing_enable()
    if a.method == "full":
        return model
    config = LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=a.dropout, target_modules=a.targets.split(","),
                        use_dora=a.method == "dora", task_type="CAUSAL_LM")
    return get_peft_model(model, config, autocast_adapter_dtype=True)


def make_optimizer(a, model):
    if a.method == "lorafa":
        from peft.optimizers import create_lorafa_optimizer
        return create_lorafa_optimizer(model, r=a.r, lora_alpha=2 * a.r, lr=1e-4, weight_decay=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    if a.sgd:
        return torch.optim.SGD(params, lr=1e-4, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)


def batch(a):
    ids = torch.zeros(a.b, a.s, dtype=torch.long, device="meta")  # meta: the values never matter
    mask = torch.ones(a.b, a.s, dtype=torch.long, device="meta")
    return ids, mask


@torch.inference_mode()
def wiki_loss(a, model):
    """run.py's calculate_mean_per_token_loss on one 4 x 768 batch: per-row cross-entropy of the logits."""
    ids, mask = batch(a)
    logits = model(input_ids=ids, attention_mask=mask).logits
    for row, target in zip(logits, ids):
        F.cross_entropy(row[:-1], target[1:], reduction="none")


def run(a, model):
    keep = workspace(cublas_workspace_bytes("L40S"))  # noqa: F841 (cuBLAS's handle keeps it)
    model = build(a, model)
    opt = make_optimizer(a, model)  # run.py makes it before the wiki loss, whose disable_adapter() context
    # re-enables requires_grad on every adapter weight when it exits (BaseTunerLayer.enable_adapters ->
    # set_adapter): LoRA-FA's frozen lora_A trains again, as far as autograd is concerned
    with contextlib.nullcontext() if a.method == "full" else model.disable_adapter():
        wiki_loss(a, model)
    model.train()
    outputs = None
    for _ in range(a.steps):
        opt.zero_grad()
        for _ in range(a.grad_accum):
            ids, mask = batch(a)
            labels = ids.clone()
            outputs = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=a.b * a.s - 1)
            outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, opt, outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="lora", choices=["lora", "dora", "lorafa", "full"])
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-s", type=int, default=768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-mask", dest="mask", action="store_false", help="a batch without padding")
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing (the run's use_gc)")
    ap.add_argument("--vocab", type=int, default=0, help="another vocabulary size (0: Llama-3.2-3B's 128256)")
    ap.add_argument("--fp32", action="store_true", help="the model in fp32 (the run: bf16)")
    ap.add_argument("--kv", type=int, default=0, help="another KV head count (0: 8; 24 is MHA)")
    ap.add_argument("--untied", action="store_true", help="lm_head apart from the embedding")
    ap.add_argument("--sgd", action="store_true", help="torch SGD instead of AdamW")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    a = ap.parse_args()
    F.scaled_dot_product_attention = sdpa
    torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
    F.dropout = cuda_dropout  # nn.Dropout (PEFT's lora_dropout) calls it
    if a.mask:  # a padded batch: transformers makes a boolean mask, and then repeats K and V for SDPA (GQA)
        masking_utils._ignore_causal_mask_sdpa = lambda *args, **kwargs: False
    else:  # every row as long as the longest: no mask, SDPA's own GQA
        masking_utils._ignore_causal_mask_sdpa = lambda *args, **kwargs: True
    model = skeleton(a)
    trace = Trace()
    with trace:
        state = run(a, model)
    del model
    del state
    alloc = replay(trace.events, 1 << 50)
    print(f"{a.method} r={a.r} targets={a.targets} dropout={a.dropout} b={a.b} s={a.s} mask={a.mask} gc={a.gc} vocab={a.vocab or 128256} fp32={a.fp32} steps={a.steps}: "
          f"{len(trace.events)} events; peak allocated {alloc.peak_allocated / 1e9:.3f} GB, "
          f"peak reserved {alloc.peak_reserved / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
