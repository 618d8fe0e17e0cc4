#include "engine/model.h"

#include <cmath>
#include <cstring>
#include <map>

#include "formats/error.h"

namespace llmq {

// ---------------------------------------------------------------- loading

std::unique_ptr<Model> Model::load(const std::string& path, bool verify) {
  auto model = std::make_unique<Model>();
  model->file = LlmqFile::open(path, verify);
  const LlmqFile& f = *model->file;
  try {
    model->config = LlamaConfig::from_metadata(f.meta());
    model->vocab = vocab_from_metadata(f.meta());
    model->chat_template = f.meta().get_string("tokenizer.chat_template", "");
    model->tokenizer = std::make_unique<Tokenizer>(model->vocab);
  } catch (const std::exception& e) {
    throw FileError(path, e.what());
  }
  const LlamaConfig& c = model->config;
  if (int64_t(model->vocab.size()) != c.vocab_size)
    throw FileError(path, "tokenizer has " + std::to_string(model->vocab.size()) + " tokens but llama.vocab_size is " +
                              std::to_string(c.vocab_size));

  std::map<std::string, const TensorInfo*> expected;
  for (const TensorSpec& spec : llama_tensor_table(c)) {
    const TensorInfo* t = f.find(spec.name);
    if (!t) throw FileError(path, "missing tensor '" + spec.name + "'");
    if (t->shape != spec.shape) {
      std::string want, got;
      for (auto d : spec.shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : t->shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw FileError(path, "tensor '" + spec.name + "' has shape [" + got + "], expected [" + want + "]");
    }
    if (spec.shape.size() == 1 && t->type != DType::F32)
      throw FileError(path, "tensor '" + spec.name + "' must be f32 (1-D tensors are not quantized)");
    expected[spec.name] = t;
  }
  auto mat = [&](const std::string& name) {
    const TensorInfo* t = expected.at(name);
    return Weight{t->type, f.data(*t), t->shape[0], t->shape[1]};
  };
  auto vec = [&](const std::string& name) { return reinterpret_cast<const float*>(f.data(*expected.at(name))); };

  model->token_embd = mat("token_embd.weight");
  for (int64_t i = 0; i < c.n_layers; ++i) {
    LayerWeights l;
    l.attn_norm = vec(llama_layer_tensor(i, "attn_norm"));
    l.wq = mat(llama_layer_tensor(i, "attn_q"));
    l.wk = mat(llama_layer_tensor(i, "attn_k"));
    l.wv = mat(llama_layer_tensor(i, "attn_v"));
    l.wo = mat(llama_layer_tensor(i, "attn_output"));
    l.ffn_norm = vec(llama_layer_tensor(i, "ffn_norm"));
    l.w_gate = mat(llama_layer_tensor(i, "ffn_gate"));
    l.w_up = mat(llama_layer_tensor(i, "ffn_up"));
    l.w_down = mat(llama_layer_tensor(i, "ffn_down"));
    model->layers.push_back(l);
  }
  model->output_norm = vec("output_norm.weight");
  model->output = c.tied_embeddings ? model->token_embd : mat("output.weight");
  return model;
}

uint64_t Model::weight_bytes() const {
  uint64_t n = 0;
  for (const auto& t : file->tensors()) n += t.nbytes;
  return n;
}

std::string Model::weight_type() const {
  std::map<std::string, uint64_t> by_type;  // weights (not bytes) per type
  for (const auto& t : file->tensors())
    if (t.shape.size() >= 2) by_type[dtype_name(t.type)] += uint64_t(t.numel());
  std::string best;
  uint64_t most = 0;
  for (const auto& [name, bytes] : by_type)
    if (bytes > most) most = bytes, best = name;
  return best;
}

// ---------------------------------------------------------------- forward pass

Session::Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch)
    : m_(model), pool_(pool) {
  const LlamaConfig& c = model.config;
  ctx_ = ctx > 0 ? ctx : std::min(c.context_length, kDefaultMaxCtx);
  n_batch_ = std::max<int64_t>(1, std::min(n_batch, ctx_));
  const auto B = size_t(n_batch_);
  k_cache_.assign(size_t(c.n_layers * ctx_ * c.kv_dim()), 0.0f);
  v_cache_.assign(k_cache_.size(), 0.0f);
  x_.resize(B * size_t(c.dim));
  xb_.resize(B * size_t(std::max(c.dim, c.q_dim())));
  q_.resize(B * size_t(c.q_dim()));
  k_.resize(B * size_t(c.kv_dim()));
  v_.resize(B * size_t(c.kv_dim()));
  att_out_.resize(B * size_t(c.q_dim()));
  h1_.resize(B * size_t(c.hidden_dim));
  h2_.resize(B * size_t(c.hidden_dim));
  att_.resize(size_t(pool.size()) * size_t(ctx_));
  logits_.resize(B * size_t(c.vocab_size));
}

uint64_t Session::state_bytes() const {
  const size_t floats = k_cache_.size() + v_cache_.size() + x_.size() + xb_.size() + q_.size() + k_.size() +
                        v_.size() + att_out_.size() + h1_.size() + h2_.size() + att_.size() + logits_.size();
  return floats * sizeof(float) + scratch_.xq.capacity() * sizeof(BlockQ8Act);
}

const float* Session::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  if (n <= 0) throw UsageError("forward: no tokens");
  if (pos_ + n > ctx_)
    throw UsageError("context full: " + std::to_string(pos_) + " + " + std::to_string(n) + " tokens exceed the KV cache of " +
                     std::to_string(ctx_));
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= m_.config.vocab_size)
      throw UsageError("token id " + std::to_string(tokens[i]) + " out of range");
  if (!all_logits) {
    const float* out = nullptr;
    for (int64_t i = 0; i < n; i += n_batch_) out = forward_chunk(tokens + i, std::min(n_batch_, n - i), false);
    return out;
  }
  if (n > n_batch_) throw UsageError("forward: all_logits needs n <= n_batch");
  return forward_chunk(tokens, n, true);
}

