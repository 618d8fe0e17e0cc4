// `llmq-mem train --framework transformers`: a Hugging Face transformers model of the Llama family
// (LlamaDecoderLayer: Llama, Mistral, Qwen2) trained by a plain PyTorch loop on one GPU, in pure
// bf16 or fp32, fully or with PEFT's LoRA / DoRA (get_peft_model with autocast_adapter_dtype, its
// default: the adapters in fp32): what torch.cuda.max_memory_allocated() reports, tensor by tensor.
//
// What autograd keeps for the backward, per decoder layer, T = b·s tokens, e bytes per value
// (transformers 5.13.1 models/llama/modeling_llama.py and integrations/sdpa_attention.py, PEFT
// d787f51bb tuners/lora/layer.py and dora.py; bench/peft_mc_replay.py runs that code on meta
// tensors and these sums reproduce its peaks):
//   RMSNorm    x in fp32 (4·T·h) and rsqrt per token (4·T) when x needs a gradient; a trained
//              weight also keeps x·rsqrt cast back (e·T·h). Under LoRA without checkpointing layer
//              0's input (the embedding's output) needs none, so that layer keeps only what follows
//              its first adapted Linear
//   Linear     its input (e·T·in) when its weight is trained (q, k and v share one; gate and up
//              one); a frozen one nothing. PEFT's LoRA branch casts the input to its fp32 adapters,
//              one copy per adapted Linear, which lora_A keeps (4·T·in; with dropout its bool mask
//              and output instead, 5·T·in), and lora_A's output (4·T·r); on an fp32 base lora_A
//              keeps the input itself, shared as the base Linears' inputs are
//   attention  q after RoPE and SDPA's output (e·T·q each), SDPA's fp32 log-sum-exp (4·b·heads·s);
//              k and v (e·T·kv each) or, with a padding mask (--padded), k and v repeated to the
//              query heads (e·T·q each) and the mask's additive bias (e·b·s²)
//   MLP        SwiGLU's gate, up and SiLU outputs (3·e·T·F); a trained down projection its input
//   DoRA       dora_layer_bytes: each adapted Linear's base and LoRA outputs
// The head: the final norm, lm_head's input when trained, the logits (e·T·V: the output object
// keeps them until the next forward returns) and the loss's backward: transformers' loss upcasts
// the logits and log-softmax keeps its fp32 output; its backward makes that output's gradient and
// then its input's (3 x 4·T·V at once).
// Phases (the largest is the peak): the loss's backward with every layer's saved tensors (with
// --checkpointing full, gradient_checkpointing_enable's non-reentrant checkpoints: every layer's
// input); the last layer's backward (recomputed first under checkpointing: its saved tensors
// beside the checkpoints), with SwiGLU's backward gradients; the optimizer step (the gradients,
// AdamW's foreach sqrt(exp_avg_sq) copy). Gradients exist before the step only when accumulated
// across micro-batches.
#include "mem/train.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "base/error.h"

