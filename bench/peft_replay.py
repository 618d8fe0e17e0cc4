#!/usr/bin/env python3
"""PEFT's QLoRA fine-tuning of a Llama (examples/sft/train.py as of huggingface/peft 6008f272a,
March 2024) replayed without a GPU: the real transformers / PEFT / bitsandbytes code of the time
runs one training step on meta tensors while bench/torch_replay.py records every storage and
feeds the sequence to its model of PyTorch's CUDA caching allocator. A lab for issue 23's
`peft-llama2-70b-*` cases (does llmq-mem's analytic count of the activations hold for this
recipe?), not a test. Needs a venv:

    pip install torch "transformers==4.39.3" "peft==0.10.0" "bitsandbytes==0.43.0" "accelerate==0.28.0"
    python bench/peft_replay.py [--model llama2-70b] [-b 2] [-s 2048] [--layers 80] [--no-gc] [--lora-r 8]
    python bench/peft_replay.py --model bloomz-7b1 --no-qlora -b 8 -s 64 --targets query_key_value --no-gc
        # PEFT's Dec-2022 BLOOMZ example (fp32, LoRA on query_key_value), on transformers 4.39's BLOOM

What runs as it ran: LlamaForCausalLM (transformers 4.39.3: RMSNorm in fp32, RoPE, flash-attention-2
path, SwiGLU MLP, `logits.float()` and the shifted cross-entropy), PEFT 0.10.0's LoRA on every
Linear of the blocks ("all-linear") wrapping bitsandbytes 0.43.0's Linear4bit (NF4, bf16 quant
storage, double quantization), TRL's `enable_input_require_grads`, HF's per-layer reentrant
gradient checkpointing. What is supplied, because a meta tensor has no CUDA kernel:
- flash_attn_func: bench/torch_replay.py's FlashSDPA (q, k, v, out and the fp32 log-sum-exp kept);
- dropout: CUDA's fused kernel (an output and a 1-byte mask; on meta F.dropout would keep a noise
  tensor of the input's dtype);
- torch.autocast (RoPE turns it off, and the meta device has none): a no-op. The run's own
  autocast (accelerate wraps the forward in bf16 autocast for `--bf16 True`) casts nothing here:
  every weight, the LoRA adapters included (PEFT 0.10 gives them the base weight's bf16 storage
  dtype), is bf16 already;
- bitsandbytes.functional.dequantize_4bit: a bf16 [out, in] matrix, as the CUDA kernel returns.
The weights, LoRA adapters, gradients and optimizer states are created outside the trace: the
replay counts what a step adds on top of them (activations and temporaries), and the allocator
model sees those alone. FSDP's gathered units and quantization constants are llmq-mem's lines.
"""
import argparse
import contextlib
import sys
import types

import torch
import torch.nn.functional as F

from torch_replay import MIB, FlashSDPA, Trace, cuda_dropout, replay

# bitsandbytes 0.43.0 imports triton.ops, which newer triton releases no longer have.
for name in ("triton.ops", "triton.ops.matmul_perf_model"):
    mod = types.ModuleType(name)
    mod.early_config_prune = mod.estimate_matmul_time = None
    sys.modules.setdefault(name, mod)

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbF  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

MODELS = {  # config.json of each (hidden, layers, heads, kv heads, intermediate, vocab)
    "llama2-70b": (8192, 80, 64, 8, 28672, 32000),
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000),
    "bloomz-7b1": (4096, 30, 32, 32, 16384, 250880),  # BLOOM: ALiBi, GELU MLP of 4h, fp32 run
}


def dequantize_4bit(A, quant_state=None, *args, **kwargs):
    """What bitsandbytes' CUDA dequantization returns: the [out, in] matrix in the stored dtype,
    seen transposed when the packed weight came transposed ([1, n], as Linear4bit passes it)."""
    out = torch.empty(quant_state.shape, dtype=quant_state.dtype, device=A.device)
    return out.t() if A.shape[0] == 1 else out


def flash_forward(self, q, k, v, attention_mask, query_length, dropout=0.0, softmax_scale=None):
    return FlashSDPA.apply(q, k, v)