// The Llama forward pass for T tokens at positions pos_ .. pos_+T-1 (batched prefill when T > 1,
// decode when T == 1). Shapes in comments: T tokens, D = dim, Q = q_dim, KV = kv_dim, H = hidden.
const float* Session::forward_chunk(const int32_t* tokens, int64_t T, bool all_logits) {
  const LlamaConfig& c = m_.config;
  const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim, hd = c.head_dim;
  const int64_t group = c.n_heads / c.n_kv_heads;  // query heads per KV head (GQA)
  const float eps = float(c.norm_eps);
  const float att_scale = float(1.0 / std::sqrt(double(hd)));
  float* x = x_.data();  // [T, D] residual stream

  for (int64_t t = 0; t < T; ++t) embedding_row(x + t * D, m_.token_embd, tokens[t]);

  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m_.layers[size_t(l)];
    float* kc = k_cache_.data() + size_t(l * ctx_ * KV);  // [ctx, KV]
    float* vc = v_cache_.data() + size_t(l * ctx_ * KV);  // [ctx, KV]

    // Attention block: xb = RMSNorm(x); q, k, v = xb·Wqᵀ, xb·Wkᵀ, xb·Wvᵀ
    for (int64_t t = 0; t < T; ++t) rmsnorm(xb_.data() + t * D, x + t * D, w.attn_norm, D, eps);
    matmul(pool_, scratch_, q_.data(), xb_.data(), T, w.wq);  // [T, Q]
    matmul(pool_, scratch_, k_.data(), xb_.data(), T, w.wk);  // [T, KV]
    matmul(pool_, scratch_, v_.data(), xb_.data(), T, w.wv);  // [T, KV]
    for (int64_t t = 0; t < T; ++t) {
      rope(q_.data() + t * Q, c.n_heads, hd, pos_ + t, c.rope_theta, c.rope_layout);
      rope(k_.data() + t * KV, c.n_kv_heads, hd, pos_ + t, c.rope_theta, c.rope_layout);
      std::memcpy(kc + (pos_ + t) * KV, k_.data() + t * KV, size_t(KV) * sizeof(float));
      std::memcpy(vc + (pos_ + t) * KV, v_.data() + t * KV, size_t(KV) * sizeof(float));
    }
    // Causal attention, one (token, head) pair per work item: token t sees positions 0..pos_+t.
    pool_.parallel_for(T * c.n_heads, [&](int64_t i0, int64_t i1, int thread) {
      float* att = att_.data() + size_t(thread) * size_t(ctx_);  // [ctx] scores
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / c.n_heads, h = i % c.n_heads, kvh = h / group;
        const int64_t n_pos = pos_ + t + 1;
        const float* q = q_.data() + t * Q + h * hd;  // [hd]
        for (int64_t p = 0; p < n_pos; ++p) {
          const float* k = kc + p * KV + kvh * hd;
          float s = 0.0f;
          for (int64_t j = 0; j < hd; ++j) s += q[j] * k[j];
          att[p] = s * att_scale;
        }
        softmax(att, n_pos);
        float* out = att_out_.data() + t * Q + h * hd;  // [hd]
        std::fill(out, out + hd, 0.0f);
        for (int64_t p = 0; p < n_pos; ++p) {
          const float* v = vc + p * KV + kvh * hd;
          for (int64_t j = 0; j < hd; ++j) out[j] += att[p] * v[j];
        }
      }
    });
    matmul(pool_, scratch_, xb_.data(), att_out_.data(), T, w.wo);  // [T, D]
    for (int64_t i = 0; i < T * D; ++i) x[i] += xb_[size_t(i)];

    // FFN block: x += W_down · (silu(xb·W_gateᵀ) ⊙ (xb·W_upᵀ)), xb = RMSNorm(x)
    for (int64_t t = 0; t < T; ++t) rmsnorm(xb_.data() + t * D, x + t * D, w.ffn_norm, D, eps);
    matmul(pool_, scratch_, h1_.data(), xb_.data(), T, w.w_gate);  // [T, H]
    matmul(pool_, scratch_, h2_.data(), xb_.data(), T, w.w_up);    // [T, H]
    swiglu(h1_.data(), h2_.data(), T * H);
    matmul(pool_, scratch_, xb_.data(), h1_.data(), T, w.w_down);  // [T, D]
    for (int64_t i = 0; i < T * D; ++i) x[i] += xb_[size_t(i)];
  }
  pos_ += T;

  // Final norm and the output projection, for every token or just the last.
  const int64_t first = all_logits ? 0 : T - 1, rows = T - first;
  for (int64_t t = 0; t < rows; ++t) rmsnorm(xb_.data() + t * D, x + (first + t) * D, m_.output_norm, D, eps);
  matmul(pool_, scratch_, logits_.data(), xb_.data(), rows, m_.output);  // [rows, vocab]
  return logits_.data();
}

}  // namespace llmq
