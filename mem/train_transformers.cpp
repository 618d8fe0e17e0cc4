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
  z.state = peft_fp32_adapters(o) ? 4 : z.e;  // PEFT's adapters are fp32 (in fp32 training, as everything)
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

// A decoder layer's pieces in the order its forward runs them (its backward runs them backwards).
enum Part { kNorm1, kQkv, kAttn, kO, kNorm2, kGateUp, kSwiGLU, kDown, kParts };

// The Linears, each with its piece and its widths (lora_target_dims).
struct HfLinear {
  const char* target;
  Part part;
  double in, out;
};
std::vector<HfLinear> hf_linears(const ModelShape& m) {
  std::vector<HfLinear> v;
  for (const auto& [t, p] : {std::pair{"q", kQkv}, {"k", kQkv}, {"v", kQkv}, {"o", kO}, {"gate", kGateUp}, {"up", kGateUp}, {"down", kDown}}) {
    const LoraDims d = lora_target_dims(m, t);
    v.push_back({t, p, d.in, d.out});
  }
  return v;
}

// What one decoder layer keeps, piece by piece (bytes).
struct LayerKept {
  double part[kParts] = {};
  std::string formula;
  double bytes() const {
    double b = 0;
    for (double p : part) b += p;
    return b;
  }
  double before(Part p) const {  // the pieces the forward ran before p
    double b = 0;
    for (int i = 0; i < p; ++i) b += part[i];
    return b;
  }
};

// Which of a layer's inputs need a gradient. `x_grad`: the layer's own (layer 0's does not under
// LoRA without checkpointing; then only what follows an adapted Linear keeps anything).
struct LayerGrads {
  bool x = true, attn = true, mlp_in = true, mlp = true;
};
LayerGrads layer_grads(const TrainOptions& o, bool x_grad) {
  const bool qkv = lora_targets_include(o, "q") || lora_targets_include(o, "k") || lora_targets_include(o, "v");
  LayerGrads g;
  g.x = x_grad, g.attn = x_grad || qkv, g.mlp_in = g.attn || lora_targets_include(o, "o");
  g.mlp = g.mlp_in || lora_targets_include(o, "gate") || lora_targets_include(o, "up");
  return g;
}

// SwiGLU's saved tensors, act(gate(x)) * up(x): SiLU keeps gate's output, the product keeps each
// factor for the other's gradient. When x needs no gradient (layer 0 under LoRA) only an adapted
// gate or up makes one: gate alone keeps its output and up's, up alone the SiLU output.
double swiglu_kept(const TrainOptions& o, const HfSizes& z, const LayerGrads& g) {
  const bool gate = lora_targets_include(o, "gate"), up = lora_targets_include(o, "up");
  const double n = g.mlp_in || (gate && up) ? 3 : gate ? 2 : up ? 1 : 0;
  return n * z.e * z.T * z.F;
}