def nf4_linear(lin: torch.nn.Linear) -> bnb.nn.Linear4bit:
    """A Linear4bit as transformers' replace_with_bnb_linear + quantization leave it: NF4 packed
    in bf16 ([out·in/4, 1]), double-quantized constants in its quant_state (module attribute)."""
    out_f, in_f = lin.out_features, lin.in_features
    q = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                          quant_storage=torch.bfloat16, device="meta")
    n = out_f * in_f
    state2 = bnbF.QuantState(absmax=torch.empty(n // 64 // 256, device="meta"), code=torch.empty(256, device="meta"),
                             blocksize=256, dtype=torch.float32)
    qs = bnbF.QuantState(absmax=torch.empty(n // 64, dtype=torch.uint8, device="meta"), shape=torch.Size([out_f, in_f]),
                         code=torch.empty(16, device="meta"), blocksize=64, quant_type="nf4", dtype=torch.bfloat16,
                         offset=torch.empty((), device="meta"), state2=state2)
    q.weight = bnb.nn.Params4bit(torch.empty(n // 4, 1, dtype=torch.bfloat16, device="meta"), requires_grad=False,
                                 quant_state=qs, quant_type="nf4", quant_storage=torch.bfloat16, module=q)
    q.weight.bnb_quantized = True
    q.quant_state = qs
    return q


def build_bloom(a):
    """BLOOM as transformers writes it (eager ALiBi attention, fp32 as PEFT's Dec-2022 example ran it)."""
    h, layers, heads, _, _, vocab = MODELS[a.model]
    cfg = BloomConfig(hidden_size=h, n_layer=a.layers or layers, n_head=heads, vocab_size=vocab, use_cache=False)
    with torch.device("meta"):
        return BloomForCausalLM(cfg)


def build_llama(a):
    """Llama in bf16, its blocks' Linears in NF4 when a.qlora (transformers' replace_with_bnb_linear)."""
    h, layers, heads, kv, ffn, vocab = MODELS[a.model]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=a.layers or layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=4096,
                      use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config._attn_implementation = "flash_attention_2"  # built eager: the check wants the flash_attn package
    for layer in model.model.layers:
        layer.self_attn.__class__ = modeling_llama.LlamaFlashAttention2
        layer.self_attn._flash_attn_uses_top_left_mask = False
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and a.qlora:
                    setattr(parent, name, nf4_linear(child))
    model.is_loaded_in_4bit = a.qlora
    return model


def build(a):
    model = build_bloom(a) if a.model.startswith("bloom") else build_llama(a)
    for p in model.parameters():
        p.requires_grad_(False)
    targets = "all-linear" if a.targets == "all-linear" else a.targets.split(",")
    model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=a.dropout,
                                             target_modules=targets, task_type="CAUSAL_LM"))
    if a.gc:
        model.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False})
        model.base_model.model.enable_input_require_grads()
    model.train()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-70b", choices=sorted(MODELS))
    ap.add_argument("-b", type=int, default=2, help="per_device_train_batch_size")
    ap.add_argument("-s", type=int, default=2048, help="packed sequence length")
    ap.add_argument("--layers", type=int, default=0, help="blocks to build (0: the model's)")
    ap.add_argument("--no-gc", dest="gc", action="store_false", help="no gradient checkpointing")
    ap.add_argument("--no-qlora", dest="qlora", action="store_false", help="a bf16 base instead of NF4")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--targets", default="all-linear")
    ap.add_argument("--forward-only", action="store_true", help="stop after the forward: what it keeps")
    a = ap.parse_args()
    bnbF.dequantize_4bit = dequantize_4bit
    F.dropout = cuda_dropout
    torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()  # RoPE's autocast(enabled=False) knows no meta device
    modeling_llama.LlamaFlashAttention2._flash_attention_forward = flash_forward
    model = build(a)
    trace = Trace()
    trace.existing([*model.parameters(), *model.buffers()])
    with trace:
        ids = torch.randint(0, MODELS[a.model][5], (a.b, a.s), device="meta")
        loss = model(input_ids=ids, labels=ids).loss
        if not a.forward_only:
            loss.backward()
            del loss
    alloc = replay(trace.events, 1 << 50)
    kept = alloc.allocated if a.forward_only else 0
    print(f"{a.model} b={a.b} s={a.s} layers={a.layers or MODELS[a.model][1]} qlora={a.qlora} gc={a.gc} r={a.lora_r} "
          f"targets={a.targets}: {len(trace.events)} events; peak allocated {alloc.peak_allocated / MIB:.1f} MiB, "
          f"peak reserved {alloc.peak_reserved / MIB:.1f} MiB" + (f", kept after the forward {kept / MIB:.1f} MiB" if a.forward_only else ""))


if __name__ == "__main__":
    main()
