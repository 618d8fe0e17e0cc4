#include "engine/tp.h"

#include <algorithm>
#include <cstring>

#include "base/error.h"

namespace llmq {

namespace {

std::string tp_prefix(int n) { return "--tp " + std::to_string(n) + ": "; }

// Columns [c0, c0 + n) of W [rows, cols] copied into a buffer the shard owns: W' [rows, n].
// c0 and n must be multiples of the type's block (the caller checked).
Weight copy_columns(ModelShard& s, const Weight& w, int64_t c0, int64_t n) {
  if (c0 == 0 && n == w.cols) return w;  // the whole matrix: use it in place
  const size_t skip = row_bytes(w.type, c0), rb = row_bytes(w.type, n), src_rb = w.row_stride();
  const size_t total = size_t(w.rows) * rb;
  // 64 bytes of slack so the data can start on a cache line.
  s.owned.push_back(std::unique_ptr<uint8_t[]>(new uint8_t[total + 64]));
  uint8_t* base = s.owned.back().get();
  uint8_t* dst = base + (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  for (int64_t r = 0; r < w.rows; ++r) std::memcpy(dst + size_t(r) * rb, w.data + size_t(r) * src_rb + skip, rb);
  s.owned_bytes += total;
  return Weight{w.type, dst, w.rows, n};
}


}  // namespace

std::vector<ShardRanges> plan_shards(const Model& m, int N, const TpOptions& opt) {
  return plan_shards(m.config, m.file->tensors(), N, opt);
}

namespace {
const TensorInfo& tensor(const std::vector<TensorInfo>& tensors, const std::string& name) {
  for (const TensorInfo& t : tensors)
    if (t.name == name) return t;
  throw UsageError("tensor '" + name + "' is missing");
}
}  // namespace

std::vector<ShardRanges> plan_shards(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int N, const TpOptions& opt) {
  if (N < 1) throw UsageError("--tp must be at least 1");
  if (N > c.n_heads)
    throw UsageError(tp_prefix(N) + "the model has " + std::to_string(c.n_heads) +
                     " attention heads and tensor parallelism splits them: at most " + std::to_string(c.n_heads) + " ranks");
  const int64_t group = c.n_heads / c.n_kv_heads, hd = c.head_dim;
  // Row-parallel inputs must be cut on block boundaries of the stored type (32 for Q8_0/Q4_*).
  int64_t a_o = 1, a_d = 1;
  std::string t_o = "f32", t_d = "f32";
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const DType wo = tensor(tensors, layer_tensor(l, "attn_output")).type;
    const DType wd = tensor(tensors, layer_tensor(l, "ffn_down")).type;
    if (dtype_info(wo).block > a_o) a_o = dtype_info(wo).block, t_o = dtype_name(wo);
    if (dtype_info(wd).block > a_d) a_d = dtype_info(wd).block, t_d = dtype_name(wd);
  }
  const int64_t ffn_units = c.hidden_dim / a_d;  // FFN split in whole blocks of W_down's input
  if (N > ffn_units)
    throw UsageError(tp_prefix(N) + "the FFN width " + std::to_string(c.hidden_dim) + " (W_down " + t_d +
                     ") gives at most " + std::to_string(ffn_units) + " ranks");

