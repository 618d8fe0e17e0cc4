#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "engine/sampler.h"
#include "engine/tp.h"
#include "base/error.h"

namespace llmq {

// ---------------------------------------------------------------- loading

std::unique_ptr<Model> Model::open(const std::string& path, bool verify, int64_t ctx) {
  auto model = std::make_unique<Model>();
  model->file = LlmqFile::open(path, verify);
  const LlmqFile& f = *model->file;
  try {
    model->config = ModelConfig::from_metadata(f.meta());
    model->vocab = vocab_from_metadata(f.meta());
    model->chat_template = f.meta().get_string("tokenizer.chat_template", "");
    model->tokenizer = std::make_unique<Tokenizer>(model->vocab);
  } catch (const std::exception& e) {
    throw FileError(path, e.what());
  }
  model->config.use_context(ctx > 0 ? ctx : std::min(model->config.context_length, kDefaultMaxCtx));
  if (int64_t(model->vocab.size()) != model->config.vocab_size)
    throw FileError(path, "tokenizer has " + std::to_string(model->vocab.size()) + " tokens but " + model->config.arch +
                              ".vocab_size is " + std::to_string(model->config.vocab_size));
  return model;
}

namespace {

// The tensors the model's table names (tensor_table), each checked against the file's directory:
// present, the table's shape, 1-D ones F32. Throws FileError naming the first that is not.
std::map<std::string, const TensorInfo*> expected_tensors(const LlmqFile& f, const ModelConfig& c, const std::string& path) {
  auto dims = [](const std::vector<int64_t>& shape) {
    std::string s;
    for (auto d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
    return "[" + s + "]";
  };
  std::map<std::string, const TensorInfo*> expected;
  for (const TensorSpec& spec : tensor_table(c)) {
    const TensorInfo* t = f.find(spec.name);
    if (!t) throw FileError(path, "missing tensor '" + spec.name + "'");
    if (t->shape != spec.shape) throw FileError(path, "tensor '" + spec.name + "' has shape " + dims(t->shape) + ", expected " + dims(spec.shape));
    if (spec.shape.size() == 1 && t->type != DType::F32)
      throw FileError(path, "tensor '" + spec.name + "' must be f32 (1-D tensors are not quantized)");
    expected[spec.name] = t;
  }
  return expected;
}

// Repacks the matmul weights of the CPU's layers (all but the last gpu_layers; wo and w_down
// only without TP, whose ranks take their own slices) and the output for the CPU kernels, and
// drops the file's copy of them from memory (the embedding rows are still read from the file: a
// tied output is packed separately).
void pack_cpu_weights(Model& model, int64_t gpu_layers, int tp) {
  const LlmqFile& f = *model.file;
  const ModelConfig& c = model.config;
  std::vector<Weight*> mats;
  const int64_t n_pack = c.n_layers - std::clamp<int64_t>(gpu_layers, 0, c.n_layers);
  for (int64_t i = 0; i < n_pack; ++i) {
    LayerWeights& l = model.layers[size_t(i)];
    for (Weight* w : {&l.wq, &l.wk, &l.wv, &l.w_gate, &l.w_up}) mats.push_back(w);
    if (tp <= 1) mats.push_back(&l.wo), mats.push_back(&l.w_down);
  }
  if (gpu_layers <= 0) mats.push_back(&model.output);
  // Each chunk's pages of the file are dropped as soon as its copy is written, so a matrix's
  // file pages and its copy are never resident together (the checksum pass dropped its own).
  // The 2 MiB before the chunk go too: the page cache holds the file in large folios (up to 2
  // MiB, aligned), and a fault maps the cached neighbours of the page in its folio, so reading a
  // chunk's first rows mapped back the end of what was dropped before it (Qwen2.5-0.5B with
  // Q2_K: 30-60 MiB resident until the end of the load, its peak RSS 2.9% over llmq-mem's; seen
  // with /proc/PID/pagemap on Linux 6.x: the runs left started on 1 MiB boundaries).
  constexpr uint64_t kFolioMax = 2 << 20;
  model.packed = pack_weights(mats, [&f](const Weight& w) { f.release(w.data, uint64_t(w.rows) * w.row_stride(), kFolioMax); });
  // The rest of what the checksums read (header, tokenizer, an untied embedding table, the
  // matrices left unpacked) goes too: the runs fault back in only what they read, and what they
  // read every token (the unpacked matrices) stays.
  f.release_all();
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& path, bool verify, bool pack, int64_t gpu_layers, int tp, int64_t ctx) {
  std::unique_ptr<Model> model = open(path, verify, ctx);
  const LlmqFile& f = *model->file;
  const ModelConfig& c = model->config;
  const std::map<std::string, const TensorInfo*> expected = expected_tensors(f, c, path);
  auto mat = [&](const std::string& name) {
    const TensorInfo* t = expected.at(name);
    return Weight{t->type, f.data(*t), t->shape[0], t->shape[1]};
  };
  // The 1-D tensors are copied out of the mapping (Model::vectors; its pages go with the rest in
  // pack_cpu_weights).
  std::map<std::string, size_t> at;
  size_t n_floats = 0;
  for (const auto& [name, t] : expected)
    if (t->shape.size() == 1) at[name] = n_floats, n_floats += size_t(t->shape[0]);
  model->vectors.resize(n_floats);
  for (const auto& [name, off] : at) std::memcpy(model->vectors.data() + off, f.data(*expected.at(name)), size_t(expected.at(name)->shape[0]) * 4);
  auto vec = [&](const std::string& name) { return static_cast<const float*>(model->vectors.data() + at.at(name)); };
  auto opt = [&](const std::string& name) { return expected.count(name) ? vec(name) : nullptr; };  // in the table or not

  model->token_embd = mat("token_embd.weight");
  for (int64_t i = 0; i < c.n_layers; ++i) {
    LayerWeights l;
    l.attn_norm = vec(layer_tensor(i, "attn_norm"));
    l.wq = mat(layer_tensor(i, "attn_q")), l.wk = mat(layer_tensor(i, "attn_k")), l.wv = mat(layer_tensor(i, "attn_v"));
    l.wo = mat(layer_tensor(i, "attn_output"));
    l.bq = opt(layer_bias(i, "attn_q")), l.bk = opt(layer_bias(i, "attn_k")), l.bv = opt(layer_bias(i, "attn_v"));
    l.bo = opt(layer_bias(i, "attn_output"));
    l.q_norm = opt(layer_tensor(i, "attn_q_norm")), l.k_norm = opt(layer_tensor(i, "attn_k_norm"));
    l.post_attn_norm = opt(layer_tensor(i, "post_attention_norm"));
    l.ffn_norm = vec(layer_tensor(i, "ffn_norm"));
    l.w_gate = mat(layer_tensor(i, "ffn_gate")), l.w_up = mat(layer_tensor(i, "ffn_up")), l.w_down = mat(layer_tensor(i, "ffn_down"));
    l.post_ffn_norm = opt(layer_tensor(i, "post_ffw_norm"));
    model->layers.push_back(l);
  }
  model->rope_freqs = c.rope_freq_tables();
  model->output_norm = vec("output_norm.weight");
  model->output = c.tied_embeddings ? model->token_embd : mat("output.weight");
  if (pack) pack_cpu_weights(*model, gpu_layers, tp);
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

ShardRanges ShardRanges::whole(const ModelConfig& c) {
  ShardRanges r;
  r.n_heads = c.n_heads, r.n_kv_heads = c.n_kv_heads, r.ffn_dim = c.hidden_dim;
  r.n_vocab = c.vocab_size, r.n_embd = c.vocab_size;
  return r;
}

uint64_t ModelShard::weight_bytes() const {
  auto bytes = [](const Weight& w) { return uint64_t(w.rows) * w.row_stride(); };
  const int64_t dim = token_embd.cols;
  uint64_t n = bytes(token_embd) + uint64_t(dim) * sizeof(float);  // + output_norm
  for (const LayerWeights& l : layers) {
    n += 2 * uint64_t(dim) * sizeof(float) + bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + bytes(l.w_gate) +
         bytes(l.w_up) + bytes(l.w_down);
    if (l.bq) n += uint64_t(l.wq.rows + l.wk.rows + l.wv.rows) * sizeof(float);  // biases: the rows' slices
    if (l.bo) n += uint64_t(dim) * sizeof(float);                                // replicated
    if (l.q_norm && ranges.n_heads > 0) n += 2 * uint64_t(l.wq.rows / ranges.n_heads) * sizeof(float);  // [head_dim] x2
    if (l.post_attn_norm) n += 2 * uint64_t(dim) * sizeof(float);                                       // post norms
  }
  const bool inside_embd = output.data >= token_embd.data && output.data + bytes(output) <= token_embd.data + bytes(token_embd);
  if (!(inside_embd && output.type == token_embd.type)) n += bytes(output);  // tied: already counted
  return n;
}

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
  plan_.pos.reserve(p.pos);
  plan_.out.reserve(p.pos);
  att_.assign(size_t(p.threads), std::vector<float>(p.att));
  att_part_.resize(p.att_part);
  rope_.resize(p.rope);
  logits_.resize(p.logits);
  reserve_matmul_scratch(scratch_, p.matmul);
}

uint64_t Workspace::bytes() const {
  size_t floats = x_.capacity() + xb_.capacity() + q_.capacity() + k_.capacity() + v_.capacity() + att_out_.capacity() +
                  h1_.capacity() + h2_.capacity() + logits_.capacity() + gathered_.capacity() + rope_.capacity();
  for (const auto& a : att_) floats += a.capacity();
  floats += att_part_.capacity();
  return floats * sizeof(float) + (plan_.pos.capacity() + plan_.out.capacity()) * sizeof(int64_t) +
         matmul_scratch_bytes(scratch_);
}

void plan_batch(const Model& m, const KVCache& cache, const BatchToken* batch, int64_t T, int64_t capacity,
                BatchPlan& plan) {
  plan_batch(m.config, cache, batch, T, capacity, plan);
}

void plan_batch(const ModelConfig& c, const KVCache& cache, const BatchToken* batch, int64_t T, int64_t capacity, BatchPlan& plan) {
  if (T <= 0 || T > capacity)
    throw UsageError("forward: batch of " + std::to_string(T) + " tokens (capacity " + std::to_string(capacity) + ")");
  // Positions: each sequence continues from its cached length.
  std::map<int32_t, int64_t> next;
  plan.pos.resize(size_t(T));
  plan.out.clear();
  plan.n_logits = 0, plan.max_pos = 0;
  for (int64_t i = 0; i < T; ++i) {
    const BatchToken& b = batch[i];
    if (b.token < 0 || b.token >= c.vocab_size) throw UsageError("token id " + std::to_string(b.token) + " out of range");
    auto it = next.find(b.seq);
    if (it == next.end()) it = next.emplace(b.seq, cache.length(b.seq)).first;
    plan.pos[size_t(i)] = it->second++;
    if (plan.pos[size_t(i)] >= cache.capacity(b.seq)) throw UsageError("forward: KV cache positions not reserved");
    plan.max_pos = std::max(plan.max_pos, plan.pos[size_t(i)] + 1);
    if (b.logits) plan.out.push_back(i);
  }
  plan.n_logits = int64_t(plan.out.size());
  plan.ends.assign(next.begin(), next.end());
}

const float* forward_batch(const Model& m, KVCache& cache, Workspace& ws, ThreadPool& pool, const BatchToken* batch,
                           int64_t T, Output out) {
  plan_batch(m, cache, batch, T, ws.cap_, ws.plan_);
  const float* logits = forward_shard(m, nullptr, cache, ws, pool, nullptr, batch, T, ws.plan_, -1, out);
  for (const auto& [seq, end] : ws.plan_.ends) cache.set_length(seq, end);
  return logits;
}

namespace detail {

// One forward pass of a batch through this rank's layers, as named steps; forward_shard (below)
// runs them top to bottom. Shapes in comments: T batch tokens, D = dim, Q = this rank's query
// width (its heads x hd), KV = its KV width, H = its FFN width, V = vocab. With one rank these
// are the model's widths.
class ShardPass {
 public:
  ShardPass(const Model& m, const ModelShard* shard, KVCache& cache, Workspace& ws, ThreadPool& pool, Communicator* comm,
            const BatchToken* batch, int64_t T, const BatchPlan& plan)
      : m_(m), c_(m.config), shard_(shard), R(shard ? shard->ranges : ShardRanges::whole(m.config)),
        layers_(shard ? shard->layers : m.layers), cache_(cache), ws_(ws), pool_(pool), comm_(comm), batch_(batch), T_(T),
        plan_(plan), D(c_.dim), hd(c_.head_dim), V(c_.vocab_size), Q(R.n_heads * c_.head_dim), KV(R.n_kv_heads * c_.head_dim),
        H(R.ffn_dim), group_(c_.n_heads / c_.n_kv_heads), bt_(cache.block_tokens()), bf16_(cache.type() == KvType::BF16),
        pool_id_(cache.n_shards() == 1 ? 0 : R.rank), eps_(float(c_.norm_eps)), att_scale_(c_.softmax_scale()),
        pos_(plan.pos.data()), x_(ws.x_.data()) {
    if (ws_.att_.size() < size_t(pool_.size())) ws_.att_.resize(size_t(pool_.size()));
  }

  float* residual() const { return x_; }
  void embed();
  void rope_angles_all();
  // The attention block of layer l: x's norm, q/k/v, RoPE, the KV-cache write, attention, the
  // output projection (all-reduced under TP); returns the rows that go on (To: the flagged
  // tokens in the last layer, else T), 0 when nothing does.
  int64_t attention_block(int64_t l, bool last);
  void ffn_block(int64_t l, int64_t To);  // x += W_down · (act(xb·W_gateᵀ) ⊙ (xb·W_upᵀ)), xb = RMSNorm(x)
  const float* final_norm();              // xb [n_logits, D] = the final norm of the flagged tokens' rows
  const float* logits();                  // the final norm and output rows of the flagged tokens (soft-capped)

 private:
  // Per-token work (norms, RoPE, residual adds) runs on the pool when there are enough tokens
  // to pay for the hand-off; a token's result does not depend on the split.
  template <class Fn>
  void per_token(int64_t n, const Fn& fn) {  // fn(t0, t1); a template: no std::function on decode's path
    if (n < 4) return fn(0, n);
    pool_.parallel_for(n, [&](int64_t t0, int64_t t1, int) { fn(t0, t1); });
  }
  void attend(int64_t l, int64_t To, bool last);  // ws.att_out [To, Q] = causal attention of the To query rows
  // One layer's attention work (attend): items are (output row i, G query heads from h0), each
  // over parts of part_len positions with part_floats floats of (o, m, l) per part.
  struct AttnLayout {
    int64_t l, To, G, part_len, part_floats;
    bool last;  // the last layer: rows are the flagged tokens (plan_.out)
    int64_t row(int64_t pair) const;  // item pair's row: 0, To-1, 1, To-2, ... within each head group
  };
  AttnLayout attn_layout(int64_t l, int64_t To, bool last) const;
  int64_t attn_token(const AttnLayout& a, int64_t i) const { return a.last ? plan_.out[size_t(i)] : i; }
  int64_t attn_window_start(const AttnLayout& a, int64_t i) const { return c_.window_start(a.l, pos_[attn_token(a, i)]); }
  int64_t attn_parts(const AttnLayout& a, int64_t i) const { return (pos_[attn_token(a, i)] + a.part_len) / a.part_len; }  // ceil((pos + 1) / part_len)
  int64_t attn_first_part(const AttnLayout& a, int64_t i) const { return attn_window_start(a, i) / a.part_len; }  // before a window: skipped
  size_t attn_bf16_floats(const AttnLayout& a) const { return size_t(a.G * (hd + a.part_len) + 1) / 2; }
  void attend_part(const AttnLayout& a, int64_t i, int64_t h0, int64_t c, float* scores, float* dst);
  void merge_parts(const AttnLayout& a, const float* parts, int64_t n, float* out) const;
  float* attn_scratch(const AttnLayout& a, int thread, int64_t max_parts);
  void head_norms(const LayerWeights& w, int64_t To);  // QK-norm: RMSNorm over each head of q [To, Q] and k [T, KV]
  void norm_rows(float* x, const float* w, int64_t n);  // x [n, D] = RMSNorm(x) in place (post norms)
  const float* gather_logits(int64_t n_logits);  // vocab-parallel output: rank 0 assembles [n_logits, V]

  const Model& m_;
  const ModelConfig& c_;
  const ModelShard* shard_;
  const ShardRanges R;
  const std::vector<LayerWeights>& layers_;
  KVCache& cache_;
  Workspace& ws_;
  ThreadPool& pool_;
  Communicator* comm_;
  const BatchToken* batch_;
  const int64_t T_;
  const BatchPlan& plan_;
  const int64_t D, hd, V, Q, KV, H;
  const int64_t group_;  // query heads per KV head (GQA)
  const int64_t bt_;     // KV-cache positions per block
  const bool bf16_;      // bf16 KV blocks and attention on bf16 operands
  const int pool_id_;    // this rank's KV-cache pool (a process rank's cache has one)
  const float eps_, att_scale_;
  const int64_t* pos_;
  float* x_;  // [T, D] residual stream (replicated on every rank)
  const float* angles_ = nullptr;  // [rope tables, T, hd] RoPE cos, then sin, of each pair (ModelConfig::rope_table)
};

// After the embedding rows of a pass are read from the mapping, drops the table's pages again
// when the mapping's copy is not otherwise used (a packed tied output reads its copy; an untied
// output is another matrix): each row read faults in its whole page-cache folio (up to 2 MiB),
// which would otherwise stay resident, up to the whole table over a long run. One madvise over
// the table per forward pass (MappedFile::release).
static void drop_embedding_pages(const Model& m, const Weight& emb) {
  if (m.output.data == emb.data && !m.output.packed) return;  // the output matmul reads these pages every token
  m.file->release(emb.data, uint64_t(emb.rows) * emb.row_stride());
}

void ShardPass::embed() {
  if (!shard_ || R.n_embd == V) {
    const Weight& emb = shard_ ? shard_->token_embd : m_.token_embd;
    for (int64_t t = 0; t < T_; ++t) embedding_row(x_ + t * D, emb, batch_[t].token);
    if (!shard_) drop_embedding_pages(m_, emb);
  } else {
    for (int64_t t = 0; t < T_; ++t) {  // vocab-parallel embedding: the rank holding the token's row adds it, the others 0
      const int64_t row = batch_[t].token - R.embd0;
      if (row >= 0 && row < R.n_embd) embedding_row(x_ + t * D, shard_->token_embd, row);
      else std::fill(x_ + t * D, x_ + (t + 1) * D, 0.0f);
    }
    comm_->all_reduce_sum(x_, T_ * D);
  }
  if (const float s = c_.embedding_multiplier(); s != 1.0f)  // Gemma: rows × √dim
    for (int64_t i = 0; i < T_ * D; ++i) x_[i] *= s;
}

// RoPE angles of every token, for all layers: [rope tables, T, hd] (cos, then sin, of each pair;
// a second table when sliding-window layers have their own frequencies).
void ShardPass::rope_angles_all() {
  float* angles = ws_.rope_.data();
  for (int table = 0; table < c_.rope_tables(); ++table) {
    const double* freqs = m_.rope_freqs.data() + table * (hd / 2);  // computed at load
    float* a = angles + table * T_ * hd;
    per_token(T_, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) rope_angles(a + t * hd, hd, pos_[t], freqs);
    });
  }
  angles_ = angles;
}

void ShardPass::head_norms(const LayerWeights& w, int64_t To) {
  per_token(T_, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < R.n_kv_heads; ++h) rmsnorm(ws_.k_.data() + t * KV + h * hd, ws_.k_.data() + t * KV + h * hd, w.k_norm, hd, eps_);
      if (t < To)
        for (int64_t h = 0; h < R.n_heads; ++h) rmsnorm(ws_.q_.data() + t * Q + h * hd, ws_.q_.data() + t * Q + h * hd, w.q_norm, hd, eps_);
    }
  });
}

