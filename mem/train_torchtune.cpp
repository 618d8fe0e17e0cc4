// `llmq-mem train --framework torchtune`: torchtune's single-device recipes
// (full_finetune_single_device.py, lora_finetune_single_device.py, torchtune 0.4.0, Nov 2024),
// what torch.cuda.memory_stats() reports as the active / allocated peak, by phase of one step;
// and the distributed ones (--dp N --fsdp full: FSDP2 per layer, then the root), whose model
// states and gradients are sharded / N beside FSDP's unsharded units (fsdp_unsharded_bytes).
//
// Per transformer layer and token (e bytes per activation, 2 for bf16; h, q, kv, f the model,
// query, key/value and MLP widths; a heads), what autograd keeps in the eager model
// (torchtune/modules: RMSNorm upcasts its input to fp32, RotaryPositionalEmbeddings rotates an
// fp32 copy, SDPA keeps q, k, v, its output and a logsumexp, o_proj reads a contiguous copy):
//   2 norms    2 x (4h fp32 input + e·h normed + 4 rsqrt)
//   RoPE       4q + 4kv (fp32 q and k)
//   attention  SDPA q, k, v, out e(2q + 2kv) + logsumexp 4a; o_proj input e·q
//   MLP        gate and up outputs, silu(gate), their product: 4·e·f
// bench/torchtune_mem.py counts this on the CPU within 0.4% (22h + 8kv + 8f + 4a + 8 bytes for
// Llama shapes). torch.compile (per layer) recomputes the fp32 upcasts of RMSNorm and RoPE in the
// backward instead of keeping them: 8h + 4q + 4kv fewer bytes (the lab: 1.3% from its count).
// The head: the standard loss (torch CrossEntropyLoss on the fp32 logits the model returns)
// peaks at 12·T·V bytes in its backward (log-softmax output, its gradient and the logits'
// gradient, fp32; the lab measures 12.0 per token and vocabulary entry); CEWithChunkedOutputLoss
// keeps every chunk's bf16 logits (2·T·V) and upcasts one chunk of n at a time (4·T·V/n), and a
// trained output matrix accumulates its gradient over the chunks (two V·h copies at once).
#include "mem/train.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/error.h"