namespace llmq::mem {

namespace {

constexpr const char* kHf =
    "transformers 5.13.1 models/llama/modeling_llama.py, integrations/sdpa_attention.py, loss/loss_utils.py; PyTorch autograd saved tensors";
constexpr const char* kHfPeft = "PEFT d787f51bb tuners/lora/layer.py (Linear.forward, _cast_input_dtype), get_peft_model(autocast_adapter_dtype=True)";
constexpr const char* kDoraHf = "PEFT d787f51bb tuners/lora/dora.py DoraLinearLayer (get_lora_weight, get_weight_norm)";
constexpr const char* kHfOpt = "PyTorch torch/optim/adamw.py _multi_tensor_adamw (foreach: torch._foreach_sqrt(exp_avg_sqs) makes a copy)";

// The sizes the lines share.
struct HfSizes {
  double e = 2, T = 0, b = 0, s = 0;          // bytes per value; tokens, batch, sequence
  double h = 0, q = 0, kv = 0, F = 0, V = 0;  // widths, vocabulary
  double heads = 0, r = 0;
  double P = 0, trainable = 0;                // parameters (tied counted once); the trained ones
  double state = 0;                           // bytes per trained parameter of its weight, gradient and each moment
  bool lora = false, padded = false, ckpt = false;
};

HfSizes hf_sizes(const ModelShape& m, const TrainOptions& o) {
  HfSizes z;
  z.e = o.precision == Precision::FP32 ? 4 : 2;
  z.b = double(o.micro_batch), z.s = double(o.seq_len), z.T = z.b * z.s;
  z.h = double(m.dim), z.q = double(m.q_dim()), z.kv = double(m.kv_dim()), z.F = double(m.hidden), z.V = double(m.vocab);
  z.heads = double(m.heads), z.r = double(o.lora_rank);
  z.lora = o.lora_rank > 0, z.padded = o.padded, z.ckpt = o.checkpointing == Checkpointing::Full;
  z.P = double(m.params());
  z.trainable = z.lora ? double(m.layers) * lora_layer_params_of(m, o) : z.P;
  z.state = z.lora ? 4 : z.e;  // PEFT's adapters are fp32 whatever the base
  return z;
}

// What one RMSNorm keeps (bytes) when its input needs a gradient.
double norm_kept(const HfSizes& z) { return 4 * z.T * z.h + 4 * z.T + (z.lora ? 0 : z.e * z.T * z.h); }

// What the LoRA branches on one input keep (bytes): `adapted` Linears of input width `in` read it;
// `in_grad`: whether that input needs a gradient (without, dropout keeps no mask).
double lora_kept(const HfSizes& z, const TrainOptions& o, double adapted, double in, bool in_grad) {
  if (adapted == 0) return 0;
  const double a_out = adapted * 4 * z.T * z.r;
  if (o.lora_dropout > 0) return adapted * (in_grad ? 5 : 4) * z.T * in + a_out;  // each branch's bool mask and dropped fp32 input
  return (z.e == 4 ? 4 * z.T * in : adapted * 4 * z.T * in) + a_out;  // fp32 base: the input itself, shared
}

// DoRA with dropout on a 16-bit base keeps an fp32 copy of each adapted weight (dora_layer_bytes),
// but only where F.linear's input needs a gradient: the copies layer 0 does not keep (bytes).
double dora_copies_not_kept(const TrainOptions& o, const HfSizes& z, bool qkv_grad, bool o_grad, bool mlp_in_grad,
                            bool down_grad) {
  if (!o.dora || o.lora_dropout <= 0 || z.e == 4) return 0;
  const double h = z.h, q = z.q, kv = z.kv, F = z.F;
  double w = 0;
  if (!qkv_grad) w += lora_targets_include(o, "q") * q * h + (lora_targets_include(o, "k") + lora_targets_include(o, "v")) * kv * h;
  if (!o_grad) w += lora_targets_include(o, "o") * h * q;
  if (!mlp_in_grad) w += (lora_targets_include(o, "gate") + lora_targets_include(o, "up")) * F * h;
  if (!down_grad) w += lora_targets_include(o, "down") * h * F;
  return 4 * w;
}

// DoRA's weight norm, computed in each adapted Linear's forward (dora.py get_lora_weight,
// get_weight_norm): an fp32 identity [in, in] run through the adapters (kept by lora_A's graph),
// their product [out, in], its scaled copy and the sum with the weight (fp32 each), and on a
// 16-bit base without dropout the weight's fp32 cast: the largest over the adapted Linears
// (bytes), and whether that Linear is down (the layer's last).
struct DoraNorm {
  double bytes = 0, in = 0, out = 0;
  std::string target;
};
DoraNorm dora_norm_transient(const TrainOptions& o, const HfSizes& z) {
  DoraNorm d;
  if (!o.dora) return d;
  const double copies = 3 + (z.e == 2 && o.lora_dropout <= 0 ? 1 : 0);
  const struct {
    const char* t;
    double in, out;
  } linears[] = {{"q", z.h, z.q}, {"k", z.h, z.kv}, {"v", z.h, z.kv}, {"o", z.q, z.h}, {"gate", z.h, z.F}, {"up", z.h, z.F}, {"down", z.F, z.h}};
  for (const auto& l : linears) {
    const double b = 4 * l.in * l.in + copies * 4 * l.out * l.in;
    if (lora_targets_include(o, l.t) && b >= d.bytes) d = {b, l.in, l.out, l.t};
  }
  return d;
}

struct LayerKept {
  double bytes = 0;
  std::string formula;
};

// One decoder layer's saved tensors (bytes). `x_grad`: whether the layer's input needs a gradient
// (layer 0's does not under LoRA without checkpointing; then only what follows an adapted Linear
// keeps anything: attention from an adapted q, k or v on, the MLP from an adapted attention
// Linear or gate or up on, and every LoRA branch).
LayerKept layer_kept(const ModelShape& m, const TrainOptions& o, const HfSizes& z, bool x_grad) {
  const double e = z.e, T = z.T;
  const double n_qkv = lora_targets_include(o, "q") + lora_targets_include(o, "k") + lora_targets_include(o, "v");
  const double n_o = lora_targets_include(o, "o"), n_mlp = lora_targets_include(o, "gate") + lora_targets_include(o, "up");
  const bool attn_grad = x_grad || n_qkv > 0, mlp_in_grad = attn_grad || n_o > 0, mlp_grad = mlp_in_grad || n_mlp > 0;
  const double norms = (x_grad ? norm_kept(z) : 0) + (mlp_in_grad ? norm_kept(z) : 0);
  const double inputs = z.lora ? lora_kept(z, o, n_qkv, z.h, x_grad) + lora_kept(z, o, n_o, z.q, attn_grad) +
                                     lora_kept(z, o, n_mlp, z.h, mlp_in_grad) + lora_kept(z, o, lora_targets_include(o, "down"), z.F, mlp_grad)
                               : e * T * (2 * z.h + z.q + z.F);  // q/k/v's, o's, gate/up's and down's inputs
  const double kv = z.padded ? 2 * e * T * z.q : 2 * e * T * z.kv;
  const double lse = 4 * z.b * z.heads * (z.padded ? std::ceil(z.s / 32) * 32 : z.s);  // the padded batch runs the memory-efficient kernel
  const double attn = attn_grad ? 2 * e * T * z.q + kv + lse + (z.padded ? e * z.b * z.s * z.s : 0) : 0;
  const double mlp = mlp_grad ? 3 * e * T * z.F : 0;
  const double dora = o.dora ? dora_layer_bytes(m, o) - dora_copies_not_kept(o, z, x_grad, attn_grad, mlp_in_grad, mlp_grad) : 0;
  LayerKept k;
  k.bytes = norms + inputs + attn + mlp + dora;
  k.formula = fmt::format("norms {} + {} {} + attention {} ({}) + SwiGLU 3·e·T·F {}{}; T={} e={}", format_bytes(norms),
                          z.lora ? "LoRA branches" : "Linear inputs", format_bytes(inputs), format_bytes(attn),
                          z.padded ? "q, k and v repeated to the query heads, out, lse, mask bias" : "q, k, v, out, lse", format_bytes(mlp),
                          dora > 0 ? fmt::format(" + DoRA outputs {}", format_bytes(dora)) : "", T, e);
  return k;
}

// The loss's backward beyond the layers: the final norm, lm_head's input (trained only), the logits
// kept by the output and the three fp32 [T, V] tensors of log-softmax's backward.
double head_kept(const HfSizes& z) { return norm_kept(z) + (z.lora ? 0 : z.e * z.T * z.h) + z.e * z.T * z.V + 12 * z.T * z.V; }

// The lines every phase has: the parameters, the adapters, the optimizer's states, and gradients
// kept across micro-batches.
std::vector<MemLine> state_lines(const TrainOptions& o, const HfSizes& z) {
  std::vector<MemLine> v;
  v.push_back({z.lora ? "parameters (frozen base)" : "parameters", z.e * z.P, fmt::format("{} B x {}", z.e, num_str(z.P)), kHf, Place::Device,
               Basis::Formula});
  if (z.lora)
    v.push_back({"parameters (LoRA adapters, fp32)", 4 * z.trainable,
                 fmt::format("4 B x {}{}", num_str(z.trainable), o.dora ? " (with DoRA's magnitudes)" : ""), kHfPeft, Place::Device,
                 Basis::Formula});
  const double moments = o.optimizer == Optimizer::Adam ? 2 : 0;
  v.push_back({"optimizer states", moments * z.state * z.trainable,
               fmt::format("{} moments x {} B x {} (torch AdamW keeps them in the parameters' dtype)", moments, z.state, num_str(z.trainable)),
               kHfOpt, Place::Device, Basis::Formula});
  if (o.grad_accum > 1)
    v.push_back({"gradients (kept across micro-batches)", z.state * z.trainable, fmt::format("{} B x {}", z.state, num_str(z.trainable)),
                 kHf, Place::Device, Basis::Formula});
  return v;
}

struct HfPhase {
  std::string name;
  std::vector<MemLine> lines;
  double total() const {
    double t = 0;
    for (const auto& l : lines) t += l.bytes;
    return t;
  }
};

// What the layers keep, the same for every phase.
struct Layers {
  LayerKept inner, first;  // a layer; layer 0 (its input needs a gradient only for full fine-tuning or checkpointing)
  double L = 0;
};

MemLine checkpoints_line(const ModelShape& m, const HfSizes& z) {
  return {"activations (checkpointed layer inputs)", double(m.layers) * z.e * z.T * z.h, fmt::format("{} layers x e·T·h", m.layers), kHf,
          Place::Device, Basis::Formula};
}

MemLine layers_line(const Layers& y) {
  return {"activations (decoder layers)", (y.L - 1) * y.inner.bytes + y.first.bytes,
          fmt::format("{} layers x ({}){}", y.L, y.inner.formula,
                      y.first.bytes < y.inner.bytes ? fmt::format("; layer 0 {}: its input needs no gradient", format_bytes(y.first.bytes)) : ""),
          kHf, Place::Device, Basis::Formula};
}

// The loss's backward: every layer's saved tensors (or the checkpoints), the head's.
HfPhase loss_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y) {
  HfPhase ph{"the loss's backward", state_lines(o, z)};
  ph.lines.push_back(z.ckpt ? checkpoints_line(m, z) : layers_line(y));
  ph.lines.push_back({"activations (head: final norm, logits) + the loss's backward", head_kept(z),
                      fmt::format("final norm{} + e·T·V logits + 3 x 4·T·V (log-softmax's fp32 output and the two gradients), V = {}",
                                  z.lora ? "" : " + lm_head input", m.vocab),
                      kHf, Place::Device, Basis::Formula});
  return ph;
}

// The last layer's backward (recomputed first under checkpointing): the loss's tensors are gone,
// the output still holds the logits, and SwiGLU's backward makes the gradients of the product and
// of its two factors (3·e·T·F) beside the hidden states' (e·T·h); a trained lm_head's gradient
// (e·V·h) exists by then.
HfPhase last_layer_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y) {
  HfPhase ph{z.ckpt ? "the last layer recomputed in its backward" : "the last layer's backward", state_lines(o, z)};
  if (z.ckpt) {
    ph.lines.push_back(checkpoints_line(m, z));
    ph.lines.push_back({"activations (one layer recomputed)", y.inner.bytes, y.inner.formula, kHf, Place::Device, Basis::Formula});
  } else {
    ph.lines.push_back(layers_line(y));
  }
  ph.lines.push_back({"temporary: the layer's backward (SwiGLU's gradients, the hidden states'), logits kept by the output",
                      3 * z.e * z.T * z.F + z.e * z.T * z.h + z.e * z.T * z.V + (z.lora ? 0 : z.e * z.V * z.h),
                      fmt::format("3·e·T·F + e·T·h + e·T·V{}", z.lora ? "" : " + lm_head's gradient e·V·h"), kHf, Place::Device, Basis::Formula});
  return ph;
}

