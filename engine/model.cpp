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
    if (c.attn_qkv_bias) {
      l.bq = vec(llama_layer_bias(i, "attn_q"));
      l.bk = vec(llama_layer_bias(i, "attn_k"));
      l.bv = vec(llama_layer_bias(i, "attn_v"));
    }
    if (c.attn_out_bias) l.bo = vec(llama_layer_bias(i, "attn_output"));
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

Workspace::Workspace(const Model& m, int64_t capacity)
    : Workspace(m, plan_workspace(m.config, {}, capacity, /*max_ctx=*/0, /*logits_rows=*/0, /*threads=*/0)) {}

// Sizes come from the plan only (engine/mem_plan.cpp), so llmq-mem reports what is allocated.
Workspace::Workspace(const Model&, const WorkspacePlan& p) : cap_(p.capacity) {
  x_.resize(p.x);
  xb_.resize(p.xb);
  q_.resize(p.q);
  k_.resize(p.k);
  v_.resize(p.v);
  att_out_.resize(p.att_out);
  h1_.resize(p.h1);
  h2_.resize(p.h2);
  pos_.resize(p.pos);
  att_.assign(size_t(p.threads), std::vector<float>(p.att));
  logits_.resize(p.logits);
  reserve_matmul_scratch(scratch_, p.matmul);
}

uint64_t Workspace::bytes() const {
  size_t floats = x_.capacity() + xb_.capacity() + q_.capacity() + k_.capacity() + v_.capacity() + att_out_.capacity() +
                  h1_.capacity() + h2_.capacity() + logits_.capacity();
  for (const auto& a : att_) floats += a.capacity();
  return floats * sizeof(float) + pos_.capacity() * sizeof(int64_t) + matmul_scratch_bytes(scratch_);
}