namespace llmq::mem {

namespace {

constexpr const char* kTune = "torchtune 0.4.0 recipes (full_finetune_single_device.py, lora_finetune_single_device.py) and torchtune/modules; "
                              "bench/torchtune_mem.py";
constexpr const char* kTuneOffload = "torchtune training/_activation_offloading.py (OffloadActivations: saved tensors >= 1 KiB to the CPU, "
                                     "not the output projection's)";
constexpr const char* kTuneFsdp = "torchtune lora_finetune_distributed.py / full_finetune_distributed.py (training.shard_model: FSDP2 "
                                  "fully_shard per layer, then the root) and PyTorch FSDP2 (the root is not resharded after forward)";
constexpr const char* kTorchao = "torchao NF4Tensor (4 bits, int8 scalers per 64, fp32 factor per 256 scalers); bitsandbytes paged optimizers "
                                 "(cudaMallocManaged: outside torch's counters)";

// Bytes one transformer layer keeps per token (see the header comment).
double layer_saved_per_token(const ModelShape& m, const TrainOptions& o) {
  const double e = 2, h = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_dim()), f = double(m.hidden), a = double(m.heads);
  double b = 2 * (4 * h + e * h + 4) + (4 * q + 4 * kv) + e * (2 * q + 2 * kv) + 4 * a + e * q + 4 * e * f;
  if (o.compile) b -= 8 * h + 4 * q + 4 * kv;
  if (o.lora_rank > 0 && !lora_targets_include(o, "o")) b -= e * q;  // a frozen o_proj keeps no input
  if (o.lora_rank > 0 && !lora_targets_include(o, "down")) b -= e * f;  // nor a frozen down projection
  return b;
}

// NF4 bytes per parameter as torchao stores them (double-quantized scalers).
constexpr double kNf4 = 0.5 + 1.0 / 64 + 4.0 / (64 * 256);

// The sizes torchtune_estimate's lines share.
struct TuneSizes {
  double e = 2, T = 0, h = 0, V = 0, P = 0, L = 0;  // bytes per activation, tokens, width, vocabulary, parameters, layers
  double head_lora = 0, trainable = 0;              // params: a LoRA adapter on the output; every trained one
  double dp = 1;                                    // FSDP ranks the model states are sharded over
  bool lora = false, ckpt = false, offload = false;  // offload: fsdp_cpu_offload (parameters, gradients, optimizer on the CPU)
};

// TuneSizes for m and o (the trainable count throws UsageError for an unknown LoRA target).
TuneSizes tune_sizes(const ModelShape& m, const TrainOptions& o) {
  TuneSizes z;
  const double e = 2, T = double(o.micro_batch) * double(o.seq_len), h = double(m.dim), V = double(m.vocab);
  const double P = double(m.params()), L = double(m.layers);
  const bool lora = o.lora_rank > 0, ckpt = o.checkpointing == Checkpointing::Full;
  z.e = e, z.T = T, z.h = h, z.V = V, z.P = P, z.L = L, z.lora = lora, z.ckpt = ckpt;
  z.head_lora = lora && lora_targets_include(o, "head") ? double(o.lora_rank) * (h + V) : 0;
  z.trainable = lora ? L * lora_layer_params_of(m, o) + z.head_lora : P;
  z.dp = o.dp, z.offload = o.offload_params == Offload::Cpu;
  return z;
}

// One line of the recipes' device memory (bytes), from a formula.
void add_tune(MemReport& r, std::string label, double bytes, std::string formula, const char* src = kTune, Place place = Place::Device) {
  r.lines.push_back({std::move(label), bytes, std::move(formula), src, place, Basis::Formula});
}

// The model states (bytes): the frozen base (NF4 block matrices under QLoRA) and the adapters,
// or every parameter, and the optimizer's states (paged ones outside torch's count).
void add_tune_model_states(MemReport& r, const ModelShape& m, const TrainOptions& o, const TuneSizes& z) {
  const double e = z.e, P = z.P, L = z.L, trainable = z.trainable, N = z.dp;
  const bool lora = z.lora;
  const Place place = z.offload ? Place::Cpu : Place::Device;
  const std::string per = N > 1 ? fmt::format(" / {} FSDP ranks", N) : "";
  if (lora) {
    const double linear = L * double(m.layer_linear_params());
    add_tune(r, o.qlora ? "parameters (frozen base, NF4 block matrices)" : "parameters (frozen base)",
             (o.qlora ? kNf4 * linear + e * (P - linear) : e * P) / N,
             (o.qlora ? fmt::format("{:.4f} B x {} block-matrix params + {} B x {} others (embedding, output, norms in bf16)", kNf4,
                                    num_str(linear), e, num_str(P - linear))
                      : fmt::format("{} B x {}", e, num_str(P))) + per,
             o.qlora ? kTorchao : kTune, place);
  }
  add_tune(r, lora ? "parameters (LoRA adapters)" : "parameters", e * trainable / N, fmt::format("{} B x {}", e, num_str(trainable)) + per,
           kTune, place);
  const bool paged = o.paged_optimizer;
  const double moment = o.optimizer == Optimizer::Adam8bit ? 2 + 8.0 / 2048 : 2 * e;
  add_tune(r, paged ? "optimizer states (paged: CUDA managed memory, outside torch's count)" : "optimizer states",
           paged ? 0 : moment * trainable / N,
           paged ? "bitsandbytes PagedAdamW8bit allocates its states with cudaMallocManaged"
                 : fmt::format("exp_avg + exp_avg_sq: {} B x trainable", moment) + per,
           paged ? kTorchao : kTune, place);
  if (z.offload)
    add_tune(r, "gradients (offloaded)", e * trainable / N, fmt::format("{} B x trainable{}: reduce-scattered, then moved to the CPU", e, per),
             kTuneFsdp, Place::Cpu);
  if (N > 1) {
    const double matrix = o.qlora ? kNf4 : e;
    add_tune(r, "gathered parameters (FSDP units)", fsdp_unsharded_bytes(m, o, e, matrix),
             fmt::format("{}, block matrices {:.4g} B per parameter", o.fsdp_embedding_units ? "max(head unit, block) + block" : "root unit + 2 blocks",
                         matrix),
             kTuneFsdp);
  }
}

// The layers' saved activations (bytes, per_token bytes per layer and token), or under
// checkpointing their kept inputs (none on the GPU when offloaded).
MemLine tune_activations_line(const ModelShape& m, const TrainOptions& o, const TuneSizes& z, double per_token) {
  const double e = z.e, T = z.T, h = z.h, L = z.L, per_layer = per_token * T;
  MemLine acts_line{"activations (layers)", L * per_layer,
                    fmt::format("{} layers x {} B per token{} x T = {}", m.layers, per_token, o.compile ? " (compiled: no fp32 copies)" : "",
                                num_str(T)),
                    kTune, Place::Device, Basis::Formula};
  if (z.ckpt)
    acts_line = {o.offload_activations ? "activations (checkpointed layer inputs: offloaded to the CPU)" : "activations (checkpointed layer inputs)",
                 o.offload_activations ? 0 : L * e * T * h,
                 fmt::format("{} layers x e·T·h{}", m.layers, o.offload_activations ? ", moved to pinned CPU memory in the forward" : ""),
                 o.offload_activations ? kTuneOffload : kTune, Place::Device, Basis::Formula};
  return acts_line;
}

// The loss's bytes at its backward, and their formula.
struct TuneHead {
  double bytes = 0;
  std::string formula;
};

TuneHead tune_head(const TrainOptions& o, const TuneSizes& z, bool out_trained) {
  const double e = z.e, T = z.T, h = z.h, V = z.V;
  double head = 0;
  std::string head_formula;
  if (o.ce_chunks <= 0) {
    head = 12 * T * V;
    head_formula = "12·T·V: fp32 log-softmax, its gradient and the logits' gradient (torch CrossEntropyLoss)";
  } else {
    const double n = double(o.ce_chunks);
    head = 2 * T * V + (out_trained ? 4 * T * V / n + 2 * e * V * h : 0);
    head_formula = out_trained ? fmt::format("2·T·V bf16 logits + 4·T·V/{} one chunk in fp32 + 2 x e·V·h the output gradient accumulating over the chunks", o.ce_chunks)
                               : "2·T·V: every chunk's bf16 logits (the output matrix is frozen)";
  }
  return {head, head_formula};
}

// The lines of the step's peak (bytes): the loss's backward (activations, the loss, accumulated
// gradients) or the backward's end (gradients, a recomputed layer or the embedding's gradient).
void add_tune_peak(MemReport& r, const TrainOptions& o, const TuneSizes& z, const MemLine& acts_line, const TuneHead& head, double per_layer,
                   bool out_trained) {
  const double e = z.e, h = z.h, V = z.V;
  const double grads = z.offload ? 0 : e * z.trainable / z.dp;  // FSDP: reduce-scattered shards (on the CPU when offloaded)
  const double accum_grads = o.grad_accum > 1 ? grads : 0;  // kept between micro-batches
  const double loss_phase = acts_line.bytes + head.bytes + accum_grads;

  // The end of the backward: every gradient (unless each is stepped and freed as it is made), the
  // embedding's dense gradient before it is added, a recomputed layer under checkpointing.
  const double embed_grad = out_trained && !z.lora ? e * V * h : 0;
  const double recompute = z.ckpt ? per_layer : 0;
  const double end_phase = o.optimizer_in_backward ? recompute : grads + std::max(embed_grad, recompute);
  if (loss_phase >= end_phase) {
    r.lines.push_back(acts_line);
    add_tune(r, "loss (at its backward)", head.bytes, head.formula);
    if (accum_grads > 0)
      add_tune(r, "gradients (accumulated)", accum_grads, fmt::format("e x trainable, kept across {} micro-batches", o.grad_accum));
  } else {
    if (grads > 0) add_tune(r, "gradients", grads, z.dp > 1 ? "e x trainable / N, all present when the backward ends"
                                                           : "e x trainable, all present when the backward ends");
    if (recompute > 0) add_tune(r, "activations (one layer recomputed)", recompute, "the layer's saved tensors during its backward");
    else if (embed_grad > 0)
      add_tune(r, "temporary: the embedding's dense gradient", embed_grad, "e·V·h before it is added to the weight's gradient");
  }
}

}  // namespace