void ShardPass::norm_rows(float* x, const float* w, int64_t n) {
  per_token(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rmsnorm(x + t * D, x + t * D, w, D, eps_);
  });
}

int64_t ShardPass::attention_block(int64_t l, bool last) {
  const LayerWeights& w = layers_[size_t(l)];
  // Every layer writes K and V of all T tokens, but only the flagged tokens' hidden states
  // reach the logits: the last layer computes its queries, attention and FFN for those To
  // tokens alone (as llama.cpp does), row i standing for batch token tok(i).
  const int64_t To = last ? plan_.n_logits : T_;
  auto tok = [&](int64_t i) { return last ? plan_.out[size_t(i)] : i; };
  // xb = RMSNorm(x); q, k, v = xb·Wqᵀ, xb·Wkᵀ, xb·Wvᵀ (this rank's heads)
  per_token(T_, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rmsnorm(ws_.xb_.data() + t * D, x_ + t * D, w.attn_norm, D, eps_);
  });
  if (!last) {
    matmul_many(pool_, ws_.scratch_, ws_.xb_.data(), T_,
                {{ws_.q_.data(), &w.wq}, {ws_.k_.data(), &w.wk}, {ws_.v_.data(), &w.wv}});  // [T, Q], [T, KV], [T, KV]
  } else {
    matmul_many(pool_, ws_.scratch_, ws_.xb_.data(), T_, {{ws_.k_.data(), &w.wk}, {ws_.v_.data(), &w.wv}});  // [T, KV] x2
    for (int64_t i = 0; i < To; ++i)  // xb rows of the flagged tokens to the front (tok(i) >= i)
      if (tok(i) != i) std::memcpy(ws_.xb_.data() + i * D, ws_.xb_.data() + tok(i) * D, size_t(D) * sizeof(float));
    if (To > 0) matmul(pool_, ws_.scratch_, ws_.q_.data(), ws_.xb_.data(), To, w.wq);  // [To, Q]
  }
  if (w.bq) {  // q, k, v += their biases (before RoPE, as in Qwen2 and HF Llama)
    add_bias(ws_.q_.data(), w.bq, To, Q);
    add_bias(ws_.k_.data(), w.bk, T_, KV);
    add_bias(ws_.v_.data(), w.bv, T_, KV);
  }
  if (w.q_norm) head_norms(w, To);  // QK-norm (before RoPE, as Qwen3 and Gemma 3)
  const float* angles = angles_ + c_.rope_table(l) * T_ * hd;  // this layer's RoPE table [T, hd]
  per_token(T_, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rope_rotate(ws_.k_.data() + t * KV, R.n_kv_heads, hd, angles + t * hd, c_.rope_layout);
      cache_.store(l, batch_[t].seq, pos_[t], ws_.k_.data() + t * KV, ws_.v_.data() + t * KV, pool_id_);
    }
  });
  if (To == 0) return 0;  // last layer, no logits wanted: only its K and V were needed
  per_token(To, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) rope_rotate(ws_.q_.data() + i * Q, R.n_heads, hd, angles + tok(i) * hd, c_.rope_layout);
  });
  attend(l, To, last);
  matmul(pool_, ws_.scratch_, ws_.xb_.data(), ws_.att_out_.data(), To, w.wo);  // [To, D] (partial sum when split)
  if (comm_) comm_->all_reduce_sum(ws_.xb_.data(), To * D);
  if (w.bo) add_bias(ws_.xb_.data(), w.bo, To, D);  // [D], replicated: added once, after the sum
  if (w.post_attn_norm) norm_rows(ws_.xb_.data(), w.post_attn_norm, To);  // pre_post norms: RMSNorm of the block's output
  if (last)  // the flagged tokens' residual rows to the front too
    for (int64_t i = 0; i < To; ++i)
      if (tok(i) != i) std::memcpy(x_ + i * D, x_ + tok(i) * D, size_t(D) * sizeof(float));
  return To;
}

