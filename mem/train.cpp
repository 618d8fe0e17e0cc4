#include "mem/train.h"

#include "formats/quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "base/error.h"

namespace llmq::mem {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr const char* kZero = "ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054, §3 and Fig. 1)";
constexpr const char* kKorth = "Korthikanti et al. 2022, arXiv 2205.05198, §4 and Table 2";
constexpr const char* kDs = "DeepSpeed estimate_zero2/zero3_model_states_mem_needs (stage_1_and_2.py, stage3.py)";
constexpr const char* kDsGather = "DeepSpeed runtime/zero/partition_parameters.py all_gather_coalesced (a whole buffer per fetched "
                                  "parameter; an offloaded partition copied to the GPU first), stage3_prefetch_bucket_size 5e7";
constexpr const char* kDsIpg = "DeepSpeed runtime/zero/stage3.py (__ipg_bucket_flat_buffer) and stage_1_and_2.py backward (ipg_buffer): "
                               "reduce_bucket_size elements, 5e8 by default (v0.7-v0.14)";
constexpr const char* kFsdp = "PyTorch FSDP1 (fsdp/_runtime_utils.py: the root handle is not resharded after forward) and FSDP2 "
                              "(fully_shard, FSDPState._lazy_init: the root's post_forward_mesh_info = None); one unit prefetched in the "
                              "backward; each unit's unsharded gradient reduce-scattered after its backward";
constexpr const char* kTuneCe = "torchtune modules/loss CEWithChunkedOutputLoss (the output projection in chunks, each upcast to fp32 "
                                "inside the loss)";
constexpr const char* k8bit = "Dettmers et al. 2021, arXiv 2110.02861 (block-wise 8-bit states, blocks of 2048)";
constexpr const char* kQlora = "Dettmers et al. 2023, arXiv 2305.14314 (NF4, blocks of 64, double quantization)";
constexpr const char* kBnbState = "bitsandbytes 0.43 nn/modules.py (Linear4bit.quant_state, Params4bit.quant_state: absmax, "
                                  "nested absmax and code beside the packed data) and functional.py quantize_4bit";
constexpr const char* kLora = "Hu et al. 2021, arXiv 2106.09685 (B [out, r] · A [r, in])";
constexpr const char* kDora = "Liu et al. 2024, DoRA, arXiv 2402.09353 §4.3; PEFT d787f51bb src/peft/tuners/lora/dora.py DoraLinearLayer.forward";
constexpr const char* kPeft = "PEFT, src/peft/tuners/lora/layer.py Linear.forward (_cast_input_dtype) and get_peft_model(autocast_adapter_dtype=True)";
constexpr const char* kTorch = "PyTorch: torch.optim.AdamW foreach, torch.amp autocast cache, CUDACachingAllocator";
constexpr const char* kKo2 = "okoge-kaz memory-estimator notes (CUDA context ~300-500 MB, NCCL ~0.5 GB per communicator)";
constexpr const char* kAdafactor = "Shazeer & Stern 2018, arXiv 1804.04235 (factored second moments); torch.optim.Adafactor";
constexpr const char* kTorchSoftmax = "PyTorch <= 1.10 tools/autograd/derivatives.yaml: _softmax's backward "
                                      "_softmax_backward_data(grad, result, dim, self) (1.11: self.scalar_type(); pytorch#65242)";
constexpr const char* kTorchBlas = "PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp (parseChosenWorkspaceSize: :4096:8 on sm_90)";

std::string num(double x) { return fmt::format("{:.6g}", x); }

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

const char* precision_label(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::Mixed: return "mixed 16-bit + fp32 master";
    case Precision::Amp: return "torch.amp (fp32 parameters, 16-bit autocast)";
    default: return "pure bf16";
  }
}

// Whether the Linear layers run under torch.autocast over fp32 parameters (Precision::Amp, and
// Mixed in --framework pytorch, which models bench/train_mem.py's autocast run).
bool autocast(Precision p, Framework f) { return p == Precision::Amp || (f == Framework::PyTorch && p == Precision::Mixed); }

// Bytes of a parameter in the dtype the framework keeps it in: fp32 training and torch.amp keep
// fp32 parameters, the 16-bit recipes 2 bytes.
double param_dtype_bytes(Precision p) { return p == Precision::FP32 || p == Precision::Amp ? 4 : 2; }

const char* optimizer_label(Optimizer o) {
  switch (o) {
    case Optimizer::Adam: return "Adam/AdamW";
    case Optimizer::Adam8bit: return "8-bit Adam";
    case Optimizer::SGD: return "SGD";
    case Optimizer::Adafactor: return "Adafactor";
    default: return "SGD with momentum";
  }
}

Place offload_place(Offload o) { return o == Offload::Cpu ? Place::Cpu : o == Offload::Nvme ? Place::Nvme : Place::Device; }

// Parameters held by one GPU: the largest pipeline stage (first: embedding, last: head), / tp.
struct GpuParams {
  double all = 0;          // every parameter of the stage, / tp
  double block_linear = 0; // the blocks' matrices (LoRA/QLoRA targets)
  int64_t layers = 0;      // blocks on this stage
};

GpuParams gpu_params(const ModelShape& m, const TrainOptions& o) {
  GpuParams g;
  g.layers = (m.layers + o.pp - 1) / o.pp;
  const double blocks = double(g.layers) * double(m.layer_params());
  double stage = o.pp == 1 ? double(m.params())
                           : std::max(double(m.embed_params()) + blocks, blocks + double(m.head_params()));
  g.all = stage / o.tp;
  g.block_linear = double(g.layers) * double(m.layer_linear_params()) / o.tp;
  return g;
}

}  // namespace

std::string num_str(double x) { return num(x); }

void add_nccl_line(MemReport& r, double bytes) {
  r.lines.push_back({"NCCL buffers", bytes, "assumed constant per process group (not measured here)", kKo2, Place::GpuOther, Basis::Assumed});
}

double fsdp_unsharded_bytes(const ModelShape& m, const TrainOptions& o, double w, double matrix_bytes) {
  const double layer = double(m.layer_params()) / o.tp, head = double(m.vocab) * double(m.dim) / o.tp;
  const double linear = double(m.layer_linear_params()) / o.tp, block_bytes = matrix_bytes * linear + w * (layer - linear);
  if (o.fsdp_embedding_units) return std::max(w * head, block_bytes) + block_bytes;
  const double root = gpu_params(m, o).all - double((m.layers + o.pp - 1) / o.pp) * layer;
  return w * root + 2 * block_bytes;
}

bool lora_targets_include(const TrainOptions& o, const char* t) {
  return std::any_of(o.lora_targets.begin(), o.lora_targets.end(), [&](const std::string& x) { return x == t || x == "all"; });
}

LoraDims lora_target_dims(const ModelShape& m, const std::string& name) {
  const double h = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_dim()), H = double(m.hidden);
  if (name == "q") return {h, q};
  if (name == "k" || name == "v") return {h, kv};
  if (name == "o") return {q, h};
  if (name == "qkv") return {h, q + 2 * kv};  // one adapter on a fused projection (BLOOM's query_key_value)
  if (name == "gate" || name == "up") return {h, H};
  if (name == "down") return {H, h};
  if (name == "head") return {};
  throw UsageError("unknown LoRA target '" + name + "' (q, k, v, qkv, o, gate, up, down, head, all)");
}

bool peft_fp32_adapters(const TrainOptions& o) {
  return o.lora_rank > 0 && (o.lora_fp32_inputs || (o.framework == Framework::Transformers && o.precision != Precision::FP32));
}

namespace {

// The targets of o with "all" expanded.
std::vector<std::string> lora_layer_targets(const TrainOptions& o) {
  const auto& t = o.lora_targets;
  if (std::find(t.begin(), t.end(), "all") != t.end()) return {"q", "k", "v", "o", "gate", "up", "down"};
  return t;
}

}  // namespace

double lora_layer_params_of(const ModelShape& m, const TrainOptions& o) {
  double n = 0;
  for (const auto& name : lora_layer_targets(o)) {
    const LoraDims d = lora_target_dims(m, name);
    n += double(o.lora_rank) * (d.in + d.out) + (o.dora ? d.out : 0);
  }
  return n;
}

