#include "mem/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "base/error.h"
#include "mem/train.h"

namespace llmq::mem {

namespace {

constexpr const char* kBnb = "bitsandbytes: LLM.int8 (Dettmers et al. 2022, arXiv 2208.07339: int8 rows + an fp32 scale per row), "
                             "Linear4bit (NF4/FP4 blocks of 64, fp32 absmax; double quantization 8-bit absmax + fp32 per 256)";
constexpr const char* kHf = "transformers generate (before 4.45: logits of every prompt position in fp32), LitGPT generate/base.py, torchtune "
                            "generate.py (a static KV cache of max_seq_len)";
constexpr const char* kHfLogits = "transformers generation/utils.py (4.45: num_logits_to_keep = 1 when the model's forward takes it) and "
                                  "models/*/modeling_*.py of the released wheels 4.44.2-5.0.0";

int version_code(const std::string& v) { return release_code(v, "--transformers-version"); }

// The first release whose forward for `model_type` takes num_logits_to_keep / logits_to_keep
// (read in the wheels' models/*/modeling_*.py): 4.45 for the families listed first, later for a
// few, 5.0 for every other model.
int last_logits_since(const std::string& model_type) {
  static const std::map<std::string, int> since = {
      {"llama", 4045}, {"mistral", 4045}, {"mixtral", 4045},  {"qwen2", 4045},  {"qwen2_moe", 4045},   {"gemma", 4045},
      {"gemma2", 4045}, {"phi", 4045},    {"phi3", 4045},     {"stablelm", 4045}, {"starcoder2", 4045}, {"cohere", 4045},
      {"olmo", 4045},  {"olmoe", 4045},   {"falcon", 4047},   {"gpt_neox", 4049}, {"gemma3", 4050},     {"gemma3_text", 4050},
      {"qwen3", 4051}, {"gpt2", 4053}};
  const auto it = since.find(model_type);
  return it == since.end() ? 5000 : it->second;
}

// Bytes per logit value when the prefill computes every prompt position's logits (measured on the
// CPU with the 4.44.2, 4.45.0 and 5.17.0 wheels, bench/RESULTS.md): the 16-bit lm_head output; before
// 4.45 the Llama-family forwards (the families below) also upcast it to fp32; in 4.45-4.46 generate
// copies the whole tensor before taking the last position (outputs.logits.clone()[:, -1, :]).
double all_logits_bytes(int version, const std::string& model_type) {
  static const std::set<std::string> upcast = {"llama", "mistral", "mixtral", "qwen2",      "qwen2_moe", "gemma",
                                               "gemma2", "phi",    "phi3",    "starcoder2", "cohere",    "olmo"};
  if (version < 4045) return upcast.count(model_type) ? 2 + 4 : 2;
  return version < 4047 ? 2 + 2 : 2;
}

// Bytes per parameter of a Linear layer's weight in `format`, with `rows` output rows.
double linear_bytes(const std::string& format, double params, double rows) {
  if (format == "bf16" || format == "fp16") return 2 * params;
  if (format == "int8") return params + 4 * rows;
  if (format == "nf4" || format == "fp4") return params * (0.5 + 4.0 / 64);
  if (format == "nf4-dq") return params * (0.5 + 1.0 / 64 + 4.0 / (64 * 256));
  throw UsageError("unknown --weights '" + format + "' (bf16, fp16, int8, nf4, nf4-dq, fp4)");
}

// UsageError unless the framework is known and the batch, prompt and lengths are in range.
void check_generate_options(const GenerateOptions& o) {
  if (o.framework != "transformers" && o.framework != "litgpt" && o.framework != "torchtune")
    throw UsageError("--framework must be transformers, litgpt or torchtune for generate");
  if (o.batch < 1 || o.prompt < 1 || o.new_tokens < 0 || o.kv_len < 0) throw UsageError("batch and prompt must be >= 1");
  version_code(o.transformers_version);  // throws for a malformed --transformers-version
}

// The line "prefill transients" (bytes): the peak of the prefill beyond the weights and the KV cache.
void add_prefill_transients(MemReport& r, const ModelShape& m, const GenerateOptions& o, bool quant, bool head_quant) {
  const double h = double(m.dim), V = double(m.vocab), b = double(o.batch), P = double(o.prompt);
  // The prefill's transients: the logits (transformers before 4.45, and for some models until 5.0:
  // every prompt position's, all_logits_bytes a value; else the last position's) or eager attention's
  // scores of one layer, whichever is larger (a layer's scores are freed before the next layer,
  // so never live with the logits), a dequantized matrix.
  double t = b * V * 4;
  std::string tf = "the last position's logits, fp32";
  const int version = version_code(o.transformers_version);
  if (o.framework == "transformers" && version < last_logits_since(m.model_type)) {
    const double e = all_logits_bytes(version, m.model_type);
    t = b * P * V * e;
    tf = fmt::format("logits [b, prompt, V], {} B a value (transformers {}, model_type '{}': {})", e, o.transformers_version, m.model_type,
                     e == 6 ? "16-bit and the forward's fp32 upcast" : e == 4 ? "16-bit and generate's copy of the whole tensor" : "16-bit");
  } else if (o.framework == "transformers") {
    t = b * V * (2 + 4 + 4);
    tf = fmt::format("the last position's logits in 16 bits, fp32 and generate's fp32 copy (transformers {}, model_type '{}')",
                     o.transformers_version, m.model_type);
  }
  if (!o.flash) {
    const double scores = b * double(m.heads) * P * P * (2 + 4);
    tf = fmt::format("the larger of {} ({}) and one layer's eager attention scores [b, heads, prompt, prompt], 16-bit and the fp32 "
                     "softmax ({})", tf, format_bytes(t), format_bytes(scores));
    t = std::max(t, scores);
  }
  if (quant && o.weights != "int8") {
    const double big = std::max({h * double(m.hidden), h * double(m.q_dim() + 2 * m.kv_dim()), head_quant ? V * h : 0.0});
    // LitGPT (Lightning's BitsandbytesPrecision) creates each Linear on the GPU in the default dtype and
    // quantizes it there from a .half() copy: two 16-bit copies of the largest matrix at once. In the
    // forward, MatMul4Bit dequantizes one matrix at a time (transformers: in the compute dtype).
    const double copies = o.framework == "litgpt" ? 2 : 1;
    t += copies * o.compute_bytes * big;
    tf += fmt::format(" + the largest Linear in {} B x {}{}", o.compute_bytes, num_str(big),
                      copies > 1 ? " twice (quantized on load: the checkpoint's tensor and its copy)" : " (dequantized)");
  }
  t += b * P * (2 * h + 2 * double(m.hidden)) * 2;
  tf += " + the prefill's activations of one layer";
  r.lines.push_back({"prefill transients", t, tf, o.framework == "transformers" ? kHfLogits : kHf, Place::Device, Basis::Formula});
}

}  // namespace

bool last_position_logits(const std::string& version, const std::string& model_type) {
  return version_code(version) >= last_logits_since(model_type);
}

MemReport estimate_generate(const ModelShape& m, const GenerateOptions& o) {
  m.validate();
  check_generate_options(o);
  const double h = double(m.dim), V = double(m.vocab), b = double(o.batch);
  const bool quant = o.weights != "bf16" && o.weights != "fp16";
  // Linear layers of the blocks, and the output layer: bitsandbytes in LitGPT converts every Linear
  // (Lightning's BitsandbytesPrecision), transformers keeps the output embedding in 16 bits.
  const double rows_per_layer = double(m.q_dim() + 2 * m.kv_dim()) + h + double(m.mlp == Mlp::SwiGLU ? 2 : 1) * double(m.hidden) + h;
  // LitGPT never ties lm_head to the embedding (its converter copies a tied model's embedding into
  // lm_head.weight; GPT keeps both), so a tied model holds V·h more there.
  const bool litgpt = o.framework == "litgpt", head_quant = quant && litgpt;
  const double lin = double(m.layers) * double(m.layer_linear_params()) + (head_quant ? V * h : 0);
  const double lin_rows = double(m.layers) * rows_per_layer + (head_quant ? V : 0);
  const double rest = double(m.params()) + (litgpt && m.tied ? V * h : 0) - lin;
  MemReport r;
  r.device = "gpu 0";
  r.title = fmt::format("{}: generate with {} ({} weights), batch {}, prompt {}, {} new tokens", m.name, o.framework, o.weights, o.batch,
                        o.prompt, o.new_tokens);
  r.lines.push_back({"weights: Linear layers", linear_bytes(o.weights, lin, lin_rows),
                     fmt::format("{} params of the blocks' Linear layers{} in {}", num_str(lin), head_quant ? " and the output" : "", o.weights),
                     quant ? kBnb : kHf, Place::Device, Basis::Formula});
  r.lines.push_back({"weights: embeddings, norms, 16-bit rest", 2 * rest, fmt::format("2 B x {}", num_str(rest)), kHf, Place::Device,
                     Basis::Formula});
  // KV cache: LitGPT 2023 keeps n_head heads for GQA (one for MQA); the others n_kv_heads.
  const double kv_len = double(o.kv_len > 0 ? o.kv_len : o.prompt + o.new_tokens);
  const double kv_dim = o.framework == "litgpt" && m.kv_heads != 1 ? double(m.q_dim()) : double(m.kv_dim());
  r.lines.push_back({"KV cache", 2 * double(m.layers) * b * kv_len * kv_dim * 2,
                     fmt::format("2 (K,V) x {} layers x b {} x {} positions x {} x 2 B", m.layers, o.batch, kv_len, kv_dim), kHf, Place::Device,
                     Basis::Formula});
  add_prefill_transients(r, m, o, quant, head_quant);
  add_torch_cuda_lines(r, o.gpu, 1, 512.0 * (1 << 20));  // generation: one thread, one cuBLAS handle
  r.notes.push_back("the device total minus gpu-other lines is what torch.cuda.max_memory_allocated() reports");
  return r;
}

}  // namespace llmq::mem