ShardPass::AttnLayout ShardPass::attn_layout(int64_t l, int64_t To, bool last) const {
  const bool aligned = R.head0 % group_ == 0 && R.n_heads % group_ == 0;
  const int64_t G = aligned ? group_ : 1, part_len = std::max<int64_t>(1, kAttnPartTokens / bt_) * bt_;
  return {l, To, G, part_len, G * (hd + 2), last};
}

int64_t ShardPass::AttnLayout::row(int64_t pair) const {
  const int64_t j = pair % To;
  return j % 2 == 0 ? j / 2 : To - 1 - j / 2;
}

// Part c of (row i, heads h0 ...): o [G, hd], m [G], l [G] at dst (o normalized by l). `scores`
// holds [G, part_len], then (bf16 cache) the bf16 copies of q [G, hd] and of the softmax weights
// [G, part_len].
void ShardPass::attend_part(const AttnLayout& a, int64_t i, int64_t h0, int64_t c, float* scores, float* dst) {
  const int64_t G = a.G, part_len = a.part_len, l = a.l;
  const int64_t kvh = (R.head0 + h0) / group_ - R.kv_head0, t = attn_token(a, i);
  const int32_t seq = batch_[t].seq;
  const int64_t lo = c * part_len, hi = std::min(pos_[t] + 1, lo + part_len);
  const int64_t off = std::max<int64_t>(0, attn_window_start(a, i) - lo);  // positions of the part before the window: weight 0
  const float* q = ws_.q_.data() + i * Q + h0 * hd;               // [G, hd]
  auto* qb = reinterpret_cast<uint16_t*>(scores + G * part_len);  // bf16 only: [G, hd]
  uint16_t* ab = qb + G * hd;                                      // bf16 only: [G, part_len]
  if (bf16_) to_bf16(qb, q, G * hd);
  for (int64_t p0 = lo; p0 < hi; p0 += bt_) {
    const int64_t n = std::min(bt_, hi - p0);
    if (bf16_)
      attn_scores_bf16(scores + p0 - lo, part_len, qb, G, cache_.key_block_bf16(l, seq, p0 / bt_, kvh, pool_id_), n, bt_, hd, att_scale_);
    else
      attn_scores(scores + p0 - lo, part_len, q, G, cache_.key_block(l, seq, p0 / bt_, kvh, pool_id_), n, bt_, hd, att_scale_);
  }
  for (int64_t g = 0; g < G; ++g) {
    dst[G * hd + G + g] = softmax(scores + g * part_len + off, hi - lo - off, &dst[G * hd + g]);
    std::fill(scores + g * part_len, scores + g * part_len + off, 0.0f);
  }
  std::fill(dst, dst + G * hd, 0.0f);
  if (bf16_)
    for (int64_t g = 0; g < G; ++g) {
      to_bf16(ab + g * part_len, scores + g * part_len, hi - lo);
      if ((hi - lo) % 2) ab[g * part_len + hi - lo] = 0;  // the odd last position's pair partner
    }
  for (int64_t p0 = lo; p0 < hi; p0 += bt_) {
    const int64_t n = std::min(bt_, hi - p0);
    if (bf16_)
      attn_accumulate_bf16(dst, ab + p0 - lo, part_len, G, cache_.value_block_bf16(l, seq, p0 / bt_, kvh, pool_id_), n, hd);
    else
      attn_accumulate(dst, scores + p0 - lo, part_len, G, cache_.value_block(l, seq, p0 / bt_, kvh, pool_id_), n, hd, hd);
  }
}