// The forward's locals while DoRA's weight norm is computed: the residual stream (the embedding's
// output and the layer's input; past attention its residual too; under checkpointing the
// checkpoint is the layer's input), the norm's output (q, k, v, gate and up read it), o's or
// down's own input, the input's fp32 cast on a 16-bit base, the base output, and the previous
// step's logits (the output object is rebound only when the forward returns).
MemLine dora_locals_line(const HfSizes& z, const DoraNorm& dn) {
  const bool mlp = dn.target == "gate" || dn.target == "up" || dn.target == "down";
  const bool own_input = dn.target == "o" || dn.target == "down";
  const double residual = (z.ckpt ? 0 : 2) + (mlp ? 1 : 0);
  const double locals = (residual + 1) * z.e * z.T * z.h + (own_input ? z.e * z.T * dn.in : 0) + (z.e == 2 ? 4 * z.T * dn.in : 0) +
                        z.e * z.T * dn.out + (z.ckpt ? 0 : z.e * z.T * z.V);
  return {"temporary: the forward's locals", locals,
          fmt::format("{}·e·T·h (residual stream, norm output){}{} + e·T·out (base output){}", residual + 1,
                      own_input ? " + e·T·in (the Linear's input)" : "", z.e == 2 ? " + 4·T·in (its fp32 cast)" : "",
                      z.ckpt ? "" : " + e·T·V (the previous logits)"),
          kHf, Place::Device, Basis::Formula};
}