// One decoder layer's saved tensors.
LayerKept layer_kept(const ModelShape& m, const TrainOptions& o, const HfSizes& z, bool x_grad) {
  const double e = z.e, T = z.T;
  const LayerGrads g = layer_grads(o, x_grad);
  const bool in_grad[kParts] = {g.x, g.x, g.attn, g.attn, g.mlp_in, g.mlp_in, g.mlp, g.mlp};
  LayerKept k;
  k.part[kNorm1] = g.x ? norm_kept(z) : 0;
  k.part[kNorm2] = g.mlp_in ? norm_kept(z) : 0;
  const double kv = z.padded ? 2 * e * T * z.q : 2 * e * T * z.kv;
  // The padded batch (and fp32) runs the memory-efficient kernel, whose log-sum-exp is padded to 32.
  const double lse = 4 * z.b * z.heads * (z.padded || e == 4 ? std::ceil(z.s / 32) * 32 : z.s);
  k.part[kAttn] = g.attn ? 2 * e * T * z.q + kv + lse + (z.padded ? e * z.b * z.s * z.s : 0) : 0;
  k.part[kSwiGLU] = swiglu_kept(o, z, g);
  if (!z.lora) {  // every Linear trained: q, k and v share their input, gate and up theirs
    k.part[kQkv] = e * T * z.h, k.part[kO] = e * T * z.q, k.part[kGateUp] = e * T * z.h, k.part[kDown] = e * T * z.F;
  } else {
    double adapted[kParts] = {}, width[kParts] = {};
    for (const HfLinear& l : hf_linears(m)) {
      if (!lora_targets_include(o, l.target)) continue;
      adapted[l.part] += 1, width[l.part] = l.in;
      if (o.dora) k.part[l.part] += dora_linear_bytes(o, l.in, l.out, T, in_grad[l.part]);
    }
    for (Part p : {kQkv, kO, kGateUp, kDown}) k.part[p] += lora_kept(z, o, adapted[p], width[p], in_grad[p]);
  }
  const double attn_in = k.part[kQkv], ffn = k.part[kGateUp] + k.part[kDown];
  k.formula = fmt::format("norms {} + {} {} + attention {} ({}) + o {} + SwiGLU {} + {} {}; T={} e={}",
                          format_bytes(k.part[kNorm1] + k.part[kNorm2]), z.lora ? (o.dora ? "q/k/v LoRA + DoRA" : "q/k/v LoRA") : "q/k/v input",
                          format_bytes(attn_in), format_bytes(k.part[kAttn]),
                          z.padded ? "q, k and v repeated to the query heads, out, lse, mask bias" : "q, k, v, out, lse",
                          format_bytes(k.part[kO]), format_bytes(k.part[kSwiGLU]), z.lora ? "MLP LoRA" : "MLP inputs", format_bytes(ffn), T, e);
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
  double all() const { return (L - 1) * inner.bytes() + first.bytes(); }
  // Under checkpointing in fp32 the recomputed layer's first norm keeps its input, which is the
  // checkpoint itself (`.to(torch.float32)` returns it): not a second copy.
  double recomputed(const HfSizes& z) const { return inner.bytes() - (z.ckpt && z.e == 4 ? 4 * z.T * z.h : 0); }
};

MemLine checkpoints_line(const ModelShape& m, const HfSizes& z) {
  return {"activations (checkpointed layer inputs)", double(m.layers) * z.e * z.T * z.h, fmt::format("{} layers x e·T·h", m.layers), kHf,
          Place::Device, Basis::Formula};
}

MemLine layers_line(const Layers& y, double minus, const char* what) {
  return {fmt::format("activations (decoder layers{})", what), y.all() - minus,
          fmt::format("{} layers x ({}){}", y.L, y.inner.formula,
                      y.first.bytes() < y.inner.bytes() ? fmt::format("; layer 0 {}: its input needs no gradient", format_bytes(y.first.bytes()))
                                                        : ""),
          kHf, Place::Device, Basis::Formula};
}

// The loss's backward: every layer's saved tensors (or the checkpoints), the head's.
HfPhase loss_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y) {
  HfPhase ph{"the loss's backward", state_lines(o, z)};
  ph.lines.push_back(z.ckpt ? checkpoints_line(m, z) : layers_line(y, 0, ""));
  ph.lines.push_back({"activations (head: final norm, logits) + the loss's backward", head_kept(z),
                      fmt::format("final norm{} + e·T·V logits + 3 x 4·T·V (log-softmax's fp32 output and the two gradients), V = {}",
                                  z.lora ? "" : " + lm_head input", m.vocab),
                      kHf, Place::Device, Basis::Formula});
  return ph;
}

// The last layer's backward at SwiGLU (recomputed first under checkpointing): the loss's tensors
// and down's saved ones are gone, the output still holds the logits, SwiGLU's backward makes the
// gradients of the product and of its two factors (3·e·T·F) beside the hidden states' (e·T·h),
// and lm_head's gradient (e·V·h) exists: as .grad, or for a tied one in autograd's buffer until the
// embedding's backward.
HfPhase last_layer_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y) {
  HfPhase ph{z.ckpt ? "the last layer recomputed in its backward" : "the last layer's backward", state_lines(o, z)};
  const double down = y.inner.part[kDown];
  if (z.ckpt) {
    ph.lines.push_back(checkpoints_line(m, z));
    ph.lines.push_back({"activations (one layer recomputed, less down's)", y.recomputed(z) - down, y.inner.formula, kHf, Place::Device,
                        Basis::Formula});
  } else {
    ph.lines.push_back(layers_line(y, down, ", the last one's down freed"));
  }
  const bool head_grad = !z.lora && (m.tied || o.grad_accum == 1);  // accumulated untied: in .grad already
  ph.lines.push_back({"temporary: the layer's backward (SwiGLU's gradients, the hidden states'), logits kept by the output",
                      3 * z.e * z.T * z.F + z.e * z.T * z.h + z.e * z.T * z.V + (head_grad ? z.e * z.V * z.h : 0),
                      fmt::format("3·e·T·F + e·T·h + e·T·V{}", head_grad ? " + lm_head's gradient e·V·h" : ""), kHf, Place::Device,
                      Basis::Formula});
  return ph;
}