MemReport torchtune_estimate(const ModelShape& m, const TrainOptions& o) {
  const bool sharded = o.fsdp && o.zero == 3, offload = o.offload_params != Offload::None || o.offload_optimizer != Offload::None;
  if (o.tp != 1 || o.pp != 1 || (o.dp != 1 && !sharded) || (o.zero != 0 && !sharded))
    throw UsageError("--framework torchtune models the single-device recipes and the distributed ones with --fsdp full: no --zero/--tp/--pp");
  if (offload && !(sharded && o.offload_params == Offload::Cpu && o.offload_optimizer == Offload::Cpu))
    throw UsageError("--framework torchtune offloads as fsdp_cpu_offload does: --fsdp full with --offload-params cpu --offload-optimizer cpu");
  if (o.precision != Precision::BF16 || o.checkpointing == Checkpointing::Selective)
    throw UsageError("--framework torchtune models dtype bf16 (--precision pure-bf16) with --checkpointing none or full");
  if (o.optimizer != Optimizer::Adam && o.optimizer != Optimizer::Adam8bit)
    throw UsageError("--framework torchtune models AdamW and 8-bit AdamW");
  if (o.optimizer_in_backward && o.grad_accum > 1) throw UsageError("--optimizer-in-backward needs --grad-accum 1 (as the recipe)");
  const TuneSizes z = tune_sizes(m, o);
  MemReport r;
  r.device = "gpu 0";

  // Model states. torchtune trains in bf16 throughout: weights, gradients and AdamW's moments.
  add_tune_model_states(r, m, o, z);

  // Activations at the start of the backward (added below if that is the peak).
  const double per_token = layer_saved_per_token(m, o), per_layer = per_token * z.T;
  const MemLine acts_line = tune_activations_line(m, o, z, per_token);

  // The head at the loss's backward.
  const bool out_trained = !z.lora || z.head_lora > 0;
  const TuneHead head = tune_head(o, z, out_trained);

  // The peak: the loss's backward or the backward's end, whichever holds more.
  add_tune_peak(r, o, z, acts_line, head, per_layer, out_trained);
  if (o.optimizer_in_backward) r.notes.push_back("optimizer step fused into the backward: each gradient is freed once its parameter is stepped");
  r.notes.push_back("AdamW steps without parameter-sized temporaries (the recipes' fused / per-parameter steps)");
  add_torch_cuda_lines(r, o.gpu, 2, o.cuda_context_bytes, o.cuda_context_given);
  if (o.dp > 1) add_nccl_line(r, o.nccl_bytes);
  r.notes.push_back("the device total minus gpu-other lines is torchtune's 'peak memory active/alloc'");
  return r;
}

}  // namespace llmq::mem