// DoRA: the last layer's widest adapted Linear computing its weight norm in its forward (under
// checkpointing, in its recomputation, with the checkpoints, the logits the output keeps and the
// layer output's gradient). Down's own DoRA outputs are not kept yet then.
HfPhase dora_norm_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y, const DoraNorm& dn) {
  HfPhase ph{z.ckpt ? "DoRA's weight norm in the last layer's recomputation" : "DoRA's weight norm in the last layer's forward", state_lines(o, z)};
  const double down_out = dn.target == "down" ? z.T * z.h * (o.lora_dropout > 0 ? 8 : 2 + 4) : 0;
  if (z.ckpt) {
    ph.lines.push_back(checkpoints_line(m, z));
    ph.lines.push_back({"activations (the layer recomputed up to that Linear), logits kept by the output, the layer output's gradient",
                        y.inner.bytes - down_out + z.e * z.T * z.V + z.e * z.T * z.h, "one layer + e·T·V + e·T·h", kHf, Place::Device,
                        Basis::Formula});
  } else {
    ph.lines.push_back({"activations (decoder layers, the last one up to that Linear)", (y.L - 1) * y.inner.bytes + y.first.bytes - down_out,
                        std::string("as at the loss's backward") + (down_out > 0 ? ", less down's DoRA outputs" : ""), kHf, Place::Device,
                        Basis::Formula});
  }
  ph.lines.push_back(dora_locals_line(z, dn));
  ph.lines.push_back({"temporary: DoRA's weight norm", dn.bytes,
                      "4·in² (the fp32 identity through the adapters) + 4·out·in x (B·A, its scaled copy, the sum with W, and W's fp32 "
                      "cast on a 16-bit base without dropout)",
                      kDoraHf, Place::Device, Basis::Formula});
  return ph;
}