// The forward's locals while DoRA's weight norm runs in Linear `l`: the residual stream (the
// embedding's output and the layer's input, past attention its residual too; in fp32 the norms
// keep these, under checkpointing the checkpoints are them), the norm's output and o's or down's
// own input (in fp32 without dropout lora_A keeps them), the input's fp32 cast when dropout's output
// is what lora_A keeps, the base output, and the previous step's logits (the output object is
// rebound only when the forward returns).
MemLine dora_locals_line(const TrainOptions& o, const HfSizes& z, const HfLinear& l) {
  const bool mlp = l.part >= kGateUp, own_input = l.part == kO || l.part == kDown, f32 = z.e == 4, drop = o.lora_dropout > 0;
  const double eth = z.e * z.T * z.h;
  const double residual = (z.ckpt ? 0 : eth) + (f32 ? 0 : (z.ckpt ? 0 : eth) + (mlp ? eth : 0));
  const double read = (f32 && !drop ? 0 : eth) + (own_input && !(f32 && !drop) ? z.e * z.T * l.in : 0);
  const double locals = residual + read + (!f32 && drop ? 4 * z.T * l.in : 0) + z.e * z.T * l.out + (z.ckpt ? 0 : z.e * z.T * z.V);
  return {"temporary: the forward's locals", locals,
          fmt::format("residual stream {} + norm output / input {} + base output e·T·out{}{}", format_bytes(residual), format_bytes(read),
                      !f32 && drop ? " + the input's fp32 cast 4·T·in" : "", z.ckpt ? "" : " + e·T·V (the previous logits)"),
          kHf, Place::Device, Basis::Formula};
}

// DoRA's weight norm in Linear `l` of the last layer (dora.py get_lora_weight, get_weight_norm):
// an fp32 identity [in, in] through the adapters (kept by lora_A's graph), their product
// [out, in], its scaled copy and the sum with the weight (fp32 each), and on a 16-bit base the
// weight's fp32 cast; beside every earlier layer (or the checkpoints, the logits and
// the layer output's gradient) and the last layer up to `l`'s own LoRA branch.
HfPhase dora_norm_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y, const HfLinear& l) {
  HfPhase ph{fmt::format("DoRA's weight norm in the last layer's {} ({})", z.ckpt ? "recomputation" : "forward", l.target), state_lines(o, z)};
  const double upto = y.inner.before(l.part) + lora_kept(z, o, 1, l.in, true);
  if (z.ckpt) {
    ph.lines.push_back(checkpoints_line(m, z));
    ph.lines.push_back({"activations (the layer recomputed up to that Linear), logits kept by the output, the layer output's gradient",
                        upto - (z.e == 4 && l.part > kNorm1 ? 4 * z.T * z.h : 0) + z.e * z.T * z.V + z.e * z.T * z.h,
                        "the layer's pieces before it + e·T·V + e·T·h", kHf, Place::Device, Basis::Formula});
  } else {
    ph.lines.push_back({"activations (every earlier layer, the last one up to that Linear)", y.all() - y.inner.bytes() + upto,
                        "the layers as at the loss's backward, the last one's pieces before it", kHf, Place::Device, Basis::Formula});
  }
  ph.lines.push_back(dora_locals_line(o, z, l));
  const double copies = 3 + (z.e == 2 ? 1 : 0);  // W's fp32 cast is made before the norm (kept with dropout, after it)
  ph.lines.push_back({"temporary: DoRA's weight norm", 4 * l.in * l.in + copies * 4 * l.out * l.in,
                      fmt::format("4·in² (the fp32 identity through the adapters) + {} x 4·out·in (B·A, its scaled copy, the sum with W{})",
                                  copies, copies > 3 ? ", W's fp32 cast" : ""),
                      kDoraHf, Place::Device, Basis::Formula});
  return ph;
}