namespace {

// ------------------------------------------------------------------ analytic / DeepSpeed

// DeepSpeed's estimate_zero2/zero3_model_states_mem_needs for this GPU's Ψ: bytes on the GPU and on the CPU.
void add_ds_model_states(MemReport& r, const ModelShape& m, const TrainOptions& o, const GpuParams& gp) {
  const bool off = o.offload_optimizer != Offload::None;
  const CpuGpu ds = o.zero == 2 ? ds_zero2_model_states(gp.all, o.dp, 1, off)
                                : ds_zero3_model_states(gp.all, double(m.largest_layer_params()) / o.tp, o.dp, 1, off,
                                                        o.offload_params != Offload::None);
  r.lines.push_back({"model states (DeepSpeed estimator)", ds.gpu,
                     o.zero == 2 ? (off ? "2P" : "4P + 16P/N") : (off ? (o.offload_params != Offload::None ? "4·largest_layer" : "4·largest_layer + 2P/N") : "4·largest_layer + 18P/N"),
                     kDs, Place::Device, Basis::Formula});
  r.lines.push_back({"model states on CPU (DeepSpeed estimator, buffer factor 1.5)", ds.cpu, "see DeepSpeed estimator", kDs, Place::Cpu,
                     Basis::Formula});
}

// Bytes per parameter of the weights as stored, and as ZeRO-3 or FSDP gathers them: the working
// copy (the frozen base's fp32 or 16-bit dtype under LoRA; bf16 beside QLoRA's NF4 matrices), the
// blocks' matrices (QLoRA: the packed 4-bit data the Params4bit holds) and, under QLoRA, their
// quantization constants (absmax per block of 64, double-quantized or not), which bitsandbytes
// keeps in a QuantState beside the parameter: neither FSDP nor ZeRO-3 shards, gathers or offloads
// them (bitsandbytes 0.43 nn/modules.py: Linear4bit keeps `module.quant_state` because "the quant
// state got lost when the parameter got converted. This happens for example for fsdp").
struct WeightBytes {
  double w = 2;          // embeddings, head, norms, and every matrix without QLoRA
  double block = 2;      // the blocks' matrices as their parameters hold them
  double constants = 0;  // QLoRA: NF4 constants per block-matrix parameter, whole on every GPU
};
WeightBytes weight_bytes(const TrainOptions& o, const StateBytes& sb) {
  WeightBytes g;
  g.w = o.qlora ? 2 : o.lora_rank > 0 ? param_dtype_bytes(o.precision) : sb.weights;
  constexpr double kNf4Data = 0.5;  // 4 bits per weight, packed into the Params4bit's storage
  g.block = o.qlora ? kNf4Data : g.w;
  g.constants = o.qlora ? inference_bytes_per_param(o.double_quant ? "nf4-dq" : "nf4") - kNf4Data : 0;
  return g;
}

// The parameter lines (bytes per GPU, / p_div under ZeRO-3): the frozen base and the LoRA
// adapters, or every parameter.
void add_parameter_lines(MemReport& r, const TrainOptions& o, const GpuParams& gp, const StateBytes& sb,
                         double trainable, Place par_place, double p_div) {
  const std::string psi = fmt::format("Ψ = {} params on this GPU (stage of {} layers / tp {})", num(gp.all), gp.layers, o.tp);
  if (o.lora_rank > 0) {
    const WeightBytes gb = weight_bytes(o, sb);
    double frozen_bytes = gb.w * gp.all;
    std::string f = fmt::format("{} B x Ψ", gb.w);
    if (o.qlora) {
      frozen_bytes = gb.block * gp.block_linear + gb.w * (gp.all - gp.block_linear);
      f = fmt::format("NF4 data 0.5 B x {} block-matrix params + bf16 2 B x {} others", num(gp.block_linear), num(gp.all - gp.block_linear));
    }
    r.lines.push_back({"parameters (frozen base)", frozen_bytes / p_div, f + (p_div > 1 ? " / N_d" : "") + "; " + psi,
                       o.qlora ? kQlora : kLora, par_place, Basis::Formula});
    if (o.qlora)
      r.lines.push_back({"parameters (NF4 quantization constants)", gb.constants * gp.block_linear,
                         fmt::format("{:.4g} B x {} block-matrix params ({}){}", gb.constants, num(gp.block_linear),
                                     o.double_quant ? "8-bit absmax per 64 + fp32 per 256 of them" : "fp32 absmax per 64",
                                     p_div > 1 || par_place != Place::Device ? ", whole on every GPU: a QuantState beside the parameter, "
                                                                               "not sharded, gathered or offloaded"
                                                                             : ""),
                         kBnbState, Place::Device, Basis::Formula});
    r.lines.push_back({"parameters (LoRA adapters)", sb.weights * trainable / p_div,
                       fmt::format("{} B x Ψ_lora, Ψ_lora = layers x Σ_targets {} = {}", sb.weights,
                                   o.dora ? "(r·(in + out) + out: DoRA's magnitude)" : "r·(in + out)", num(trainable)),
                       o.dora ? kDora : kLora,
                       par_place, Basis::Formula});
  } else {
    r.lines.push_back({"parameters", sb.weights * trainable / p_div,
                       fmt::format("{} B x Ψ{}; {}", sb.weights, p_div > 1 ? " / N_d" : "", psi), kZero, par_place, Basis::Formula});
  }
}

// DeepSpeed ZeRO-3's gathered working set: the largest parameter fetched whole (with parameter
// offload its partition is first copied to the GPU: + 1/N_d), its full gradient before the
// reduce when it trains, and the prefetched next parameters (stage3_prefetch_bucket_size).
void add_ds_gathered(MemReport& r, const ModelShape& m, const TrainOptions& o, const GpuParams& gp, const StateBytes& sb) {
  const WeightBytes gb = weight_bytes(o, sb);
  const double L = double(m.largest_layer_params()) / o.tp;
  const bool embed_largest = m.vocab * m.dim >= std::max(m.dim * m.hidden, m.dim * m.q_dim());
  const double wl = embed_largest ? gb.w : gb.block, copy = o.offload_params != Offload::None ? 1.0 / o.dp : 0.0;
  const double grad = o.lora_rank > 0 ? 0 : sb.grads, prefetch = std::min(5e7, gp.all);
  r.lines.push_back({"gathered parameters (DeepSpeed working set)", (wl * (1 + copy) + grad) * L + gb.block * prefetch,
                     fmt::format("({:.4g} B x (1 + {:.3g}) + {} B) x largest layer {} + {:.4g} B x prefetch {}", wl, copy, grad, num(L),
                                 gb.block, num(prefetch)),
                     kDsGather, Place::Device, Basis::Formula});
}

// FSDP's unsharded units (fsdp_unsharded_bytes) and a trained unit's gradient, whole until its
// reduce-scatter (the head's, or a block's when larger).
void add_fsdp_gathered(MemReport& r, const ModelShape& m, const TrainOptions& o, const StateBytes& sb) {
  const WeightBytes gb = weight_bytes(o, sb);
  const double layer = double(m.layer_params()) / o.tp, head = double(m.vocab) * double(m.dim) / o.tp;
  const double grad = o.lora_rank > 0 ? 0 : sb.grads * std::max(head, layer);
  r.lines.push_back({"gathered parameters (FSDP units)", fsdp_unsharded_bytes(m, o, gb.w, gb.block) + grad,
                     fmt::format("{}, block matrices {:.4g} B per parameter{}",
                                 o.fsdp_embedding_units ? "max(head unit, block) + block" : "root unit + 2 blocks", gb.block,
                                 grad > 0 ? fmt::format(" + unsharded gradient {} B", num(grad)) : ""),
                     kFsdp, Place::Device, Basis::Formula});
}

// The optimizer's lines (bytes per GPU, / s_div from ZeRO-1 on): fp32 master weights, Adafactor's
// factored states, the other optimizers' states.
void add_optimizer_lines(MemReport& r, const ModelShape& m, const TrainOptions& o, const GpuParams& gp, const StateBytes& sb,
                         double trainable, Place opt_place, double s_div) {
  if (sb.master > 0)
    r.lines.push_back({"master weights (fp32)", sb.master * trainable / s_div,
                       fmt::format("4 B x Ψ_trainable{}", s_div > 1 ? " / N_d" : ""), kZero, opt_place, Basis::Formula});
  if (o.optimizer == Optimizer::Adafactor) {
    if (o.lora_rank > 0) throw UsageError("Adafactor with LoRA is not modelled (its factored states follow each adapter's shape)");
    const double elems = adafactor_state_elements(m) * gp.all / double(m.params()), bytes = o.precision == Precision::BF16 ? 2 : 4;
    r.lines.push_back({"optimizer states (Adafactor, factored)", bytes * elems / s_div,
                       fmt::format("{} B x (Σ matrices rows + cols + vectors) = {} x {} elements{}", bytes, bytes, num(elems),
                                   s_div > 1 ? " / N_d" : ""),
                       kAdafactor, opt_place, Basis::Formula});
  }
  if (sb.optim > 0)
    r.lines.push_back({"optimizer states", sb.optim * trainable / s_div,
                       fmt::format("{} B x Ψ_trainable{} ({}; K = {} with the master copy)", num(sb.optim), s_div > 1 ? " / N_d" : "",
                                   optimizer_label(o.optimizer), num(sb.k())),
                       o.optimizer == Optimizer::Adam8bit ? k8bit : kZero, opt_place, Basis::Formula});
}

// Bytes per trainable parameter: the run's precision, or fp32 for PEFT's adapters on a 16-bit
// base (peft_fp32_adapters: their gradients and AdamW's moments follow them).
StateBytes trainable_state_bytes(const TrainOptions& o) {
  return state_bytes(peft_fp32_adapters(o) ? Precision::FP32 : o.precision, o.optimizer, o.framework);
}

// Model states per GPU: parameters, gradients, master weights and optimizer states, each divided
// by N_d from the ZeRO stage that shards it, and placed where the offload options put them.
void add_model_states(MemReport& r, const ModelShape& m, const TrainOptions& o) {
  const GpuParams gp = gpu_params(m, o);
  const StateBytes sb = trainable_state_bytes(o);
  const double N = o.dp;
  const bool lora = o.lora_rank > 0;
  const double trainable = lora ? double(gp.layers) * lora_layer_params_of(m, o) / o.tp : gp.all;
  const Place opt_place = offload_place(o.offload_optimizer);
  const Place par_place = o.zero >= 3 ? offload_place(o.offload_params) : Place::Device;
  const double p_div = o.zero >= 3 ? N : 1, g_div = o.zero >= 2 ? N : 1, s_div = o.zero >= 1 ? N : 1;

  if (o.framework == Framework::DeepSpeed && !lora && o.precision == Precision::Mixed && o.optimizer == Optimizer::Adam &&
      o.zero >= 2) {
    // DeepSpeed's own estimator, model states as one line pair (GPU and CPU).
    add_ds_model_states(r, m, o, gp);
    return;
  }

  add_parameter_lines(r, o, gp, sb, trainable, par_place, p_div);
  if (o.zero >= 3 && !o.fsdp) add_ds_gathered(r, m, o, gp, sb);
  if (o.zero >= 3 && o.fsdp && o.dp > 1) add_fsdp_gathered(r, m, o, sb);
  const Place grad_place = o.offload_optimizer != Offload::None ? opt_place : Place::Device;
  r.lines.push_back({"gradients", sb.grads * trainable / g_div,
                     fmt::format("{} B x Ψ_trainable {}{}", sb.grads, num(trainable), g_div > 1 ? " / N_d" : ""), kZero, grad_place,
                     Basis::Formula});
  add_optimizer_lines(r, m, o, gp, sb, trainable, opt_place, s_div);
}

// PEFT's fp32 casts of the adapted Linears' inputs (TrainOptions::lora_fp32_inputs): Σ in over
// the layer's targets (4·s·b bytes each).
double lora_fp32_input_width(const ModelShape& m, const TrainOptions& o) {
  double in = 0;
  for (const auto& name : lora_layer_targets(o)) in += lora_target_dims(m, name).in;
  return in;
}

// DoRA's kept tensors (TrainOptions::dora): the bytes per value of the base output and of the
// LoRA output, and whether each adapted weight is kept as a fresh copy.
struct DoraKept {
  double base = 2, lora = 2;
  bool weight_copy = false;
};
DoraKept dora_kept(const TrainOptions& o) {
  DoraKept k;
  const double act = o.precision == Precision::FP32 ? 4 : 2;  // the base Linear's output (autocast: 16-bit)
  k.lora = peft_fp32_adapters(o) ? 4 : act;
  // With dropout PEFT recomputes the base output from the dropped input, in the adapters' dtype,
  // and F.linear keeps the weight it was given when that is a cast or a dequantized NF4 matrix.
  k.base = o.lora_dropout > 0 ? k.lora : act;
  k.weight_copy = o.lora_dropout > 0 && (o.qlora || k.lora != act);
  return k;
}

}  // namespace