// out [G, hd] from n parts [n, part_floats]: Σ_c l_c e^(m_c - M) o_c / Σ_c l_c e^(m_c - M).
void ShardPass::merge_parts(const AttnLayout& a, const float* parts, int64_t n, float* out) const {
  const int64_t G = a.G;
  if (n == 1) {
    std::copy(parts, parts + G * hd, out);
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    float M = -INFINITY;
    for (int64_t c = 0; c < n; ++c) M = std::max(M, parts[c * a.part_floats + G * hd + g]);
    float* o = out + g * hd;
    std::fill(o, o + hd, 0.0f);
    float denom = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      const float* pc = parts + c * a.part_floats;
      const float wgt = pc[G * hd + G + g] * std::exp(pc[G * hd + g] - M);  // l_c e^(m_c - M)
      denom += wgt;
      axpy_f32(o, wgt, pc + g * hd, hd);
    }
    const float inv = 1.0f / denom;
    for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
  }
}

// A thread's attention scratch: [G, part_len] scores, the bf16 copies (always planned), then
// max_parts parts [max_parts, part_floats].
float* ShardPass::attn_scratch(const AttnLayout& a, int thread, int64_t max_parts) {
  std::vector<float>& buf = ws_.att_[size_t(thread)];
  const size_t need = size_t(a.G * a.part_len + max_parts * a.part_floats) + attn_bf16_floats(a);
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

// Causal attention: the token at position p sees its sequence's positions 0..p (a sliding-window
// layer: window_start(l, p)..p; parts wholly before the window are skipped, the rest of a part
// before it gets softmax weight 0 exactly). A work item is one output row i (batch token
// attn_token(i)) and G query heads (AttnLayout): G = group, the heads that share a KV
// head, so each K/V block is read once for all of them (a rank whose heads do not start and end
// on KV-group boundaries, in uneven TP splits, uses G = 1). Positions are taken in parts of
// kAttnPartTokens; each part keeps its softmax max m and sum l and its normalized output o, and
// the parts are merged: out = Σ_c l_c e^(m_c - M) o_c / Σ_c l_c e^(m_c - M), M = max_c m_c (the
// flash-decoding merge, Dao et al. 2023). The parts of a token are fixed by its position, so
// its result is the same in any batch and on any thread count. With enough (token, head group)
// items for the threads (prefill, big batches) an item runs its parts in turn; items are
// head-major and, within a head, take rows in the order 0, To-1, 1, To-2, ... so that contiguous
// ranges of items (one per thread) carry the same causal work. With fewer (decode), every part
// is an item of its own and the merge follows. Local head h is global head R.head0 + h; its KV
// head is (R.head0 + h) / group, local index that minus R.kv_head0.
void ShardPass::attend(int64_t l, int64_t To, bool last) {
  const AttnLayout a = attn_layout(l, To, last);
  const int64_t pair_count = To * (R.n_heads / a.G);
  int64_t max_parts = 1;
  for (int64_t i = 0; i < To; ++i) max_parts = std::max(max_parts, attn_parts(a, i));
  const bool split = pair_count < 2 * pool_.size() && max_parts > 1 && ws_.att_part_.size() >= size_t(pair_count * max_parts * a.part_floats);
  if (!split) {  // an item's parts in turn, then their merge
    pool_.parallel_for(pair_count, [&](int64_t i0, int64_t i1, int thread) {
      float* scores = attn_scratch(a, thread, max_parts);
      float* parts = scores + a.G * a.part_len + attn_bf16_floats(a);
      for (int64_t pair = i0; pair < i1; ++pair) {
        const int64_t i = a.row(pair), h0 = (pair / To) * a.G, c0 = attn_first_part(a, i), n = attn_parts(a, i);
        for (int64_t c = c0; c < n; ++c) attend_part(a, i, h0, c, scores, parts + (c - c0) * a.part_floats);
        merge_parts(a, parts, n - c0, ws_.att_out_.data() + i * Q + h0 * hd);
      }
    });
    return;
  }
  pool_.parallel_for(pair_count * max_parts, [&](int64_t i0, int64_t i1, int thread) {  // every part an item
    float* scores = attn_scratch(a, thread, max_parts);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t pair = it / max_parts, c = it % max_parts, i = a.row(pair);
      if (c >= attn_first_part(a, i) && c < attn_parts(a, i))
        attend_part(a, i, (pair / To) * a.G, c, scores, ws_.att_part_.data() + it * a.part_floats);
    }
  });
  for (int64_t pair = 0; pair < pair_count; ++pair) {
    const int64_t i = a.row(pair), h0 = (pair / To) * a.G, c0 = attn_first_part(a, i);
    merge_parts(a, ws_.att_part_.data() + (pair * max_parts + c0) * a.part_floats, attn_parts(a, i) - c0,
                ws_.att_out_.data() + i * Q + h0 * hd);
  }
}

