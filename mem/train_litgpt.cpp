// `llmq-mem train --framework litgpt`: LitGPT's fine-tuning scripts (finetune/full.py, lora.py;
// `--precision bf16-true`), what torch.cuda.max_memory_allocated() reports, tensor by tensor.
//
// The model follows the code, not a closed form: the tensors autograd keeps for the backward of
// a LitGPT Block, per block, T = micro_batch x seq tokens, e bytes per activation (2 for bf16).
// 2024 (litgpt/model.py at 00af8b0d, Sep 2024; counted in litgpt 0.5.13 by bench/litgpt_saved.py
// on the CPU and on an H200, byte for byte; block_saved_2024):
//   norm (RMSNorm)         x in fp32, rsqrt per token, the weight's fp32 copy: 4·T·h + 4·T + 4·h,
//                          and x·rsqrt in fp32 (4·T·h) when the weight is trained
//   a Linear               its input (e·T·in) only when its weight is trained: PyTorch keeps a
//                          matmul operand only for the other operand's gradient. Under LoRA the
//                          branch keeps the dropout's mask and output and lora_A's output
//                          ((1 + e)·T·in + e·T·r); LoRA on some of q, k, v also lora_B's
//                          padded output and its index
//   attention (SDPA)       q, k, v, output and the fp32 log-sum-exp per head; GQA/MQA repeat k and v
//                          to the query heads (e·T·q each); MHA's v is a view of the qkv output,
//                          which stays whole: e·T·(3q + 3kv)
//   MLP                    gated: fc_1, fc_2 and the activation's outputs (3·e·T·H), their product
//                          as a trained down projection's input; GELU: fc's output
//   QLoRA                  bitsandbytes 0.42's MatMul4Bit keeps each 4-bit Linear's input; the
//                          model counts them twice (block_saved_2024 says why: the loop's logits)
// 2023 (lit_gpt/model.py and lora.py at 8641822, Oct 2023; not counted by a lab, fitted to the
// lit-gpt resource tables within 4%): every Linear's input as if trained, RMSNorm x and
// x·rsqrt(mean x²) in the input dtype (2·e·T·h), SDPA's q, k, v and output (k, v expanded for
// GQA, one head for MQA), the MLP's input and 4·e·T·H (gated) or 2·e·T·H (GELU), LoRA dropout's
// mask and output ((1 + e)·T·in). Gemma 2 (either): two more norms per block and, without SDPA,
// per score tanh's output, the fp32 softmax and its cast.
// The head: the final norm, lm_head's input e·T·h (2024: as any Linear; a frozen 4-bit lm_head
// keeps it), the logits in chunks of 128 tokens and their
// log-softmax for the chunked cross-entropy: 2·e·T·V; a trained lm_head sums its chunks' V x h
// gradients as they come (2·e·V·h at once). FSDP (FULL_SHARD, Blocks auto-wrapped): the root unit
// (embedding, lm_head, final norm) stays unsharded from its forward to its post-backward, and a
// trained root holds its unsharded gradient through the backward.
#include "mem/train.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "base/error.h"