// The two products with the magnitude's scale keep the Linear's base output and its LoRA output
// (tokens·out each), and with dropout F.linear keeps the weight copy of dora_kept when its input
// needs a gradient.
double dora_linear_bytes(const TrainOptions& o, double in, double out, double tokens, bool input_grad) {
  const DoraKept k = dora_kept(o);
  return tokens * out * (k.base + k.lora) + (k.weight_copy && input_grad ? k.lora * out * in : 0);
}

double dora_layer_bytes(const ModelShape& m, const TrainOptions& o) {
  double bytes = 0;
  for (const auto& name : lora_layer_targets(o)) {
    const LoraDims d = lora_target_dims(m, name);
    bytes += dora_linear_bytes(o, d.in, d.out, double(o.seq_len) * double(o.micro_batch));
  }
  return bytes / o.tp;
}

namespace {

void add_dora_activations(MemReport& r, const ModelShape& m, const TrainOptions& o, double layers) {
  const DoraKept k = dora_kept(o);
  const bool full = o.checkpointing == Checkpointing::Full;
  r.lines.push_back({"activations (DoRA: base and LoRA outputs)", dora_layer_bytes(m, o) * (full ? 1 : layers),
                     fmt::format("sb x Σ_targets out x ({} + {}) B{} per layer{}", k.base, k.lora,
                                 k.weight_copy ? fmt::format(" + {} B x each adapted weight (dropout > 0: a copy)", k.lora) : "",
                                 full ? ", the recomputed layer's" : fmt::format(" x {} layers", layers)),
                     kDora, Place::Device, Basis::Formula});
}

// PyTorch before 1.11 (TrainOptions::torch_version): softmax keeps its input, the scores, per
// layer (fp32 under autocast, which runs softmax in fp32, and in fp32 training; 16-bit in pure
// 16-bit training); 0 when no s² scores exist or the release is a later one.
double old_softmax_bytes(const ModelShape& m, const TrainOptions& o) {
  if (!softmax_keeps_input(o) || !attention_scores_kept(o.flash_attention, o.checkpointing)) return 0;
  const double s = double(o.seq_len);
  return (o.precision == Precision::BF16 ? 2 : 4) * double(m.heads) * s * s * double(o.micro_batch) / o.tp;
}

// What PyTorch keeps per layer beyond KORTH's count: torch.amp's fp32 copies, the inputs of
// softmax before 1.11, PEFT's fp32 adapter inputs; `layers` as in add_activations.
void add_layer_extras(MemReport& r, const ModelShape& m, const TrainOptions& o, double layers) {
  const double s = double(o.seq_len), b = double(o.micro_batch), h = double(m.dim), a = double(m.heads);
  if (o.precision == Precision::Amp) {
    // A GPT/BERT block under autocast, op by op: both LayerNorms save an fp32 input (+2sbh
    // each), the Q, K and V Linears each save their own 16-bit cast of the fp32 LayerNorm output
    // (+4sbh), softmax saves its fp32 output and the P·V matmul a 16-bit cast of it (+2as²b
    // without FlashAttention); with full recomputation the kept layer input is the fp32 residual (+2sbh).
    const double sbh = s * b * h / (o.sequence_parallel ? o.tp : 1);
    const double extra = o.checkpointing == Checkpointing::Full ? 2 * sbh
                         : 8 * sbh + (attention_scores_kept(o.flash_attention, o.checkpointing) ? 2 * a * s * s * b / o.tp : 0);
    r.lines.push_back({"activations (torch.amp fp32 copies)", extra * layers,
                       o.checkpointing == Checkpointing::Full ? "2sbh per layer (the kept input is the fp32 residual stream)"
                                                              : "sbh(8 + 2as/h) per layer: fp32 LayerNorm inputs, per-Linear casts, fp32 softmax",
                       kTorch, Place::Device, Basis::Formula});
  }
  if (const double old = old_softmax_bytes(m, o); old > 0 && o.checkpointing == Checkpointing::None)
    r.lines.push_back({"activations (softmax inputs, PyTorch < 1.11)", old * layers,
                       fmt::format("{}as²b/t per layer: softmax's autograd node keeps the scores it was given (torch {})",
                                   old / (a * s * s * b / o.tp), o.torch_version),
                       kTorchSoftmax, Place::Device, Basis::Formula});
  if (o.lora_rank > 0 && o.lora_fp32_inputs && o.checkpointing != Checkpointing::Full) {
    const double in = lora_fp32_input_width(m, o);
    r.lines.push_back({"activations (LoRA inputs in fp32, PEFT)", 4 * s * b * in * layers,
                       fmt::format("4sb x Σ_targets in = 4sb x {} per layer: each adapted Linear's input cast to its fp32 adapters "
                                   "(autocast_adapter_dtype), kept by lora_A",
                                   num(in)),
                       kPeft, Place::Device, Basis::Formula});
  }
  if (o.dora) add_dora_activations(r, m, o, layers);
}

// The head's activations: the pooler and classifier of a sequence classifier, else the output
// layer's input and fp32 logits.
void add_head_activations(MemReport& r, const ModelShape& m, const TrainOptions& o) {
  const double s = double(o.seq_len), b = double(o.micro_batch), h = double(m.dim);
  if (m.head == Head::Classifier) {
    const double out = 4 * b * h * 2 + 4 * m.logits(s, b);
    r.lines.push_back({"activations (classifier head)", out, fmt::format("4bh x 2 (pooler in and out) + 4b·labels, labels = {}", m.labels),
                       kKorth, Place::Device, Basis::Formula});
    return;
  }
  if (o.ce_chunks > 0) {  // torchtune's CEWithChunkedOutputLoss: bf16 logits in n chunks, one upcast to fp32 at a time
    const double n = double(o.ce_chunks), out = (4 * s * b * h + 2 * m.logits(s, b) + 4 * m.logits(s, b) / n) / o.tp;
    r.lines.push_back({"activations (output layer, chunked logits)", out,
                       fmt::format("(4sbh + 2sbv + 4sbv/{})/t: 16-bit logits, one chunk in fp32, v = {}", o.ce_chunks, m.vocab), kTuneCe,
                       Place::Device, Basis::Formula});
    return;
  }
  const double out = (4 * s * b * h + 4 * m.logits(s, b)) / o.tp;
  r.lines.push_back({"activations (output layer, fp32 logits)", out, fmt::format("(4sbh + 4sbv)/t, v = {}", m.vocab), kKorth, Place::Device,
                     Basis::Formula});
}

void add_activations(MemReport& r, const ModelShape& m, const TrainOptions& o) {
  const GpuParams gp = gpu_params(m, o);
  const double s = double(o.seq_len), b = double(o.micro_batch), h = double(m.dim), a = double(m.heads);
  const double in_flight = o.pp > 1 ? double(std::min<int64_t>(o.pp, o.grad_accum)) : 1.0;
  const double layers = double(gp.layers) * in_flight;
  // KORTH counts 16-bit values and 1-byte dropout masks: fp32 doubles the values, not the masks.
  const double scale = o.precision == Precision::FP32 ? 2.0 : 1.0;
  const auto layer_bytes = [&](Checkpointing ckpt) {
    return korthikanti_layer_activations(s, b, h, a, o.tp, o.sequence_parallel, ckpt, o.flash_attention) * scale -
           (scale - 1) * korthikanti_dropout_masks(s, b, h, a, o.tp, o.sequence_parallel, ckpt, o.flash_attention);
  };
  std::string f;
  if (o.checkpointing == Checkpointing::Full) f = "2sbh per layer (layer input)";
  else if (!attention_scores_kept(o.flash_attention, o.checkpointing))
    f = o.sequence_parallel ? "34sbh/t per layer" : "sbh(10 + 24/t) per layer (t = 1: 34sbh)";
  else f = o.sequence_parallel ? "sbh(34 + 5as/h)/t per layer" : "sbh(10 + 24/t + 5as/(ht)) per layer (t = 1: sbh(34 + 5as/h))";
  f += fmt::format(" x {} layers{} ; s={} b={} h={} a={} t={}{}", gp.layers, in_flight > 1 ? fmt::format(" x {} micro-batches in flight (1F1B)", in_flight) : "",
                   o.seq_len, o.micro_batch, m.dim, m.heads, o.tp, scale > 1 ? "; x2 for fp32 activations, the 1-byte dropout masks once" : "");
  r.lines.push_back({"activations (transformer layers)", layer_bytes(o.checkpointing) * layers, f, kKorth, Place::Device, Basis::Formula});
  add_layer_extras(r, m, o, layers);
  if (o.checkpointing == Checkpointing::Full)
    r.lines.push_back({"activations (one layer recomputed)", layer_bytes(Checkpointing::None) + old_softmax_bytes(m, o),
                       "the layer's full activations during its backward", kKorth, Place::Device, Basis::Formula});
  add_head_activations(r, m, o);
}

void add_temporaries(MemReport& r, const ModelShape& m, const TrainOptions& o) {
  const double s = double(o.seq_len), b = double(o.micro_batch);
  const double chunks = m.head == Head::Classifier || o.ce_chunks <= 0 ? 1 : double(o.ce_chunks);
  r.lines.push_back({"temporary: logits gradient (fp32)", 4 * m.logits(s, b) / o.tp / chunks,
                     m.head == Head::Classifier ? "4b·labels during the loss backward"
                     : chunks > 1               ? fmt::format("4sbv/({}t): one chunk's during the loss backward", o.ce_chunks)
                                                : "4sbv/t during the loss backward",
                     kKorth, Place::Device, Basis::Formula});
  if (o.precision == Precision::Amp) {
    const GpuParams gp = gpu_params(m, o);
    const double head = m.head == Head::Classifier ? double(m.dim) * double(m.dim + m.labels) : double(m.vocab) * double(m.dim);
    const double linear = gp.block_linear + head / o.tp;
    r.lines.push_back({"autocast weight copies (16-bit)", 2 * linear,
                       fmt::format("2 B x {} Linear parameters: torch.autocast caches each weight's cast from its first use to the end "
                                   "of the backward",
                                   num(linear)),
                       kTorch, Place::Device, Basis::Formula});
  }
  if (o.qlora) {
    const double mat = double(std::max(m.dim * m.hidden, m.dim * m.q_dim())) / o.tp;
    r.lines.push_back({"temporary: dequantized NF4 matrix (bf16)", 2 * mat, "2 B x largest block matrix", kQlora, Place::Device,
                       Basis::Formula});
  }
}

void add_comm_and_overhead(MemReport& r, const ModelShape& m, const TrainOptions& o) {
  const GpuParams gp = gpu_params(m, o);
  const StateBytes sb = trainable_state_bytes(o);
  const double trainable = o.lora_rank > 0 ? double(gp.layers) * lora_layer_params_of(m, o) / o.tp : gp.all;
  if (o.dp > 1 && o.zero == 0)
    r.lines.push_back({"communication: DDP gradient buckets", sb.grads * trainable,
                       "one copy of the gradients (DistributedDataParallel, gradient_as_bucket_view=False, 25 MB buckets covering all)",
                       kTorch, Place::Device, Basis::Formula});
  if (o.zero >= 1 && !o.fsdp) {
    // Allocated whole whatever the trainable count (contiguous_gradients, on by default), in the
    // parameters' dtype: fp32 unless DeepSpeed's fp16/bf16 mode runs.
    const double bytes = param_dtype_bytes(o.precision);
    r.lines.push_back({"communication: DeepSpeed gradient bucket", bytes * 5e8,
                       fmt::format("{} B x reduce_bucket_size 5e8 (stage {}: {})", bytes, o.zero,
                                   o.zero == 3 ? "allocated with the optimizer" : "allocated by each backward"),
                       kDsIpg, Place::Device, Basis::Formula});
  }
  if (o.cuda_context_given)
    r.lines.push_back({"CUDA context + cuBLAS workspace (given)", o.cuda_context_bytes, "--cuda-context: measured on the user's setup",
                       "the user's measurement", Place::GpuOther, Basis::Measured});
  else
    r.lines.push_back({"CUDA context + cuBLAS workspace", o.cuda_context_bytes, "assumed constant per GPU (not measured here)", kKo2,
                       Place::GpuOther, Basis::Assumed});
  if (o.dp * o.tp * o.pp > 1) add_nccl_line(r, o.nccl_bytes);
}

// ------------------------------------------------------------------ PyTorch (bench/train_mem.py)

// Bytes the CUDACachingAllocator counts for an allocation of n bytes on a fresh allocator:
// rounded up to 512; above 10 MiB the segment is rounded to 2 MiB and not split when less than
// 1 MiB would remain, so the whole segment is counted (CUDACachingAllocator.cpp: round_size,
// get_allocation_size, should_split).
double torch_block(double n) {
  if (n <= 0) return 0;
  const double r = std::ceil(n / 512) * 512;
  if (r > 10 * kMiB) {
    const double seg = std::ceil(r / (2 * kMiB)) * (2 * kMiB);
    if (seg - r <= kMiB) return seg;
  }
  return r;
}

// Amounts in bytes at one moment of a training step.
struct Phase {
  std::string name;
  double w = 0, g = 0, s = 0, act = 0, temp = 0, comm = 0;
  double total() const { return w + g + s + act + temp + comm; }
};

// pytorch_estimate's report of its peak phase P (raw bytes) whose allocator blocks total
// blocks_total: one line per kind, formulas and sources beside them.
MemReport pytorch_report(const Phase& P, double blocks_total, size_t n_phases, const ModelShape& m, const TrainOptions& o) {
  const bool autocast = llmq::mem::autocast(o.precision, o.framework), bf16 = o.precision == Precision::BF16;
  const double p = bf16 ? 2 : 4;              // parameter (and gradient, state) bytes
  const double c = autocast || bf16 ? 2 : 4;  // compute (matmul output) bytes
  const double res = bf16 ? 2 : 4;            // residual stream bytes
  MemReport r;
  r.device = "gpu 0";
  const std::string prec = autocast ? "fp32 parameters + bf16 autocast" : bf16 ? "pure bf16" : "fp32";
  r.lines.push_back({"parameters", P.w, fmt::format("{} B x Ψ = {} x {}", p, p, num(double(m.params()))), kTorch, Place::Device, Basis::Formula});
  r.lines.push_back({"gradients", P.g, fmt::format("{} B x parameters whose gradient exists at the peak", p), kTorch, Place::Device, Basis::Formula});
  r.lines.push_back({"optimizer states", P.s,
                     o.optimizer == Optimizer::Adam ? fmt::format("exp_avg + exp_avg_sq: 2 x {} B x Ψ", p)
                     : o.optimizer == Optimizer::SGDMomentum ? fmt::format("momentum buffer: {} B x Ψ", p)
                     : o.optimizer == Optimizer::Adam8bit ? "2 x 1 B x Ψ + fp32 absmax per 2048 (bitsandbytes)"
                     : o.optimizer == Optimizer::Adafactor ? fmt::format("Adafactor: {} B x (rows + cols) per matrix, x n per vector", p)
                                                          : "none",
                     o.optimizer == Optimizer::Adam8bit ? k8bit : kTorch, Place::Device, Basis::Formula});
  r.lines.push_back({"activations (saved for backward)", P.act,
                     fmt::format("per layer {}: 2·(res·sbh + 4sb + c·sbh) + 2c·sb·q + 2c·sb·kv + {} + 4c·sbH; head res·sbh + 4sb + c·sbh + "
                                 "4sbV; res={} c={} s={} b={}",
                                 o.checkpointing == Checkpointing::Full ? "(checkpointed: res·sbh kept, one layer recomputed)" : "",
                                 o.flash_attention ? "lse 4bas" : "probs c·bas²", res, c, o.seq_len, o.micro_batch),
                     std::string(kKorth) + " (method); bench/train_mem.py (tensors)", Place::Device, Basis::Formula});
  r.lines.push_back({"temporary buffers", P.temp,
                     "at the peak: autocast weight copies 2 B x Linear params, loss gradients 4sbV each, layer-backward gradients, "
                     "AdamW foreach sqrt(exp_avg_sq) copy",
                     kTorch, Place::Device, Basis::Formula});
  if (P.comm > 0)
    r.lines.push_back({"communication: DDP gradient buckets", P.comm, "one copy of the gradients", kTorch, Place::Device, Basis::Formula});
  r.lines.push_back({"allocator rounding", blocks_total - P.total(),
                     "Σ per tensor (round_up(n, 512) - n), large segments to 2 MiB when < 1 MiB would remain", kTorch, Place::Device,
                     Basis::Formula});
  add_torch_cuda_lines(r, o.gpu, 2, o.cuda_context_bytes, o.cuda_context_given);
  if (o.dp > 1) add_nccl_line(r, o.nccl_bytes);
  r.notes.push_back(fmt::format("peak phase: {} (of {} phases modelled); precision {}", P.name, n_phases, prec));
  r.notes.push_back("the device total minus gpu-other lines is what torch.cuda.max_memory_allocated() reports");
  r.extra["peak_phase"] = P.name;
  r.extra["predicted_max_memory_allocated"] = std::llround(r.total(Place::Device));  // the allocator's blocks and the workspaces
  return r;
}

// Bytes per value and widths of one step of bench/train_mem.py's Llama.
struct TorchStep {
  bool autocast = false, full = false;  // Linear layers under autocast; full checkpointing
  double p = 0, c = 0, res = 0;         // parameter, compute and residual stream bytes
  double s = 0, b = 0, sb = 0;          // sequence length, micro-batch, tokens
  double h = 0, q = 0, kv = 0, H = 0, V = 0, a = 0;  // width, query, key/value and MLP widths, vocabulary, heads
  std::vector<std::pair<double, double>> layer_shapes, other_shapes;  // parameter tensors [rows, cols]; cols 0: a vector
  std::vector<double> layer_mats, layer_vecs, other;                  // their numel
};

// TorchStep for m and o: byte sizes from the precision, the step's widths and the parameter tensors.
TorchStep torch_step(const ModelShape& m, const TrainOptions& o) {
  TorchStep t;
  const bool autocast = llmq::mem::autocast(o.precision, o.framework), bf16 = o.precision == Precision::BF16;
  t.autocast = autocast, t.full = o.checkpointing == Checkpointing::Full;
  t.p = bf16 ? 2 : 4;         // parameter (and gradient, state) bytes
  t.c = autocast || bf16 ? 2 : 4;  // compute (matmul output) bytes
  t.res = bf16 ? 2 : 4;       // residual stream bytes (fp32 under autocast: fp32 embedding + promotion)
  t.s = double(o.seq_len), t.b = double(o.micro_batch), t.sb = t.s * t.b;
  const double h = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_dim()), H = double(m.hidden), V = double(m.vocab);
  t.h = h, t.q = q, t.kv = kv, t.H = H, t.V = V, t.a = double(m.heads);