void ShardPass::ffn_block(int64_t l, int64_t To) {
  const LayerWeights& w = layers_[size_t(l)];
  float* x = x_;
  per_token(To, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = t * D; i < (t + 1) * D; ++i) x[i] += ws_.xb_[size_t(i)];
      rmsnorm(ws_.xb_.data() + t * D, x + t * D, w.ffn_norm, D, eps_);
    }
  });
  matmul_many(pool_, ws_.scratch_, ws_.xb_.data(), To, {{ws_.h1_.data(), &w.w_gate}, {ws_.h2_.data(), &w.w_up}});  // [To, H] x2
  per_token(To, [&](int64_t t0, int64_t t1) { gated_act(c_.act, ws_.h1_.data() + t0 * H, ws_.h2_.data() + t0 * H, (t1 - t0) * H); });
  matmul(pool_, ws_.scratch_, ws_.xb_.data(), ws_.h1_.data(), To, w.w_down);  // [To, D] (partial sum when split)
  if (comm_) comm_->all_reduce_sum(ws_.xb_.data(), To * D);
  if (w.post_ffn_norm) norm_rows(ws_.xb_.data(), w.post_ffn_norm, To);  // pre_post norms
  per_token(To, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * D; i < t1 * D; ++i) x[i] += ws_.xb_[size_t(i)];
  });
}