// lm_head's backward under full fine-tuning: every layer's saved tensors and the final norm's, the
// logits and their gradient, lm_head's new weight gradient (e·V·h: the .grad, or beside the .grad
// of earlier micro-batches before it is added, or for a tied one waiting in autograd's buffer) and
// the hidden states' gradient.
HfPhase head_backward_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z, const Layers& y) {
  HfPhase ph{"lm_head's backward", state_lines(o, z)};
  ph.lines.push_back(z.ckpt ? checkpoints_line(m, z) : layers_line(y, 0, ""));
  ph.lines.push_back({"activations (final norm, lm_head input), logits and their gradient, lm_head's and the hidden states' gradients",
                      norm_kept(z) + z.e * z.T * z.h + 2 * z.e * z.T * z.V + z.e * z.V * z.h + z.e * z.T * z.h,
                      "final norm + e·T·h + 2·e·T·V + e·V·h + e·T·h", kHf, Place::Device, Basis::Formula});
  return ph;
}

// The backward's end under full fine-tuning: every gradient, and a tied lm_head's, which waits in
// autograd's buffer for the embedding's, then their sum (2·e·V·h beyond the gradients; 3 when the
// .grad of earlier micro-batches is there too).
HfPhase backward_end_phase(const ModelShape& m, const TrainOptions& o, const HfSizes& z) {
  HfPhase ph{"the backward's end", state_lines(o, z)};
  if (o.grad_accum == 1)
    ph.lines.push_back({"gradients", z.state * z.trainable, fmt::format("{} B x {}", z.state, num_str(z.trainable)), kHf, Place::Device,
                        Basis::Formula});
  const double tied = m.tied ? (o.grad_accum > 1 ? 3 : 2) * z.e * z.V * z.h : 0;
  ph.lines.push_back({"temporary: the tied embedding's gradients, logits kept by the output", tied + z.e * z.T * z.V,
                      m.tied ? fmt::format("{} x e·V·h + e·T·V", o.grad_accum > 1 ? 3 : 2) : "e·T·V", kHf, Place::Device, Basis::Formula});
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
  if (!z.lora) {
    ph.push_back(head_backward_phase(m, o, z, y));
    ph.push_back(backward_end_phase(m, o, z));
  }
  if (o.dora)
    for (const HfLinear& l : hf_linears(m))
      if (lora_targets_include(o, l.target)) ph.push_back(dora_norm_phase(m, o, z, y, l));
  return ph;
}

// UsageError for what the count does not follow.
void check_transformers_options(const ModelShape& m, const TrainOptions& o) {
  if (o.dp != 1 || o.tp != 1 || o.pp != 1 || o.zero != 0 || o.offload_optimizer != Offload::None || o.offload_params != Offload::None ||
      o.qlora || o.checkpointing == Checkpointing::Selective || (o.precision != Precision::BF16 && o.precision != Precision::FP32))
    throw UsageError("--framework transformers models one GPU, pure bf16 or fp32, full fine-tuning or PEFT LoRA / DoRA, with or without "
                     "full checkpointing: no data or model parallelism, offload, QLoRA, selective checkpointing or mixed precision");
  if (m.gpt || m.mlp != Mlp::SwiGLU || m.head != Head::LM)
    throw UsageError("--framework transformers models the Llama family's decoder layer (RMSNorm, SwiGLU, rotary attention)");
  if (o.optimizer != Optimizer::Adam && o.optimizer != Optimizer::SGD)
    throw UsageError("--framework transformers models torch's AdamW and SGD");
  if (!o.flash_attention || m.head_dim > 256 || (o.precision == Precision::FP32 && !o.padded && m.kv_heads != m.heads))
    throw UsageError("--framework transformers models SDPA's flash and memory-efficient kernels: not --no-flash, head_dim over 256, or "
                     "fp32 GQA without a mask (SDPA's math kernel, which keeps the attention probabilities)");
  if (o.lora_rank > 0)
    for (const auto& t : o.lora_targets)
      if (t != "all" && t != "q" && t != "k" && t != "v" && t != "o" && t != "gate" && t != "up" && t != "down")
        throw UsageError("--framework transformers adapts the decoder layers' Linears (q, k, v, o, gate, up, down, all), not '" + t + "'");
  if (o.lora_rank > 0 && o.lora_targets.empty()) throw UsageError("--lora-targets is empty");
}

}  // namespace

MemReport transformers_estimate(const ModelShape& m, const TrainOptions& o) {
  check_transformers_options(m, o);
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