  // Parameter tensors (numel), in bench/train_mem.py's module order.
  t.layer_shapes = {{q, h}, {kv, h}, {kv, h}, {h, q}, {H, h}, {H, h}, {h, H}};  // [rows, cols]
  for (const auto& [rows, cols] : t.layer_shapes) t.layer_mats.push_back(rows * cols);
  t.layer_vecs = {h, h};
  t.other_shapes = {{V, h}, {h, 0}};  // embedding, final norm (cols 0: a vector)
  if (!m.tied) t.other_shapes.push_back({V, h});
  for (const auto& [rows, cols] : t.other_shapes) t.other.push_back(cols > 0 ? rows * cols : rows);
  return t;
}

// Σ f(n) over the numels v.
double sum_over(const std::function<double(double)>& f, const std::vector<double>& v) {
  double t = 0;
  for (double n : v) t += f(n);
  return t;
}

// Σ over one layer's parameter tensors of R(bytes_per · numel)
double torch_layer_param(const TorchStep& t, const std::function<double(double)>& R, double bytes_per) {
  auto f = [&](double n) { return R(bytes_per * n); };
  return sum_over(f, t.layer_mats) + sum_over(f, t.layer_vecs);
}

// Σ over all parameter tensors of R(bytes_per · numel)
double torch_per_param(const ModelShape& m, const TorchStep& t, const std::function<double(double)>& R, double bytes_per) {
  return double(m.layers) * torch_layer_param(t, R, bytes_per) + sum_over([&](double n) { return R(bytes_per * n); }, t.other);
}