// The optimizer step: the gradients, AdamW's foreach sqrt(exp_avg_sq) copy, the logits the output keeps.
HfPhase step_phase(const TrainOptions& o, const HfSizes& z) {
  HfPhase ph{"the optimizer step", state_lines(o, z)};
  if (o.grad_accum == 1)
    ph.lines.push_back({"gradients", z.state * z.trainable, fmt::format("{} B x {}", z.state, num_str(z.trainable)), kHf, Place::Device,
                        Basis::Formula});
  if (o.optimizer == Optimizer::Adam)
    ph.lines.push_back({"temporary: AdamW's sqrt(exp_avg_sq)", z.state * z.trainable, fmt::format("{} B x {}", z.state, num_str(z.trainable)),
                        kHfOpt, Place::Device, Basis::Formula});
  ph.lines.push_back({"activations (logits kept by the output)", z.e * z.T * z.V, "e·T·V", kHf, Place::Device, Basis::Formula});
  return ph;
}

std::vector<HfPhase> hf_phases(const ModelShape& m, const TrainOptions& o, const HfSizes& z) {
  const Layers y{layer_kept(m, o, z, true), layer_kept(m, o, z, !z.lora || z.ckpt), double(m.layers)};  // checkpointing: enable_input_require_grads
  std::vector<HfPhase> ph = {loss_phase(m, o, z, y), last_layer_phase(m, o, z, y), step_phase(o, z)};
  if (const DoraNorm dn = dora_norm_transient(o, z); dn.bytes > 0) ph.push_back(dora_norm_phase(m, o, z, y, dn));
  return ph;
}

}  // namespace