// Final norm and the output projection for the flagged tokens only (the last layer left their
// rows at the front of x).
const float* ShardPass::final_norm() {
  const int64_t n_logits = plan_.n_logits;
  if (n_logits == 0) return nullptr;
  per_token(n_logits, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm(ws_.xb_.data() + r * D, x_ + r * D, m_.output_norm, D, eps_);
  });
  return ws_.xb_.data();
}

const float* ShardPass::logits() {
  const int64_t n_logits = plan_.n_logits;
  if (!final_norm()) return nullptr;
  const Weight& out_w = shard_ ? shard_->output : m_.output;
  const int64_t NV = R.n_vocab;  // this rank's logit rows
  if (ws_.logits_.size() < size_t(n_logits * NV)) ws_.logits_.resize(size_t(n_logits * NV));
  if (NV > 0) matmul(pool_, ws_.scratch_, ws_.logits_.data(), ws_.xb_.data(), n_logits, out_w);  // [n_logits, NV]
  if (c_.logit_softcap > 0) softcap(ws_.logits_.data(), n_logits * NV, float(c_.logit_softcap));  // Gemma 2: per logit
  if (!comm_) return ws_.logits_.data();
  return gather_logits(n_logits);
}

// Vocab-parallel output: rank 0 gathers every rank's [n_logits, NV_r] block (rank order) and
// interleaves them into rows of [V]; with one flagged token (decode) the concatenation already
// is the row. When rank 0 computes all V rows (output not split) nothing moves.
const float* ShardPass::gather_logits(int64_t n_logits) {
  const int64_t NV = R.n_vocab;
  const bool root = R.rank == 0;
  if (shard_->vocab_bounds[1] == V) return root ? ws_.logits_.data() : nullptr;
  if (root && ws_.gathered_.size() < size_t(n_logits * V)) ws_.gathered_.resize(size_t(n_logits * V));
  comm_->gather(ws_.logits_.data(), n_logits * NV, ws_.gathered_.data(), root ? int64_t(ws_.gathered_.size()) : 0, 0);
  if (!root) return nullptr;
  if (n_logits == 1) return ws_.gathered_.data();
  if (ws_.logits_.size() < size_t(n_logits * V)) ws_.logits_.resize(size_t(n_logits * V));
  float* out = ws_.logits_.data();  // [n_logits, V]
  const float* src = ws_.gathered_.data();
  for (size_t k = 0; k + 1 < shard_->vocab_bounds.size(); ++k) {
    const int64_t v0 = shard_->vocab_bounds[k], nv = shard_->vocab_bounds[k + 1] - v0;
    for (int64_t t = 0; t < n_logits; ++t) std::memcpy(out + t * V + v0, src + t * nv, size_t(nv) * sizeof(float));
    src += n_logits * nv;
  }
  return out;
}

}  // namespace detail