namespace llmq::mem {

namespace {

constexpr const char* kLit = "LitGPT lit_gpt/model.py, lora.py (8641822) and litgpt/model.py (00af8b0d); PyTorch autograd saved tensors";
constexpr const char* kBnb = "bitsandbytes Linear4bit / MatMul4Bit (NF4 blocks of 64; paged optimizers in CUDA managed memory)";
constexpr const char* kFsdp = "Lightning FSDPStrategy.load_checkpoint: a full (unsharded) state dict on every rank";
constexpr const char* kFsdpRoot =
    "PyTorch torch/distributed/fsdp/_runtime_utils.py _post_forward_reshard: FULL_SHARD does not free the root's parameters after forward";
constexpr const char* kFsdpSync =
    "PyTorch FSDP docs (no_sync: full gradients accumulated until the sync; use_orig_params with mixed frozen parameters: gradient memory as if "
    "none were frozen; BackwardPrefetch.BACKWARD_PRE), Lightning FSDPStrategy (use_orig_params=True), litgpt issue #1417";

// A LitGPT block recipe (litgpt/config.py: norm_class, mlp_class, parallel_residual,
// shared_attention_norm).
struct Block {
  bool rms = true;            // RMSNorm, else LayerNorm
  bool gated = true;          // LLaMAMLP / GemmaMLP, else GptNeoxMLP
  bool parallel = false;      // x + attn(n_1) + mlp(n_2)
  bool shared_norm = false;   // the MLP reads n_1
  bool softcap = false;       // Gemma 2: post-attention and post-MLP norms, softcapped attention scores
                              // (no SDPA: the score matrices are kept) and softcapped logits
};

Block block_of(const std::string& name) {
  if (name == "llama" || name == "gemma" || name == "phi3" || name == "mistral" || name == "qwen2") return {};
  if (name == "gemma2") return {true, true, false, false, true};
  if (name == "gpt-neox") return {false, false, true, false};
  if (name == "phi" || name == "falcon") return {false, false, true, true};
  throw UsageError("unknown --block '" + name + "' (llama, gemma, gemma2, phi3, mistral, qwen2, gpt-neox, phi, falcon)");
}

struct Saved {
  double bytes = 0;
  std::string formula;
};

// What one norm keeps for T tokens (bytes). LayerNorm: its input (mean and rstd are per token).
// RMSNorm 2023: x and x·rsqrt(mean x²) in the input dtype. RMSNorm 2024 (x.float() first;
// counted by bench/litgpt_saved.py): x in fp32, the rsqrt per token and the weight's fp32 copy,
// and x·rsqrt in fp32 only when the weight is trained (full fine-tuning; LoRA freezes norms).
double norm_saved(const ModelShape& m, const TrainOptions& o, const Block& B, double T) {
  const double e = o.precision == Precision::FP32 ? 4 : 2, h = double(m.dim);
  if (!B.rms) return e * T * h;
  if (o.litgpt_version < 2024) return 2 * e * T * h;
  return 4 * T * h + 4 * T + 4 * h + (o.lora_rank > 0 ? 0 : 4 * T * h);
}

// Whether LoRA adapts any of `targets` (lora_targets_include for a group of matrices).
bool any_target(const TrainOptions& o, std::initializer_list<const char*> targets) {
  return std::any_of(targets.begin(), targets.end(), [&](const char* t) { return lora_targets_include(o, t); });
}

// QLoRA: what bitsandbytes 0.42.0, the version LitGPT pins (litgpt/finetune/lora.py refuses
// others), adds to a block's saved tensors. Its MatMul4Bit keeps each 4-bit Linear's input A for
// the backward (`ctx.tensors = (A, B)` when A needs a gradient; 0.43.2 keeps only B,
// bitsandbytes#1270), so the inputs of qkv (h), proj (q), the MLP's first Linear(s) (h; one
// tensor with qkv's under a shared norm) and its last (H) stay alive, bytes e·T each, unless
// LoRA already saves that input: a LoRA branch without dropout multiplies the input itself (with
// dropout, the dropout's output). bench/litgpt_saved.py --lora-all counts e·T·(2h + q + H) on
// LoRA with dropout on every Linear, e·T·(h + q + H) with a shared norm, 0 without dropout.
double qlora_kept_inputs(const ModelShape& m, const TrainOptions& o, const Block& B, double T, double e) {
  if (!o.qlora) return 0;
  const double h = double(m.dim), q = double(m.q_dim()), H = double(m.hidden);
  auto kept = [&](std::initializer_list<const char*> targets) {  // no LoRA branch that saves the Linear's own input
    return o.lora_dropout > 0 || !any_target(o, targets);
  };
  const bool x1 = kept({"q", "k", "v"}), x2 = kept({"gate", "up"});
  const double norms_out = B.shared_norm ? (x1 && x2 ? h : 0) : (x1 ? h : 0) + (x2 ? h : 0);
  return e * T * (norms_out + (kept({"o"}) ? q : 0) + (kept({"down"}) ? H : 0));
}

// What one Linear of input width `in` keeps for its backward, 2024 code (bytes for T tokens):
// its input when its weight is trained (full fine-tuning); a frozen one nothing, unless LoRA
// adapts it: then the branch keeps the dropout's bool mask and output (the input itself without
// dropout) for lora_A's gradient and lora_A's output (r wide) for lora_B's. `rows`: the LoRA
// branches on that input (the fused qkv Linear: one per adapted matrix, all fed the same input).
double linear_kept(const TrainOptions& o, bool adapted, double in, double T, double e, double rows = 1) {
  if (o.lora_rank == 0) return e * T * in;
  if (!adapted) return 0;
  return (o.lora_dropout > 0 ? T * in : 0) + e * T * in + e * T * double(o.lora_rank) * rows;
}

// One block's saved activations (bytes) for T tokens, 2024 code (litgpt 0.5; every term is a
// storage bench/litgpt_saved.py lists, on the CPU and on an H200, and the sums equal its counts
// for full fine-tuning, LoRA on q and v, and LoRA on every Linear; bench/RESULTS.md).
Saved block_saved_2024(const ModelShape& m, const TrainOptions& o, const Block& B, double T) {
  const double e = o.precision == Precision::FP32 ? 4 : 2, h = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_dim());
  const double H = double(m.hidden), heads = double(m.heads);
  const bool full = o.lora_rank == 0, lmlp = !full && any_target(o, {"gate", "up", "down"});
  const double norm = norm_saved(m, o, B, T);
  // qkv: one Linear; LoRA on some of q, k, v pads lora_B's output back to the full width
  // (index_copy_), which keeps it and its int64 index: e·T·w + 8·w for the adapted widths w.
  const double nq = lora_targets_include(o, "q"), nk = lora_targets_include(o, "k"), nv = lora_targets_include(o, "v");
  const double w = nq * q + (nk + nv) * kv, padded = (nq + nk + nv > 0 && nq + nk + nv < 3) ? (e * T + 8) * w : 0;
  const double qkv = linear_kept(o, nq + nk + nv > 0, h, T, e, nq + nk + nv) + padded;
  // SDPA keeps q, k, v, its output and the per-head log-sum-exp (fp32). GQA/MQA repeat k and v
  // to the query heads (copies, q wide); MHA's v is a view of the qkv output, whose whole storage
  // stays alive. Gemma 2's softcapped attention (no SDPA) keeps q, the repeated k and v, and per
  // score tanh's output (e), the fp32 softmax (4) and its cast (e).
  const bool gqa = m.kv_heads != m.heads;
  const double scores = double(o.micro_batch) * heads * double(o.seq_len) * double(o.seq_len);
  const double core = B.softcap ? e * T * (q + 2 * (gqa ? q : kv)) + scores * (2 * e + 4)
                      : gqa     ? e * T * 4 * q + 4 * heads * T
                                : e * T * (3 * q + 3 * kv) + 4 * heads * T;
  const double proj = linear_kept(o, lora_targets_include(o, "o"), q, T, e);
  // MLP: SwiGLU/GeGLU keep fc_1's and fc_2's outputs and the activation's (the product only for a
  // trained or adapted down projection, as its input); GELU keeps fc's output (the activation's
  // for the projection).
  // LoRA on a gated MLP: fc_1 and fc_2 each have their dropout; without dropout both branches
  // keep the one input.
  const double in_lora = B.gated ? 2 * linear_kept(o, lmlp, h, T, e) - (lmlp && o.lora_dropout <= 0 ? e * T * h : 0) : linear_kept(o, lmlp, h, T, e);
  const double in_mlp = full ? (B.shared_norm ? 0 : e * T * h) : in_lora;
  const double mlp = in_mlp + (B.gated ? 3 : 1) * e * T * H + linear_kept(o, lmlp, H, T, e);
  const double n2 = (B.shared_norm ? 0 : norm) + (B.softcap ? 2 * norm : 0);
  // QLoRA: the 4-bit Linears' inputs twice. MatMul4Bit (bitsandbytes 0.42) keeps each input as
  // a Python attribute of its node, which autograd does not free after the node's backward, and
  // LitGPT's loop holds the last micro-batch's logits (so its whole graph) until the next forward
  // returns: at a forward's end the previous micro-batch's inputs are alive beside this one's.
  // bench/litgpt_peak.py --meta replays the config hub's 14 QLoRA rows so within -5.0..+0.4%.
  const double kept = 2 * qlora_kept_inputs(m, o, B, T, e);
  Saved s;
  s.bytes = norm + qkv + core + proj + n2 + mlp + kept;
  s.formula = fmt::format("norms {} + qkv {} + SDPA {} ({}) + proj {} + MLP {}{}; T={} e={}", format_bytes(norm + n2), format_bytes(qkv),
                          format_bytes(core), gqa ? "k, v repeated to the query heads" : "q, k, the qkv output, out",
                          format_bytes(proj), format_bytes(mlp),
                          kept > 0 ? fmt::format(" + the 4-bit Linears' inputs, twice {}", format_bytes(kept)) : "", T, e);
  return s;
}

// One block's saved activations (bytes) for T tokens: 2024 code above, 2023 code here (every
// Linear's input counted; k and v expanded for GQA, not for MQA).
Saved block_saved(const ModelShape& m, const TrainOptions& o, const Block& B, double T) {
  if (o.litgpt_version >= 2024) return block_saved_2024(m, o, B, T);
  const double e = o.precision == Precision::FP32 ? 4 : 2, h = double(m.dim), q = double(m.q_dim()), H = double(m.hidden);
  const bool expand = m.kv_heads != 1;
  const double kv = expand ? q : double(m.kv_dim());
  const double norm = norm_saved(m, o, B, T);
  const bool lora = o.lora_rank > 0, drop = lora && o.lora_dropout > 0;
  auto lora_in = [&](bool on, double in) { return drop && on ? (1 + e) * T * in : 0.0; };
  const bool lq = any_target(o, {"q", "k", "v"}), lmlp = any_target(o, {"gate", "up", "down"});
  // SDPA keeps q, k, v and its output; Gemma 2's softcapped attention keeps q, k, v (the two
  // matmuls' inputs) and per score tanh's output (e), the fp32 softmax (4) and its cast (e).
  const double b = double(o.micro_batch), sq = double(o.seq_len);
  const double core = B.softcap ? e * T * (q + 2 * kv) + b * double(m.heads) * sq * sq * (2 * e + 4) : e * T * (2 * q + 2 * kv);
  const double attn = e * T * h + lora_in(lq, h) + core + e * T * q + lora_in(lora_targets_include(o, "o"), q);
  const double n2 = (B.shared_norm ? 0 : norm + e * T * h) + (B.softcap ? 2 * norm : 0);  // + post-attention, post-MLP norms
  const double mlp = (B.gated ? 4 : 2) * e * T * H + (B.gated ? 2 : 1) * lora_in(lmlp, h) + lora_in(lmlp, H);
  const double kept = qlora_kept_inputs(m, o, B, T, e);
  Saved s;
  s.bytes = norm + attn + n2 + mlp + kept;
  s.formula = fmt::format("norm {} + attention {} (qkv input, SDPA q/k/v/out{}, proj input{}) + {}MLP {} ({}){}; T={} e={}",
                          format_bytes(norm), format_bytes(attn), expand && m.kv_heads != m.heads ? " with k/v expanded to the query heads" : "",
                          lq ? ", LoRA dropout" : "", B.shared_norm ? "" : fmt::format("norm_2 + MLP input {} + ", format_bytes(n2)),
                          format_bytes(mlp), B.gated ? "4 tensors of [T, H]" : "2 tensors of [T, H]",
                          kept > 0 ? fmt::format(" + the 4-bit Linears' kept inputs {}", format_bytes(kept)) : "", T, e);
  return s;
}

// Parameters of the transformer Blocks (FSDP's auto-wrapped units).
double block_params_of(const ModelShape& m) { return double(m.layers) * double(m.layer_params()); }

// Bytes per parameter of a frozen Linear under QLoRA (bitsandbytes NF4): 4 bits + the absmax
// of each block of 64 (fp32; double quantization: 8 bits + an fp32 per 256 of them).
double nf4_bytes(bool double_quant) { return double_quant ? 0.5 + 1.0 / 64 + 4.0 / (64 * 256) : 0.5 + 4.0 / 64; }

// The sizes litgpt_estimate's lines share.
struct LitSizes {
  double e = 2, T = 0;             // bytes per value; tokens per micro-batch
  double h = 0, V = 0, P = 0;      // width, vocabulary, parameters (lm_head never tied)
  double N = 1, shard = 1;         // ranks; N under FSDP, else 1
  double trainable = 0;            // LoRA adapters, or every parameter
  bool lora = false, fsdp = false;
  bool head_lora = false;          // LoRA on lm_head ("head"; "all" is the blocks' Linears)
};

// LitSizes for m and o (the trainable count throws UsageError for an unknown LoRA target).
LitSizes lit_sizes(const ModelShape& m, const TrainOptions& o) {
  LitSizes z;
  z.e = o.precision == Precision::FP32 ? 4 : 2, z.T = double(o.micro_batch) * double(o.seq_len);
  // LitGPT never ties the output layer to the embedding: its converter copies a tied model's
  // embedding into lm_head.weight (litgpt/scripts/convert_hf_checkpoint.py) and GPT keeps both
  // (litgpt/model.py: an nn.Embedding and an nn.Linear), so a tied model holds V·h more.
  const double h = double(m.dim), V = double(m.vocab), P = double(m.params()) + (m.tied ? V * h : 0), N = o.dp;
  z.h = h, z.V = V, z.P = P, z.N = N;
  z.lora = o.lora_rank > 0, z.fsdp = o.dp > 1;
  z.head_lora = z.lora && std::count(o.lora_targets.begin(), o.lora_targets.end(), "head") > 0;
  z.trainable = z.lora ? double(m.layers) * lora_layer_params_of(m, o) + (z.head_lora ? double(o.lora_rank) * (h + V) : 0) : P;
  z.shard = z.fsdp ? N : 1;
  return z;
}

// The parameter lines (bytes per GPU, / N under FSDP): the frozen base (NF4 Linear layers under
// QLoRA) and the LoRA adapters, or every parameter.
void add_lit_parameters(MemReport& r, const ModelShape& m, const TrainOptions& o, const LitSizes& z) {
  const double e = z.e, h = z.h, V = z.V, P = z.P, shard = z.shard, trainable = z.trainable;
  const bool lora = z.lora, fsdp = z.fsdp;
  const double linear = double(m.layers) * double(m.layer_linear_params()) + V * h;  // the blocks' and lm_head
  const double frozen = lora ? (o.qlora ? nf4_bytes(o.double_quant) * linear + e * (P - linear) : e * P) : 0;
  if (lora)
    r.lines.push_back({o.qlora ? "parameters (frozen base, NF4 Linear layers)" : "parameters (frozen base)", frozen / shard,
                       o.qlora ? fmt::format("{:.4f} B x {} Linear params + {} B x {} others", nf4_bytes(o.double_quant), num_str(linear), e,
                                             num_str(P - linear))
                               : fmt::format("{} B x {}", e, num_str(P)),
                       o.qlora ? kBnb : kLit, Place::Device, Basis::Formula});
  r.lines.push_back({lora ? "parameters (LoRA adapters)" : "parameters", e * trainable / shard,
                     fmt::format("{} B x {}{}", e, num_str(trainable), fsdp ? " / N (FSDP shard)" : ""), kLit, Place::Device, Basis::Formula});
}

// The gradient lines (bytes per GPU): kept across micro-batches, FSDP's unsharded or sharded
// ones, and FSDP's root unit (its parameters and a trained root's gradient, unsharded).
void add_lit_gradients(MemReport& r, const ModelShape& m, const TrainOptions& o, const LitSizes& z) {
  const double e = z.e, P = z.P, N = z.N, shard = z.shard, trainable = z.trainable;
  const bool lora = z.lora, fsdp = z.fsdp;
  // Gradients exist at the forward's end when gradient accumulation keeps them between micro-batches.
  // FSDP accumulating: LitGPT's backward runs under fabric.no_backward_sync, i.e. FSDP.no_sync,
  // which keeps full (unsharded) gradients until the synchronizing micro-batch; and with
  // Lightning's use_orig_params=True one FlatParameter per Block holds the frozen weights beside
  // the LoRA ones, so it requires grad as a whole: a LoRA run keeps unsharded gradients of every
  // block parameter, frozen or not.
  const double block_params = block_params_of(m);
  const bool fsdp_accum = fsdp && o.grad_accum > 1;
  if (fsdp_accum)
    r.lines.push_back({"gradients (FSDP no_sync: unsharded, every parameter of a Block unit)", e * (lora ? block_params : P),
                       fmt::format("{} B x {} ({}), kept across {} micro-batches", e, num_str(lora ? block_params : P),
                                   lora ? "the blocks' parameters: frozen ones share the LoRA weights' FlatParameter" : "every parameter",
                                   o.grad_accum),
                       kFsdpSync, Place::Device, Basis::Formula});
  else if (o.grad_accum > 1 || lora)
    r.lines.push_back({"gradients", e * trainable / shard, fmt::format("{} B x trainable (kept across {} micro-batches)", e, o.grad_accum),
                       kLit, Place::Device, Basis::Formula});
  else if (fsdp)  // full fine-tuning, every step synchronized: the shards, complete at the backward's end (Blocks recomputed one at a time)
    r.lines.push_back({"gradients (sharded)", e * P / N, fmt::format("{} B x {} / N", e, num_str(P)), kFsdpSync, Place::Device, Basis::Formula});
  // FSDP's root unit (what no Block holds: the embedding, lm_head, the final norm) keeps its
  // parameters unsharded from its forward to its post-backward under FULL_SHARD; a trained root
  // also holds its unsharded gradient through the backward (lm_head's comes first, the
  // embedding's last) unless no_sync already keeps every gradient unsharded.
  const double root = P - block_params_of(m);
  if (fsdp) {
    r.lines.push_back({"FSDP root unit unsharded (embedding, lm_head, final norm)", e * root,
                       fmt::format("{} params outside the Blocks, whole on every rank from forward to backward", num_str(root)), kFsdpRoot,
                       Place::Device, Basis::Formula});
    if (!lora && !fsdp_accum)
      r.lines.push_back({"FSDP root unit's unsharded gradient", e * root, fmt::format("{} B x {}", e, num_str(root)), kFsdpRoot, Place::Device,
                         Basis::Formula});
  }
}

// The optimizer states line (bytes per GPU, / N under FSDP): AdamW's two moments or 8-bit AdamW's
// states in torch's count, or bitsandbytes' paged states outside it (QLoRA).
void add_lit_optimizer(MemReport& r, const TrainOptions& o, const LitSizes& z) {
  const double e = z.e, shard = z.shard, trainable = z.trainable;
  const bool paged = o.qlora;  // lit-gpt uses bnb.optim.PagedAdamW with --quantize: managed memory, not torch's
  const double state = o.optimizer == Optimizer::Adam8bit ? 2 + 8.0 / 2048 : o.optimizer == Optimizer::SGD ? 0 : 2 * e;
  r.lines.push_back({paged ? "optimizer states (paged: CUDA managed memory, outside torch's count)" : "optimizer states",
                     paged ? 0 : state * trainable / shard,
                     paged ? "bnb.optim.PagedAdamW allocates its states with cudaMallocManaged" : fmt::format("AdamW exp_avg + exp_avg_sq in the parameters' dtype: {} B x trainable", state),
                     paged ? kBnb : kLit, Place::Device, Basis::Formula});
}

// The activation lines (bytes): the blocks' saved tensors (or the checkpointed inputs and one
// recomputed block), the head's, and the temporaries of a trained lm_head and of QLoRA.
void add_lit_activations(MemReport& r, const ModelShape& m, const TrainOptions& o, const Block& B, const LitSizes& z) {
  const double e = z.e, T = z.T, h = z.h, V = z.V;
  const Saved blk = block_saved(m, o, B, T);
  const bool ckpt = o.checkpointing == Checkpointing::Full;
  const double norm_f = norm_saved(m, o, B, T);
  if (ckpt) {
    r.lines.push_back({"activations (checkpointed block inputs)", double(m.layers) * e * T * h,
                       fmt::format("{} layers x e·T·h (each Block recomputed in its backward)", m.layers), kLit, Place::Device, Basis::Formula});
    r.lines.push_back({"activations (one block recomputed)", blk.bytes, blk.formula, kLit, Place::Device, Basis::Formula});
  } else {
    r.lines.push_back({"activations (blocks)", double(m.layers) * blk.bytes, fmt::format("{} layers x ({})", m.layers, blk.formula), kLit,
                       Place::Device, Basis::Formula});
  }
  const double logit_copies = B.softcap ? 3 : 2;  // Gemma 2: tanh keeps the softcapped logits too
  // lm_head's input: 2023 code counts it always; 2024 as any Linear (linear_kept), and a frozen
  // 4-bit lm_head (QLoRA) keeps it in MatMul4Bit unless its LoRA branch holds that very tensor.
  const bool head = z.head_lora;
  const double head_in = o.litgpt_version < 2024 ? e * T * h
                                                 : linear_kept(o, head, h, T, e) + (o.qlora && (o.lora_dropout > 0 || !head) ? e * T * h : 0);
  r.lines.push_back({"activations (head: norm, lm_head input, chunked logits and log-softmax)", norm_f + head_in + logit_copies * e * T * V,
                     fmt::format("norm + lm_head input {} + {}·e·T·V (lm_head in chunks of 128 tokens, cross-entropy per chunk{}), V = {}",
                                 format_bytes(head_in), logit_copies, B.softcap ? ", tanh's softcapped logits" : "", m.vocab),
                     kLit, Place::Device, Basis::Formula});
  if (!z.lora && T > 128)  // a trained lm_head: each chunk's V x h gradient added to the sum of the ones before
    r.lines.push_back({"temporary: lm_head's gradient summed over its chunks", 2 * e * V * h,
                       "2 x e·V·h: the running sum and the next chunk's (autograd adds a leaf's gradients as they come)", kLit,
                       Place::Device, Basis::Formula});
  if (o.qlora) {
    const double mat = double(std::max({m.dim * m.hidden, m.dim * (m.q_dim() + 2 * m.kv_dim()), m.vocab * m.dim}));
    // MatMul4Bit: dequantize_4bit(B) in the weight's original dtype (fp16: Lightning quantizes a .half() copy),
    // then .to(A.dtype): two 16-bit copies of the matrix while it is multiplied.
    r.lines.push_back({"temporary: a dequantized NF4 matrix", 2 * 2 * mat,
                       fmt::format("2 x 2 B x the largest Linear ({}): the fp16 dequantized weight and its bf16 cast", num_str(mat)), kBnb,
                       Place::Device, Basis::Formula});
  }
}

// FSDP's lines after everything else (bytes): two Blocks all-gathered, and the load's peak above
// the device lines so far.
void add_lit_fsdp(MemReport& r, const ModelShape& m, const LitSizes& z) {
  const double e = z.e, P = z.P, N = z.N;
  if (z.fsdp)  // FULL_SHARD: the unit being recomputed and run backward, and the next one prefetched (BACKWARD_PRE)
    r.lines.push_back({"FSDP: two Blocks' parameters all-gathered", 2 * e * double(m.layer_params()),
                       fmt::format("2 x {} B x {} (one Block)", e, num_str(double(m.layer_params()))), kFsdpSync, Place::Device, Basis::Formula});
  if (z.fsdp) {  // the load: the checkpoint as a full state dict on every rank beside the shards
    const double states = r.total(Place::Device);
    const double load = e * P + e * P / N;
    if (load > states)
      r.lines.push_back({"load peak above training (full state dict on every rank)", load - states,
                         fmt::format("e·Ψ (unsharded checkpoint) + e·Ψ/N (the shards) = {}", format_bytes(load)), kFsdp, Place::Device,
                         Basis::Formula});
  }
}

}  // namespace