  std::vector<ShardRanges> out(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    ShardRanges& s = out[size_t(r)];
    s.rank = r, s.n_ranks = N;
    const int64_t h0 = c.n_heads * r / N, h1 = c.n_heads * (r + 1) / N;
    s.head0 = h0, s.n_heads = h1 - h0;
    s.kv_head0 = h0 / group, s.n_kv_heads = (h1 - 1) / group + 1 - s.kv_head0;
    if ((h0 * hd) % a_o != 0)
      throw UsageError(tp_prefix(N) + "rank " + std::to_string(r) + " would start at column " + std::to_string(h0 * hd) +
                       " of the attention output matrix (" + t_o + ", blocks of " + std::to_string(a_o) +
                       "), not on a block boundary; choose a TP size that splits heads x head_dim (" +
                       std::to_string(hd) + ") on multiples of " + std::to_string(a_o));
    const int64_t f0 = ffn_units * r / N, f1 = ffn_units * (r + 1) / N;
    s.ffn0 = f0 * a_d, s.ffn_dim = (r + 1 == N ? c.hidden_dim : f1 * a_d) - s.ffn0;
    if (opt.vocab_parallel) {
      s.vocab0 = c.vocab_size * r / N, s.n_vocab = c.vocab_size * (r + 1) / N - s.vocab0;
      s.embd0 = s.vocab0, s.n_embd = s.n_vocab;
    } else {
      s.vocab0 = 0, s.n_vocab = r == 0 ? c.vocab_size : 0;
      s.embd0 = 0, s.n_embd = c.vocab_size;
    }
  }
  return out;
}

uint64_t shard_weight_bytes(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R) {
  const int64_t hd = c.head_dim, D = c.dim;
  auto rows = [&](const std::string& name, int64_t n) {  // n rows of a [rows, cols] tensor
    const TensorInfo& t = tensor(tensors, name);
    return uint64_t(n) * row_bytes(t.type, t.shape[1]);
  };
  auto cols = [&](const std::string& name, int64_t n) {  // n columns of every row
    const TensorInfo& t = tensor(tensors, name);
    return uint64_t(t.shape[0]) * row_bytes(t.type, n);
  };
  const uint64_t f32 = sizeof(float);
  uint64_t b = rows("token_embd.weight", R.n_embd) + uint64_t(D) * f32;  // + output_norm
  if (!c.tied_embeddings) b += rows("output.weight", R.n_vocab);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    auto name = [&](const char* what) { return layer_tensor(l, what); };
    b += 2 * uint64_t(D) * f32;  // attn_norm, ffn_norm
    b += rows(name("attn_q"), R.n_heads * hd) + rows(name("attn_k"), R.n_kv_heads * hd) + rows(name("attn_v"), R.n_kv_heads * hd);
    b += cols(name("attn_output"), R.n_heads * hd);
    b += rows(name("ffn_gate"), R.ffn_dim) + rows(name("ffn_up"), R.ffn_dim) + cols(name("ffn_down"), R.ffn_dim);
    if (c.attn_qkv_bias) b += uint64_t(R.n_heads + 2 * R.n_kv_heads) * uint64_t(hd) * f32;
    if (c.attn_out_bias) b += uint64_t(D) * f32;
    if (c.qk_norm) b += 2 * uint64_t(hd) * f32;                          // q_norm, k_norm (replicated)
    if (c.norms == NormPlacement::PrePost) b += 2 * uint64_t(D) * f32;  // post norms (replicated)
  }
  return b;
}

uint64_t shard_packed_bytes(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R) {
  const int64_t hd = c.head_dim;
  std::vector<Weight> own;  // shapes only, as make_shard leaves them unpacked
  auto rows = [&](const std::string& name, int64_t r0, int64_t n) {  // weight_rows keeps the model's panels at r0 % 16 == 0
    const TensorInfo& t = tensor(tensors, name);
    if (r0 % 16 != 0 && n > 0) own.push_back(Weight{t.type, nullptr, n, t.shape[1]});
  };
  auto cols = [&](const std::string& name, int64_t c0, int64_t n) {  // copy_columns: a copy unless it is the whole matrix
    const TensorInfo& t = tensor(tensors, name);
    if (!(c0 == 0 && n == t.shape[1])) own.push_back(Weight{t.type, nullptr, t.shape[0], n});
  };
  for (int64_t l = 0; l < c.n_layers; ++l) {
    auto name = [&](const char* what) { return layer_tensor(l, what); };
    rows(name("attn_q"), R.head0 * hd, R.n_heads * hd);
    rows(name("attn_k"), R.kv_head0 * hd, R.n_kv_heads * hd);
    rows(name("attn_v"), R.kv_head0 * hd, R.n_kv_heads * hd);
    cols(name("attn_output"), R.head0 * hd, R.n_heads * hd);
    rows(name("ffn_gate"), R.ffn0, R.ffn_dim);
    rows(name("ffn_up"), R.ffn0, R.ffn_dim);
    cols(name("ffn_down"), R.ffn0, R.ffn_dim);
  }
  rows(c.tied_embeddings ? "token_embd.weight" : "output.weight", R.vocab0, R.n_vocab);
  std::vector<const Weight*> ptrs;
  for (const Weight& w : own) ptrs.push_back(&w);
  return packed_weights_bytes(ptrs);
}