// The optimizer's bytes under R: its states S and the temporaries T_opt of its step.
struct TorchOptimizer {
  double S = 0, T_opt = 0;
};

TorchOptimizer torch_optimizer(const ModelShape& m, const TrainOptions& o, const TorchStep& t, const std::function<double(double)>& R) {
  const double p = t.p;
  auto per_param = [&](double bytes_per) { return torch_per_param(m, t, R, bytes_per); };
  double S = 0, T_opt = 0;
  switch (o.optimizer) {
    case Optimizer::Adam: S = 2 * per_param(p), T_opt = per_param(p); break;  // foreach: sqrt(exp_avg_sq) copy
    case Optimizer::SGDMomentum: S = per_param(p); break;
    case Optimizer::Adam8bit: {  // bitsandbytes: 8-bit states for tensors >= 4096 elements, fp32 absmax per 2048
      auto f = [&](double n) { return n >= 4096 ? 2 * R(n) + 2 * R(4 * std::ceil(n / 2048)) : 2 * R(4 * n); };
      S = double(m.layers) * (sum_over(f, t.layer_mats) + sum_over(f, t.layer_vecs)) + sum_over(f, t.other);
      break;
    }
    case Optimizer::SGD: break;
    case Optimizer::Adafactor: {
      // torch.optim.Adafactor (foreach): row and column variances per matrix, a full variance
      // per vector, a step scalar per tensor; the step's var_estimates are a full-size copy of
      // every matrix at once (_multi_tensor_adafactor), the vectors' a clone.
      auto f = [&](const std::pair<double, double>& rc) { return R(p * rc.first) + R(p * rc.second) + R(4); };
      auto vec = [&](double n) { return R(p * n) + R(4); };
      double st = sum_over(vec, t.layer_vecs), st_other = 0;
      for (const auto& rc : t.layer_shapes) st += f(rc);
      for (const auto& rc : t.other_shapes) st_other += rc.second == 0 ? vec(rc.first) : f(rc);
      S = double(m.layers) * st + st_other;
      T_opt = per_param(p);
      break;
    }
  }
  return {S, T_opt};
}