// Shapes in comments: T batch tokens, D = dim, Q = q_dim, KV = kv_dim, H = hidden, V = vocab.
const float* forward_batch(const Model& m, KVCache& cache, Workspace& ws, ThreadPool& pool, const BatchToken* batch,
                           int64_t T) {
  const LlamaConfig& c = m.config;
  const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim, hd = c.head_dim, V = c.vocab_size;
  const int64_t group = c.n_heads / c.n_kv_heads;  // query heads per KV head (GQA)
  const int64_t bt = cache.block_tokens();
  const float eps = float(c.norm_eps);
  const float att_scale = float(1.0 / std::sqrt(double(hd)));
  if (T <= 0 || T > ws.cap_) throw UsageError("forward: batch of " + std::to_string(T) + " tokens (capacity " + std::to_string(ws.cap_) + ")");

  // Positions: each sequence continues from its cached length.
  std::map<int32_t, int64_t> next;
  int64_t n_logits = 0, max_pos = 0;
  for (int64_t i = 0; i < T; ++i) {
    const BatchToken& b = batch[i];
    if (b.token < 0 || b.token >= V) throw UsageError("token id " + std::to_string(b.token) + " out of range");
    auto it = next.find(b.seq);
    if (it == next.end()) it = next.emplace(b.seq, cache.length(b.seq)).first;
    ws.pos_[size_t(i)] = it->second++;
    if (ws.pos_[size_t(i)] >= cache.capacity(b.seq)) throw UsageError("forward: KV cache positions not reserved");
    max_pos = std::max(max_pos, ws.pos_[size_t(i)] + 1);
    n_logits += b.logits;
  }
  if (ws.att_.size() < size_t(pool.size())) ws.att_.resize(size_t(pool.size()));
  const int64_t* pos = ws.pos_.data();
  float* x = ws.x_.data();  // [T, D] residual stream

  for (int64_t t = 0; t < T; ++t) embedding_row(x + t * D, m.token_embd, batch[t].token);

  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[size_t(l)];

    // Attention block: xb = RMSNorm(x); q, k, v = xb·Wqᵀ, xb·Wkᵀ, xb·Wvᵀ
    for (int64_t t = 0; t < T; ++t) rmsnorm(ws.xb_.data() + t * D, x + t * D, w.attn_norm, D, eps);
    matmul(pool, ws.scratch_, ws.q_.data(), ws.xb_.data(), T, w.wq);  // [T, Q]
    matmul(pool, ws.scratch_, ws.k_.data(), ws.xb_.data(), T, w.wk);  // [T, KV]
    matmul(pool, ws.scratch_, ws.v_.data(), ws.xb_.data(), T, w.wv);  // [T, KV]
    if (w.bq) {  // q, k, v += their biases (before RoPE, as in Qwen2 and HF Llama)
      add_bias(ws.q_.data(), w.bq, T, Q);
      add_bias(ws.k_.data(), w.bk, T, KV);
      add_bias(ws.v_.data(), w.bv, T, KV);
    }
    for (int64_t t = 0; t < T; ++t) {
      rope(ws.q_.data() + t * Q, c.n_heads, hd, pos[t], c.rope_theta, c.rope_layout);
      rope(ws.k_.data() + t * KV, c.n_kv_heads, hd, pos[t], c.rope_theta, c.rope_layout);
      const int64_t blk = pos[t] / bt, off = (pos[t] % bt) * KV;
      std::memcpy(cache.key_block(l, batch[t].seq, blk) + off, ws.k_.data() + t * KV, size_t(KV) * sizeof(float));
      std::memcpy(cache.value_block(l, batch[t].seq, blk) + off, ws.v_.data() + t * KV, size_t(KV) * sizeof(float));
    }
    // Causal attention: the token at position p sees its sequence's positions 0..p, block by
    // block. A work item is one token and G query heads: in a batch, the G = group heads that
    // share a KV head, so each K/V block is read once and reused from L1 for all of them; in
    // decode (T = 1), single heads, for more items than threads. Items are head-major and, within
    // a head, take tokens in the order 0, T-1, 1, T-2, ... so that contiguous ranges of items
    // (one per thread) carry the same causal work. Each head's arithmetic is the same in both.
    const int64_t G = T > 1 ? group : 1;
    pool.parallel_for(T * (c.n_heads / G), [&](int64_t i0, int64_t i1, int thread) {
      std::vector<float>& att = ws.att_[size_t(thread)];  // [G, max_pos] scores
      if (att.size() < size_t(G * max_pos)) att.resize(size_t(G * max_pos));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = i % T, t = j % 2 == 0 ? j / 2 : T - 1 - j / 2;
        const int64_t h0 = (i / T) * G, kvh = h0 / group;
        const int32_t seq = batch[t].seq;
        const int64_t n_pos = pos[t] + 1;
        const float* q = ws.q_.data() + t * Q + h0 * hd;  // [G, hd]
        for (int64_t p0 = 0; p0 < n_pos; p0 += bt) {
          const float* kb = cache.key_block(l, seq, p0 / bt) + kvh * hd;  // [bt, KV] from head kvh
          for (int64_t g = 0; g < G; ++g)
            attn_scores(att.data() + g * max_pos + p0, q + g * hd, kb, std::min(bt, n_pos - p0), KV, hd, att_scale);
        }
        for (int64_t g = 0; g < G; ++g) softmax(att.data() + g * max_pos, n_pos);
        float* out = ws.att_out_.data() + t * Q + h0 * hd;  // [G, hd]
        std::fill(out, out + G * hd, 0.0f);
        for (int64_t p0 = 0; p0 < n_pos; p0 += bt) {
          const float* vb = cache.value_block(l, seq, p0 / bt) + kvh * hd;
          for (int64_t g = 0; g < G; ++g)
            attn_accumulate(out + g * hd, att.data() + g * max_pos + p0, vb, std::min(bt, n_pos - p0), KV, hd);
        }
      }
    });
    matmul(pool, ws.scratch_, ws.xb_.data(), ws.att_out_.data(), T, w.wo);  // [T, D]
    if (w.bo) add_bias(ws.xb_.data(), w.bo, T, D);
    for (int64_t i = 0; i < T * D; ++i) x[i] += ws.xb_[size_t(i)];

    // FFN block: x += W_down · (silu(xb·W_gateᵀ) ⊙ (xb·W_upᵀ)), xb = RMSNorm(x)
    for (int64_t t = 0; t < T; ++t) rmsnorm(ws.xb_.data() + t * D, x + t * D, w.ffn_norm, D, eps);
    matmul(pool, ws.scratch_, ws.h1_.data(), ws.xb_.data(), T, w.w_gate);  // [T, H]
    matmul(pool, ws.scratch_, ws.h2_.data(), ws.xb_.data(), T, w.w_up);    // [T, H]
    swiglu(ws.h1_.data(), ws.h2_.data(), T * H);
    matmul(pool, ws.scratch_, ws.xb_.data(), ws.h1_.data(), T, w.w_down);  // [T, D]
    for (int64_t i = 0; i < T * D; ++i) x[i] += ws.xb_[size_t(i)];
  }
  for (const auto& [seq, end] : next) cache.set_length(seq, end);

  // Final norm and the output projection for the flagged tokens only.
  if (n_logits == 0) return nullptr;
  int64_t r = 0;
  for (int64_t t = 0; t < T; ++t)
    if (batch[t].logits) rmsnorm(ws.xb_.data() + (r++) * D, x + t * D, m.output_norm, D, eps);
  if (ws.logits_.size() < size_t(n_logits * V)) ws.logits_.resize(size_t(n_logits * V));
  matmul(pool, ws.scratch_, ws.logits_.data(), ws.xb_.data(), n_logits, m.output);  // [n_logits, V]
  return ws.logits_.data();
}

// ---------------------------------------------------------------- Session

Session::Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch, int64_t logits_rows)
    : m_(model),
      pool_(pool),
      ctx_(session_sizes(model.config, ctx, n_batch).ctx),
      n_batch_(session_sizes(model.config, ctx, n_batch).n_batch),
      cache_(model.config, plan_kv(model.config, ctx_).n_blocks, kKvBlockTokens),
      seq_(cache_.add_sequence()),
      ws_(model, [&] {
        const int64_t rows = session_sizes(model.config, ctx, n_batch, logits_rows).logits_rows;
        return plan_workspace(model.config, llama_matmuls(model.config, model.file->tensors(), n_batch_, rows), n_batch_, ctx_,
                              rows, pool.size());
      }()) {}

const float* Session::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  if (n <= 0) throw UsageError("forward: no tokens");
  if (pos() + n > ctx_)
    throw UsageError("context full: " + std::to_string(pos()) + " + " + std::to_string(n) + " tokens exceed the KV cache of " +
                     std::to_string(ctx_));
  if (all_logits && n > n_batch_) throw UsageError("forward: all_logits needs n <= n_batch");
  cache_.reserve(seq_, pos() + n);
  const float* out = nullptr;
  for (int64_t i = 0; i < n; i += n_batch_) {
    const int64_t len = std::min(n_batch_, n - i);
    batch_.resize(size_t(len));
    for (int64_t j = 0; j < len; ++j) batch_[size_t(j)] = {seq_, tokens[i + j], all_logits || i + j == n - 1};
    out = forward_batch(m_, cache_, ws_, pool_, batch_.data(), len);
  }
  return out;
}

}  // namespace llmq