MemReport litgpt_estimate(const ModelShape& m, const TrainOptions& o) {
  if (o.tp != 1 || o.pp != 1 || o.offload_optimizer != Offload::None || o.offload_params != Offload::None ||
      o.checkpointing == Checkpointing::Selective || o.precision == Precision::Mixed || o.precision == Precision::Amp)
    throw UsageError("--framework litgpt models LitGPT's finetune scripts with bf16-true or 32-true precision on one GPU or FSDP "
                     "(--fsdp full): no TP/PP, offload, selective checkpointing or mixed precision");
  if (o.qlora && o.dp > 1)  // finetune/lora.py, lit-gpt 8641822 and litgpt 00af8b0d alike
    throw UsageError("--framework litgpt: LitGPT refuses --quantize with more than one device (\"Quantization is currently not "
                     "supported for multi-GPU training\"); use --framework analytic for FSDP + QLoRA");
  if (o.optimizer == Optimizer::Adafactor || o.optimizer == Optimizer::SGDMomentum)
    throw UsageError("--framework litgpt models AdamW, 8-bit AdamW and SGD (the optimizers of LitGPT's recipes)");
  const Block B = block_of(o.block);
  const LitSizes z = lit_sizes(m, o);
  MemReport r;
  r.device = "gpu 0";

  // Model states. LoRA adapters (trainable), or every parameter (full fine-tuning).
  add_lit_parameters(r, m, o, z);
  add_lit_gradients(r, m, o, z);
  add_lit_optimizer(r, o, z);

  // Activations.
  add_lit_activations(r, m, o, B, z);
  add_lit_fsdp(r, m, z);
  add_torch_cuda_lines(r, o.gpu, 2, o.cuda_context_bytes, o.cuda_context_given);
  r.notes.push_back(fmt::format("LitGPT block '{}' ({}, {} MLP, {} residual{}), code of {}", o.block, B.rms ? "RMSNorm" : "LayerNorm",
                                B.gated ? "gated" : "GELU", B.parallel ? "parallel" : "sequential", B.shared_norm ? ", shared norm" : "",
                                o.litgpt_version >= 2024 ? "litgpt 2024 (00af8b0d)" : "lit-gpt 2023 (8641822)"));
  r.notes.push_back("the device total minus gpu-other lines is what torch.cuda.max_memory_allocated() reports (LitGPT prints it as 'Memory used')");
  return r;
}

}  // namespace llmq::mem