// One block's saved activations under R (bytes): residual, norm and matmul outputs, attention's lse or probabilities.
double torch_layer_saved(const TrainOptions& o, const TorchStep& t, const std::function<double(double)>& R) {
  const double c = t.c, res = t.res, s = t.s, b = t.b, sb = t.sb, h = t.h, q = t.q, kv = t.kv, H = t.H, a = t.a;
  const double lse = 4 * b * a * (c == 4 ? std::ceil(s / 32) * 32 : s);
  const double attn_extra = o.flash_attention ? R(lse) : R(c * b * a * s * s);
  return 2 * (R(res * sb * h) + R(4 * sb) + R(c * sb * h)) + 2 * R(c * sb * q) + 2 * R(c * sb * kv) + attn_extra + 4 * R(c * sb * H);
}

// The phases of one training step (bytes under R: raw, or the allocator's blocks): the forward's
// end, the loss backward, each layer's backward from the last, the optimizer step.
std::vector<Phase> torch_phases(const ModelShape& m, const TrainOptions& o, const TorchStep& t, const std::function<double(double)>& R) {
  const bool autocast = t.autocast, full = t.full;
  const double p = t.p, c = t.c, res = t.res, sb = t.sb, h = t.h, H = t.H, V = t.V;
  const double W = torch_per_param(m, t, R, p), G = torch_per_param(m, t, R, p);
  const TorchOptimizer opt = torch_optimizer(m, o, t, R);
  const double S = opt.S, T_opt = opt.T_opt;
  // Autocast's bf16 copies of the Linear weights (cached until autocast exits; saved by the linears).
  const double cw_layer = autocast ? sum_over([&](double n) { return R(2 * n); }, t.layer_mats) : 0;
  const double cw_head = autocast ? R(2 * V * h) : 0;
  // Saved activations of one block (bench/train_mem.py's Block; FlashAttention SDPA).
  const double A_layer = torch_layer_saved(o, t, R);
  const double A_saved_layer = full ? R(res * sb * h) : A_layer;
  const double logsm = R(4 * sb * V);
  const double A_head = R(res * sb * h) + R(4 * sb) + R(c * sb * h) + logsm;
  const double A_all = double(m.layers) * A_saved_layer + A_head;
  const double comm = o.dp > 1 ? G : 0;  // DDP buckets
  const double G0 = o.grad_accum > 1 ? G : 0;  // grads persist across micro-batches

  std::vector<Phase> ph;
  ph.push_back({"forward end (loss)", W, G0, S, A_all, double(m.layers) * cw_layer + cw_head + logsm, comm});
  const double cw_saved = (full ? 0 : double(m.layers) * cw_layer) + cw_head;
  ph.push_back({"backward start (loss gradient)", W, G0, S, A_all, cw_saved + 2 * logsm, comm});
  double g_done = G0 + (G0 > 0 ? 0 : R(p * V * h) * (m.tied ? 0 : 1) + R(p * h));  // head grads
  double cw_rem = cw_saved - cw_head, a_rem = A_all - A_head;
  const double T_layer = R(res * sb * h) + 3 * R(c * sb * H) + (autocast ? R(2 * h * H) : 0);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    const double recompute = full ? A_layer + cw_layer : 0;
    ph.push_back({fmt::format("backward of layer {}", l), W, g_done, S, a_rem + recompute, cw_rem + T_layer, comm});
    if (G0 == 0) g_done += torch_layer_param(t, R, p);
    cw_rem -= full ? 0 : cw_layer;
    a_rem -= A_saved_layer;
  }
  ph.push_back({"optimizer step", W, G, S, 0, T_opt, comm});
  return ph;
}

MemReport pytorch_estimate(const ModelShape& m, const TrainOptions& o) {
  if (o.tp != 1 || o.pp != 1 || o.zero != 0 || o.lora_rank > 0 || o.offload_optimizer != Offload::None ||
      o.offload_params != Offload::None || o.checkpointing == Checkpointing::Selective || m.gpt)
    throw UsageError("--framework pytorch models one process of bench/train_mem.py's Llama (optionally DDP): no TP/PP, ZeRO, "
                     "LoRA, offload or selective checkpointing; use --framework analytic for those");
  const TorchStep t = torch_step(m, o);
  // Everything is computed twice: raw bytes and allocator blocks; the difference is a line.
  const std::vector<Phase> raw = torch_phases(m, o, t, [](double n) { return n; });
  const std::vector<Phase> blk = torch_phases(m, o, t, torch_block);
  size_t peak = 0;
  for (size_t i = 0; i < blk.size(); ++i)
    if (blk[i].total() > blk[peak].total()) peak = i;
  return pytorch_report(raw[peak], blk[peak].total(), raw.size(), m, o);
}

}  // namespace

bool is_sm90_gpu(const std::string& gpu) {
  const std::string g = lower(gpu);
  for (const char* n : {"h100", "h200", "h800", "h20", "gh200"})
    if (g.find(n) != std::string::npos) return true;
  return false;
}

double torch_cublas_workspace_bytes(const std::string& gpu) {
  return is_sm90_gpu(gpu) ? 4096.0 * 8 * 1024 : 4096.0 * 1024 * 2 + 16.0 * 1024 * 8;
}