ModelShard make_shard(const Model& m, const std::vector<ShardRanges>& all, int rank, bool pack) {
  const ModelConfig& c = m.config;
  const ShardRanges& R = all.at(size_t(rank));
  const int64_t hd = c.head_dim;
  ModelShard s;
  s.ranges = R;
  for (const ShardRanges& o : all) s.vocab_bounds.push_back(o.vocab0);
  s.vocab_bounds.push_back(all.back().vocab0 + all.back().n_vocab);
  if (all.size() > 1 && all[1].n_vocab == 0) s.vocab_bounds.assign({0, c.vocab_size});  // rank 0 computes all
  s.token_embd = weight_rows(m.token_embd, R.embd0, R.n_embd);
  for (const LayerWeights& w : m.layers) {
    LayerWeights l = w;  // norms (and anything not split) as in the model
    l.wq = weight_rows(w.wq, R.head0 * hd, R.n_heads * hd);
    l.wk = weight_rows(w.wk, R.kv_head0 * hd, R.n_kv_heads * hd);
    l.wv = weight_rows(w.wv, R.kv_head0 * hd, R.n_kv_heads * hd);
    if (w.bq) {  // q/k/v biases follow their weights' rows; bo [dim] is replicated (added after the sum)
      l.bq = w.bq + R.head0 * hd;     // [n_heads * hd]
      l.bk = w.bk + R.kv_head0 * hd;  // [n_kv_heads * hd]
      l.bv = w.bv + R.kv_head0 * hd;  // [n_kv_heads * hd]
    }
    l.wo = copy_columns(s, w.wo, R.head0 * hd, R.n_heads * hd);
    l.w_gate = weight_rows(w.w_gate, R.ffn0, R.ffn_dim);
    l.w_up = weight_rows(w.w_up, R.ffn0, R.ffn_dim);
    l.w_down = copy_columns(s, w.w_down, R.ffn0, R.ffn_dim);
    s.layers.push_back(l);
  }
  s.output_norm = m.output_norm;
  s.output = weight_rows(m.output, R.vocab0, R.n_vocab);
  if (!pack) return s;
  // Pack what the model's packed panels do not cover (the column copies, unaligned row ranges).
  std::vector<Weight*> unpacked;
  for (LayerWeights& l : s.layers)
    for (Weight* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      if (!w->packed) unpacked.push_back(w);
  if (!s.output.packed) unpacked.push_back(&s.output);
  s.packed = pack_weights(unpacked);
  if (all.size() > 1)  // the ranks hold copies: the mapping's pages of these matrices (read back in by the copy) go
    for (const LayerWeights& w : m.layers)
      for (const Weight* src : {&w.wo, &w.w_down}) m.file->release(src->data, uint64_t(src->rows) * src->row_stride());
  return s;
}

WorkspacePlan rank_workspace_plan(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R,
                                  int64_t capacity, int threads) {
  ModelConfig rc = c;  // the rank's widths
  rc.n_heads = R.n_heads, rc.n_kv_heads = R.n_kv_heads, rc.hidden_dim = R.ffn_dim, rc.vocab_size = R.n_vocab;
  std::vector<MatmulUse> uses;
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (const char* what : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
      const DType t = tensor(tensors, layer_tensor(l, what)).type;
      const std::string w = what;
      const int64_t cols = w == "attn_output" ? R.n_heads * c.head_dim : w == "ffn_down" ? R.ffn_dim : c.dim;
      uses.push_back({t, cols, capacity});
    }
  return plan_workspace(rc, uses, capacity, /*max_ctx=*/0, /*logits_rows=*/0, threads);
}

// ---------------------------------------------------------------- TensorParallel

TensorParallel::TensorParallel(const Model& m, ThreadPool& pool, int64_t capacity)
    : m_(m), cap_(std::max<int64_t>(1, capacity)), single_pool_(&pool) {
  const std::vector<ShardRanges> whole{ShardRanges::whole(m.config)};
  shards_.push_back(std::make_unique<ModelShard>(make_shard(m, whole, 0)));
  ws_.push_back(std::make_unique<Workspace>(m, cap_));
}

TensorParallel::TensorParallel(const Model& m, ThreadPool& pool, const WorkspacePlan& plan)
    : m_(m), cap_(plan.capacity), single_pool_(&pool) {
  const std::vector<ShardRanges> whole{ShardRanges::whole(m.config)};
  shards_.push_back(std::make_unique<ModelShard>(make_shard(m, whole, 0)));
  ws_.push_back(std::make_unique<Workspace>(m, plan));
}

TensorParallel::TensorParallel(const Model& m, int n_ranks, int total_threads, int64_t capacity, const TpOptions& opt)
    : m_(m), cap_(std::max<int64_t>(1, capacity)) {
  const std::vector<ShardRanges> plan = plan_shards(m, n_ranks, opt);
  const int N = n_ranks;
  if (total_threads <= 0) total_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int r = 0; r < N; ++r) {
    shards_.push_back(std::make_unique<ModelShard>(make_shard(m, plan, r)));
    pools_.push_back(std::make_unique<ThreadPool>(N == 1 ? total_threads : std::max(1, total_threads / N + (r < total_threads % N))));
    ws_.push_back(std::make_unique<Workspace>(m, rank_workspace_plan(m.config, m.file->tensors(), plan[size_t(r)], cap_,
                                                                      pools_.back()->size())));
  }
  if (N == 1) {  // one rank: its pool is the only pool, no rank thread
    single_pool_ = pools_[0].get();
    return;
  }
  comm_ = std::make_unique<HostCommGroup>(N);
  ranks_ = std::make_unique<ThreadPool>(N);
}