MemReport transformers_estimate(const ModelShape& m, const TrainOptions& o) {
  if (o.dp != 1 || o.tp != 1 || o.pp != 1 || o.zero != 0 || o.offload_optimizer != Offload::None || o.offload_params != Offload::None ||
      o.qlora || o.checkpointing == Checkpointing::Selective || (o.precision != Precision::BF16 && o.precision != Precision::FP32))
    throw UsageError("--framework transformers models one GPU, pure bf16 or fp32, full fine-tuning or PEFT LoRA / DoRA, with or without "
                     "full checkpointing: no data or model parallelism, offload, QLoRA, selective checkpointing or mixed precision");
  if (m.gpt || m.mlp != Mlp::SwiGLU || m.head != Head::LM)
    throw UsageError("--framework transformers models the Llama family's decoder layer (RMSNorm, SwiGLU, rotary attention)");
  if (o.optimizer != Optimizer::Adam && o.optimizer != Optimizer::SGD)
    throw UsageError("--framework transformers models torch's AdamW and SGD");
  const HfSizes z = hf_sizes(m, o);
  const std::vector<HfPhase> phases = hf_phases(m, o, z);
  const auto peak = std::max_element(phases.begin(), phases.end(), [](const HfPhase& a, const HfPhase& b) { return a.total() < b.total(); });
  MemReport r;
  r.device = "gpu 0";
  r.lines = peak->lines;
  add_torch_cuda_lines(r, o.gpu, 2, o.cuda_context_bytes, o.cuda_context_given);
  std::string others;
  for (const auto& p : phases)
    if (&p != &*peak) others += fmt::format("; {} {}", p.name, format_bytes(p.total()));
  r.notes.push_back(fmt::format("peak phase: {} (of {} modelled{})", peak->name, phases.size(), others));
  r.notes.push_back(fmt::format("{} batch{}; the device total minus gpu-other lines is what torch.cuda.max_memory_allocated() reports",
                                z.padded ? "a padded" : "an unpadded (or packed)",
                                z.padded ? ": an attention mask, so SDPA gets a bias and K, V repeated to the query heads" : ""));
  r.extra["peak_phase"] = peak->name;
  return r;
}

}  // namespace llmq::mem