// The forward pass (the CPU's; engine/cuda/session.cpp CudaSession::enqueue is the GPU's):
// embedding, then per layer the attention block and the FFN block, then the logits.
const float* forward_shard(const Model& m, const ModelShard* shard, KVCache& cache, Workspace& ws, ThreadPool& pool,
                           Communicator* comm, const BatchToken* batch, int64_t T, const BatchPlan& plan, int64_t layer_end,
                           Output out) {
  detail::ShardPass pass(m, shard, cache, ws, pool, comm, batch, T, plan);
  pass.embed();
  pass.rope_angles_all();
  const bool hidden_only = layer_end >= 0;  // partial offload: stop after layer_end layers
  const int64_t n_layers = hidden_only ? std::min(layer_end, m.config.n_layers) : m.config.n_layers;
  for (int64_t l = 0; l < n_layers; ++l) {
    const bool last = !hidden_only && l + 1 == m.config.n_layers;
    const int64_t To = pass.attention_block(l, last);
    if (To == 0) break;  // no logits wanted: the last layer's K and V were all it had to write
    pass.ffn_block(l, To);
  }
  if (hidden_only) return pass.residual();  // partial offload: the residual stream [T, D] for the GPU's layers
  return out == Output::Hidden ? pass.final_norm() : pass.logits();
}