TensorParallel::TensorParallel(const Model& m, int n_ranks, int rank, Communicator& comm, int threads, int64_t capacity,
                               const TpOptions& opt)
    : m_(m), cap_(std::max<int64_t>(1, capacity)), ext_comm_(&comm) {
  if (comm.size() != n_ranks || comm.rank() != rank)
    throw UsageError("tensor parallel: rank " + std::to_string(rank) + " of " + std::to_string(n_ranks) + " given the communicator of rank " +
                     std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
  const std::vector<ShardRanges> plan = plan_shards(m, n_ranks, opt);
  shards_.push_back(std::make_unique<ModelShard>(make_shard(m, plan, rank)));
  pools_.push_back(std::make_unique<ThreadPool>(threads));
  ws_.push_back(std::make_unique<Workspace>(m, rank_workspace_plan(m.config, m.file->tensors(), plan[size_t(rank)], cap_, pools_[0]->size())));
}

TensorParallel::~TensorParallel() = default;

int TensorParallel::threads() const {
  if (single_pool_) return single_pool_->size();
  int n = 0;
  for (const auto& p : pools_) n += p->size();
  return n;
}

int TensorParallel::rank_threads(int r) const { return single_pool_ ? single_pool_->size() : pools_.at(size_t(r))->size(); }

KVCache TensorParallel::make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) {
  std::vector<int64_t> dims;
  for (const auto& s : shards_) dims.push_back(s->ranges.n_kv_heads * m_.config.head_dim);
  return KVCache(m_.config, n_blocks, block_tokens, dims, type);
}

uint64_t TensorParallel::workspace_bytes() const {
  uint64_t n = 0;
  for (const auto& w : ws_) n += w->bytes();
  return n;
}

const float* TensorParallel::forward(KVCache& cache, const BatchToken* batch, int64_t n) { return run(cache, batch, n, Output::Logits); }

const float* TensorParallel::forward_hidden(KVCache& cache, const BatchToken* batch, int64_t n) {
  if (!has_hidden()) return BatchRunner::forward_hidden(cache, batch, n);  // throws
  return run(cache, batch, n, Output::Hidden);
}

const float* TensorParallel::run(KVCache& cache, const BatchToken* batch, int64_t n, Output out) {
  if (single_pool_) return forward_batch(m_, cache, *ws_[0], *single_pool_, batch, n, out);
  if (failed_) throw UsageError("tensor parallel: a rank failed earlier; the ranks cannot continue");
  if (ext_comm_) {  // one rank of a group over processes: the others run the same batch elsewhere
    plan_batch(m_, cache, batch, n, cap_, plan_);
    const float* logits = nullptr;
    try {
      logits = forward_shard(m_, shards_[0].get(), cache, *ws_[0], *pools_[0], ext_comm_, batch, n, plan_);
    } catch (const CommAborted&) {
      failed_ = true;
      throw;
    } catch (...) {
      failed_ = true;
      ext_comm_->abort();  // release the ranks waiting for this one
      throw;
    }
    for (const auto& [seq, end] : plan_.ends) cache.set_length(seq, end);
    return logits;
  }
  if (cache.n_shards() != size()) throw UsageError("tensor parallel: the KV cache was not made for " + std::to_string(size()) + " ranks");
  plan_batch(m_, cache, batch, n, cap_, plan_);  // validates before any rank starts
  const float* logits = nullptr;
  try {
    ranks_->parallel_for(size(), [&](int64_t r0, int64_t, int) {
      const int r = int(r0);
      try {
        const float* res = forward_shard(m_, shards_[size_t(r)].get(), cache, *ws_[size_t(r)], *pools_[size_t(r)],
                                         &comm_->rank(r), batch, n, plan_, -1, out);
        if (r == 0) logits = res;
      } catch (const CommAborted&) {
        throw;
      } catch (...) {
        comm_->rank(r).abort();  // release the ranks waiting for this one
        throw;
      }
    });
  } catch (...) {
    failed_ = true;
    throw;
  }
  for (const auto& [seq, end] : plan_.ends) cache.set_length(seq, end);
  return logits;
}

std::string tp_signature(const Model& m, int tp) {
  const ModelConfig& c = m.config;
  return "model of " + std::to_string(m.file->file_size()) + " bytes (" + m.weight_type() + ", " + std::to_string(c.n_layers) + " layers, dim " +
         std::to_string(c.dim) + ", vocab " + std::to_string(c.vocab_size) + "), --tp " + std::to_string(tp);
}

}  // namespace llmq