double adafactor_state_elements(const ModelShape& m) {
  const double h = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_dim()), H = double(m.hidden), V = double(m.vocab);
  const double mlp = m.mlp == Mlp::SwiGLU ? 2 * (H + h) + (h + H) : (H + h) + (h + H);  // gate, up [H, h]; down [h, H]
  const double layer = (q + h) + 2 * (kv + h) + (h + q) + mlp + double(m.layer_params() - m.layer_linear_params());
  const double embed = (V + h) + double(m.embed_params()) - V * h;  // learned positions (GPT) in full
  const double lbl = double(m.labels);
  const double head = m.head == Head::Classifier ? (h + h) + h + (lbl + h) + lbl  // pooler [h, h] + bias, classifier [labels, h] + bias
                                                 : double(m.head_params()) - (m.tied ? 0 : V * h) + (m.tied ? 0 : V + h);
  return double(m.layers) * layer + embed + head;
}

void add_torch_cuda_lines(MemReport& r, const std::string& gpu, int handles, double context, bool given) {
  const double ws = torch_cublas_workspace_bytes(gpu);
  r.lines.push_back({handles == 1 ? "cuBLAS workspace" : "cuBLAS workspaces", handles * ws,
                     fmt::format("{} x {} ({}){}", handles, format_bytes(ws),
                                 is_sm90_gpu(gpu) ? "sm_90" : gpu.empty() ? "not sm_90: no --gpu given" : "not sm_90",
                                 handles == 2 ? ": the forward thread's and autograd's backward thread's handles" : ""),
                     kTorchBlas, Place::Device, Basis::Formula});
  // The context (outside max_memory_allocated): torch.cuda.mem_get_info's used bytes minus
  // max_memory_reserved in bench/train_mem.py, 751-767 MiB on an H100 80GB HBM3 (PyTorch
  // 2.11.0+cu130, driver 580; bench/RESULTS.md); elsewhere not measured.
  if (given)
    r.lines.push_back({"CUDA context (given)", context, "--cuda-context: measured on the user's setup", "the user's measurement",
                       Place::GpuOther, Basis::Measured});
  else if (lower(gpu).find("h100") != std::string::npos)
    r.lines.push_back({"CUDA context (PyTorch)", 767.0 * (1 << 20), "measured: H100 80GB, PyTorch 2.11 + CUDA 13.0, driver 580 (751-767 MiB)",
                       "bench/train_mem.py on an H100 (bench/RESULTS.md)", Place::GpuOther, Basis::Measured});
  else
    r.lines.push_back({"CUDA context", context, "assumed constant per GPU (measured only on an H100: 767 MiB with PyTorch)", kKo2,
                       Place::GpuOther, Basis::Assumed});
}

Precision precision_from_name(const std::string& s) {
  const std::string n = lower(s);
  if (n == "fp32" || n == "float32") return Precision::FP32;
  if (n == "fp16" || n == "bf16" || n == "mixed") return Precision::Mixed;
  if (n == "amp" || n == "fp16-mixed" || n == "bf16-mixed" || n == "16-mixed") return Precision::Amp;
  if (n == "pure-bf16" || n == "bf16-pure") return Precision::BF16;
  throw UsageError("unknown precision '" + s + "' (fp32, fp16, bf16 = mixed with fp32 master weights, amp = torch.amp autocast, pure-bf16)");
}

Optimizer optimizer_from_name(const std::string& s) {
  const std::string n = lower(s);
  if (n == "adam" || n == "adamw") return Optimizer::Adam;
  if (n == "adam8bit" || n == "adam-8bit" || n == "8bit-adam") return Optimizer::Adam8bit;
  if (n == "sgd") return Optimizer::SGD;
  if (n == "sgd-momentum" || n == "momentum") return Optimizer::SGDMomentum;
  if (n == "adafactor") return Optimizer::Adafactor;
  throw UsageError("unknown optimizer '" + s + "' (adam, adamw, adam8bit, sgd, sgd-momentum, adafactor)");
}

Checkpointing checkpointing_from_name(const std::string& s) {
  const std::string n = lower(s);
  if (n == "none" || n == "off") return Checkpointing::None;
  if (n == "selective") return Checkpointing::Selective;
  if (n == "full" || n == "on") return Checkpointing::Full;
  throw UsageError("unknown checkpointing '" + s + "' (none, selective, full)");
}

Offload offload_from_name(const std::string& s) {
  const std::string n = lower(s);
  if (n == "none") return Offload::None;
  if (n == "cpu") return Offload::Cpu;
  if (n == "nvme") return Offload::Nvme;
  throw UsageError("unknown offload target '" + s + "' (none, cpu, nvme)");
}

Framework framework_from_name(const std::string& s) {
  const std::string n = lower(s);
  if (n == "analytic" || n == "paper") return Framework::Analytic;
  if (n == "pytorch" || n == "torch") return Framework::PyTorch;
  if (n == "deepspeed") return Framework::DeepSpeed;
  if (n == "litgpt") return Framework::LitGPT;
  if (n == "torchtune") return Framework::TorchTune;
  if (n == "transformers" || n == "hf") return Framework::Transformers;
  throw UsageError("unknown framework '" + s + "' (analytic, pytorch, deepspeed, litgpt, torchtune, transformers)");
}

StateBytes state_bytes(Precision p, Optimizer o, Framework f) {
  StateBytes s;
  const bool torch_amp = autocast(p, f);  // fp32 parameters under autocast
  const bool fp32_params = p == Precision::FP32 || torch_amp;
  s.weights = fp32_params ? 4 : 2;
  s.grads = fp32_params ? 4 : 2;
  s.master = p == Precision::Mixed && !torch_amp ? 4 : 0;
  const double state = p == Precision::BF16 ? 2 : 4;  // one moment
  switch (o) {
    case Optimizer::Adam: s.optim = 2 * state; break;
    case Optimizer::Adam8bit: s.optim = 2 + 8.0 / 2048; break;
    case Optimizer::SGD: s.optim = 0; break;
    case Optimizer::SGDMomentum: s.optim = state; break;
    case Optimizer::Adafactor: s.optim = 0; break;  // factored: O(rows + cols), a line of its own
  }
  return s;
}