// ---------------------------------------------------------------- Session

const float* BatchRunner::forward_hidden(KVCache&, const BatchToken*, int64_t) {
  throw UsageError("hidden states (embeddings) need the CPU forward pass in this process; this runner returns logits only");
}

int32_t SessionBase::forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) {
  return sampler.sample(forward(tokens, n), model().config.vocab_size, history);
}

Session::Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch, int64_t logits_rows, KvType kv_type)
    : m_(model),
      ctx_(session_sizes(model.config, ctx, n_batch).ctx),
      n_batch_(session_sizes(model.config, ctx, n_batch).n_batch),
      own_(std::make_unique<TensorParallel>(model, pool, [&] {
        const int64_t rows = session_sizes(model.config, ctx, n_batch, logits_rows).logits_rows;
        return plan_workspace(model.config, llama_matmuls(model.config, model.file->tensors(), n_batch_, rows), n_batch_, ctx_,
                              rows, pool.size());
      }())),
      tp_(*own_),
      cache_(tp_.make_cache(plan_kv(model.config, ctx_).n_blocks, kKvBlockTokens, kv_type)),
      seq_(cache_.add_sequence()) {}

Session::Session(BatchRunner& tp, int64_t ctx, KvType kv_type)
    : m_(tp.model()),
      ctx_(session_sizes(m_.config, ctx, tp.capacity()).ctx),
      n_batch_(session_sizes(m_.config, ctx, tp.capacity()).n_batch),
      tp_(tp),
      cache_(tp_.make_cache(plan_kv(m_.config, ctx_).n_blocks, kKvBlockTokens, kv_type)),
      seq_(cache_.add_sequence()) {}

Session::~Session() = default;

uint64_t Session::workspace_bytes() const { return tp_.workspace_bytes(); }

const float* Session::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  if (n <= 0) throw UsageError("forward: no tokens");
  if (pos() + n > ctx_)
    throw UsageError("context full: " + std::to_string(pos()) + " + " + std::to_string(n) + " tokens exceed the KV cache of " +
                     std::to_string(ctx_));
  if (all_logits && n > n_batch_) throw UsageError("forward: all_logits needs n <= n_batch");
  cache_.reserve(seq_, pos() + n);
  const float* out = nullptr;
  for_each_chunk(n, n_batch_, [&](int64_t i, int64_t len, bool) {
    batch_.resize(size_t(len));
    for (int64_t j = 0; j < len; ++j) batch_[size_t(j)] = {seq_, tokens[i + j], all_logits || i + j == n - 1};
    out = tp_.forward(cache_, batch_.data(), len);
  });
  return out;
}

}  // namespace llmq