double inference_bytes_per_param(const std::string& format) {
  const std::string n = lower(format);
  if (n == "fp32" || n == "f32") return 4;
  if (n == "bf16" || n == "fp16" || n == "f16") return 2;
  if (n == "int8") return 1;
  if (n == "nf4") return 0.5 + 4.0 / 64;
  if (n == "nf4-dq") return (4 + 0.127) / 8;
  for (const char* q : {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"})  // llmq's block types
    if (n == q) {
      const DTypeInfo& t = dtype_info(dtype_from_name(q));
      return double(t.block_bytes) / double(t.block);
    }
  throw UsageError("unknown weight format '" + format +
                   "' (fp32, bf16, fp16, int8, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, nf4, nf4-dq; for a mix such as "
                   "q4_k_m give the converted file, whose tensor sizes are exact)");
}

double zero_model_states(double params, int stage, int n_d, double k) {
  const double N = n_d;
  switch (stage) {
    case 0: return (2 + 2 + k) * params;
    case 1: return 4 * params + k * params / N;
    case 2: return 2 * params + (2 + k) * params / N;
    default: return (4 + k) * params / N;
  }
}

CpuGpu ds_zero2_model_states(double P, int gpus_per_node, int nodes, bool cpu_offload, double f) {
  const double N = double(gpus_per_node) * nodes;
  if (cpu_offload) return {P * std::max(4 * N, 16.0) * f, 2 * P};
  return {P * 4 * gpus_per_node * f, 4 * P + std::floor(16 * P / N)};
}

CpuGpu ds_zero3_model_states(double P, double largest_layer, int gpus_per_node, int nodes, bool offload_optimizer,
                             bool offload_params, bool zero_init, double f) {
  const double N = double(gpus_per_node) * nodes, gf = 1.0 / nodes, largest = 4 * largest_layer;
  if (offload_optimizer && offload_params)
    return {zero_init ? P * 18 * gf * f : P * std::max(4.0 * gpus_per_node, 18 * gf) * f, largest};
  if (offload_optimizer)
    return {zero_init ? P * 16 * gf * f : P * std::max(4.0 * gpus_per_node, 16 * gf) * f, largest + std::floor(2 * P / N)};
  return {zero_init ? largest_layer * 4 * gpus_per_node * f : P * 4 * gpus_per_node * f, largest + std::floor(18 * P / N)};
}

bool attention_scores_kept(bool flash, Checkpointing ckpt) { return !flash && ckpt != Checkpointing::Selective; }

double korthikanti_layer_activations(double s, double b, double h, double a, int t, bool sp, Checkpointing ckpt, bool flash) {
  const double sbh = s * b * h;
  if (ckpt == Checkpointing::Full) return 2 * sbh / (sp ? t : 1);
  const bool attn_matrix = attention_scores_kept(flash, ckpt);
  if (sp) return sbh * (34 + (attn_matrix ? 5 * a * s / h : 0)) / t;
  return sbh * (10 + 24.0 / t + (attn_matrix ? 5 * a * s / (h * t) : 0));
}

double korthikanti_dropout_masks(double s, double b, double h, double a, int t, bool sp, Checkpointing ckpt, bool flash) {
  if (ckpt == Checkpointing::Full) return 0;
  const bool attn_matrix = attention_scores_kept(flash, ckpt);
  return 2 * s * b * h / (sp ? t : 1) + (attn_matrix ? a * s * s * b / t : 0);
}

bool softmax_keeps_input(const TrainOptions& o) {
  return !o.torch_version.empty() && release_code(o.torch_version, "--torch-version") < 1011;
}

namespace {

// UsageError for options that contradict each other or the model.
void check_training_options(const ModelShape& m, const TrainOptions& o) {
  if (o.micro_batch < 1 || o.seq_len < 1 || o.grad_accum < 1 || o.dp < 1 || o.tp < 1 || o.pp < 1)
    throw UsageError("micro-batch, sequence length, gradient accumulation and parallel degrees must be >= 1");
  if (o.zero < 0 || o.zero > 3) throw UsageError("--zero must be 0, 1, 2 or 3");
  if (o.qlora && o.lora_rank <= 0) throw UsageError("--qlora needs --lora-rank > 0");
  if (!(o.lora_dropout >= 0 && o.lora_dropout < 1)) throw UsageError("--lora-dropout must be in [0, 1)");
  if (o.dora && (o.lora_rank <= 0 || (o.framework != Framework::Analytic && o.framework != Framework::Transformers)))
    throw UsageError("--dora models PEFT's DoRA (use_dora): it needs --lora-rank and the analytic or transformers framework");
  if (o.padded && o.framework != Framework::Transformers) throw UsageError("--padded describes transformers' attention: add --framework transformers");
  if (o.lora_fp32_inputs && (o.lora_rank <= 0 || o.framework != Framework::Analytic || o.precision != Precision::BF16))
    throw UsageError("--lora-fp32-inputs models PEFT's LoRA on a pure 16-bit base: it needs --lora-rank, --precision pure-bf16 and the "
                     "analytic framework");
  if (o.offload_params != Offload::None && o.zero != 3) throw UsageError("parameter offload needs ZeRO-3 (or FSDP)");
  if (o.tp > 1 && (m.heads % o.tp != 0 || m.kv_heads % o.tp != 0 || m.hidden % o.tp != 0))
    throw UsageError(fmt::format("--tp {} must divide heads ({}), kv heads ({}) and the FFN width ({})", o.tp, m.heads, m.kv_heads, m.hidden));
  if (o.pp > m.layers) throw UsageError("--pp cannot exceed the layer count");
  if (o.ce_chunks < 0) throw UsageError("--ce-chunks must be >= 0 (0: CrossEntropyLoss on the whole logits)");
  if (o.fsdp_embedding_units && !(o.fsdp && o.zero == 3))
    throw UsageError("--fsdp-embedding-units describes FSDP units: add --fsdp full");
  if (!o.torch_version.empty()) {
    release_code(o.torch_version, "--torch-version");
    if (o.framework != Framework::Analytic && o.framework != Framework::DeepSpeed)
      throw UsageError("--torch-version changes the analytic formula's attention; the pytorch, litgpt and torchtune frameworks each "
                       "model one PyTorch release of their own");
  }
  if (o.framework != Framework::TorchTune && (o.compile || o.offload_activations || o.optimizer_in_backward || o.paged_optimizer))
    throw UsageError("--compile, --offload-activations, --optimizer-in-backward and --paged-optimizer model torchtune's "
                     "recipes: add --framework torchtune");
  if (o.ce_chunks > 0 && (o.framework == Framework::PyTorch || o.framework == Framework::LitGPT || o.framework == Framework::Transformers))
    throw UsageError("--ce-chunks models torchtune's chunked loss: the analytic, deepspeed and torchtune frameworks");
}

}  // namespace

MemReport estimate_training(const ModelShape& m, const TrainOptions& o) {
  m.validate();
  check_training_options(m, o);

  MemReport r = o.framework == Framework::PyTorch ? pytorch_estimate(m, o)
                : o.framework == Framework::LitGPT    ? litgpt_estimate(m, o)
                : o.framework == Framework::TorchTune ? torchtune_estimate(m, o)
                : o.framework == Framework::Transformers ? transformers_estimate(m, o)
                                                      : MemReport{};
  if (o.framework == Framework::Analytic || o.framework == Framework::DeepSpeed) {
    r.device = "gpu 0";
    add_model_states(r, m, o);
    add_activations(r, m, o);
    add_temporaries(r, m, o);
    add_comm_and_overhead(r, m, o);
    r.notes.push_back("activations follow Korthikanti et al.'s GPT derivation (16-bit values, 4h GELU MLP); "
                      "--framework pytorch counts a Llama block tensor by tensor");
    if (o.fsdp && o.dp > 1)
      r.notes.push_back("not counted: the caching allocator's reserve above the allocated peak, which nvidia-smi shows; "
                        "Answer.AI's published FSDP1 (Q)LoRA runs reserved 9-61% more than this model's allocated total "
                        "(bench/RESULTS.md): keep that margin on the card");
  }
  const int world = o.dp * o.tp * o.pp;
  r.title = fmt::format("{} ({} params), train {} {}, b={} s={} accum={}, dp={} zero={} tp={} pp={}{}{}, per GPU", m.name,
                        num(double(m.counted_params ? m.counted_params : m.params())),
                        o.framework == Framework::PyTorch && o.precision == Precision::Mixed ? "bf16 autocast (fp32 parameters)"
                                                                                              : precision_label(o.precision),
                        optimizer_label(o.optimizer), o.micro_batch, o.seq_len, o.grad_accum, o.dp, o.zero, o.tp, o.pp,
                        o.lora_rank > 0 ? fmt::format(", {}LoRA r={}", o.qlora ? "Q" : "", o.lora_rank) : "",
                        o.checkpointing != Checkpointing::None ? fmt::format(", ckpt={}", o.checkpointing == Checkpointing::Full ? "full" : "selective") : "");
  r.notes.push_back(fmt::format("gradient accumulation {} micro-batches: no memory of its own; effective batch {} sequences", o.grad_accum,
                                o.micro_batch * o.grad_accum * o.dp));
  r.extra["world_size"] = world;
  r.extra["params"] = m.counted_params ? m.counted_params : m.params();
  return r;
}

MemLine rule_of_thumb_line(const ModelShape& m, const MemReport& est) {
  const double psi = double(m.params());
  const double rule = 6 * 4 * psi;
  double states = 0, act = 0;
  for (const auto& l : est.lines) {
    if (l.place != Place::Device) continue;
    const auto starts = [&](const char* p) { return l.name.rfind(p, 0) == 0; };
    if (starts("activations") || starts("temporary")) act += l.bytes;
    else if (starts("parameters") || starts("gathered parameters") || starts("gradients") || starts("model states") ||
             l.name.find("optimizer") != std::string::npos || l.name.find("master") != std::string::npos)
      states += l.bytes;
  }
  const double ours = est.total(Place::Device);
  return {"rule of thumb: 6 x fp32 weights", rule,
          fmt::format("24 B/param x {} = {}; ours {} = model states {} ({:.1f} B/param) + activations and temporaries {} ({:.1f} B/param); "
                      "difference {:+.1f}%: the rule folds activations into a fixed 8 B/param, but they grow with b·s·layers·h, "
                      "not with the parameter count",
                      num(psi), format_bytes(rule), format_bytes(ours), format_bytes(states), states / psi, format_bytes(act), act / psi,
                      100.0 * (rule - ours) / ours),
          "rule of thumb (accelerate's 'Training using Adam' 4x, plus activations)", Place::Info, Basis::Formula};
}

}  // namespace llmq::mem
