// The GPU forward pass (engine/cuda/session.h): upload, buffers, and the layer loop.
#include "engine/cuda/session.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>

#include "engine/cuda/attention.h"
#include "engine/cuda/ops.h"
#include "engine/cuda/sampling.h"
#include "engine/sampler.h"
#include "engine/mem_plan.h"
#include "engine/tp.h"
#include "base/error.h"

namespace llmq::cuda {

// ---------------------------------------------------------------- CudaModel

namespace {

constexpr uint64_t kAlign = 256;  // every tensor starts on a 256-byte boundary

uint64_t aligned(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

CudaModel::CudaModel(const Model& m, bool progress, int64_t first_layer) : c_(m.config), first_layer_(first_layer) {
  if (first_layer < 0 || first_layer > c_.n_layers)
    throw UsageError("CUDA: first GPU layer " + std::to_string(first_layer) + " of a model of " + std::to_string(c_.n_layers) + " layers");
  build(&m, nullptr, DType::F32, 0, progress);
}

CudaModel::CudaModel(const Model& m, const ModelShard& shard, bool progress) : c_(m.config) {
  const ShardRanges& R = shard.ranges;
  const int64_t group = m.config.n_heads / m.config.n_kv_heads;
  if (R.head0 % group != 0 || R.n_heads % group != 0)  // an uneven GQA split: attention maps the heads (GqaSlice)
    gqa_ = {group, R.head0 - R.kv_head0 * group};
  if (R.n_embd != m.config.vocab_size) throw UsageError("CUDA tensor parallelism: the embedding must be replicated");
  c_ = rank_config(m.config, R);
  build(&m, &shard, DType::F32, 0, progress);
}

CudaModel::CudaModel(const ModelConfig& c, DType type, uint64_t seed) : c_(c) { build(nullptr, nullptr, type, seed, false); }

// What CudaModel::build uploads, in two passes: first every tensor gets its offset in one
// allocation (a job), then the allocation is made and each job uploads (or, synthetic,
// generates) its tensor.
struct UploadPlan {
  struct MatJob {
    uint64_t off;
    DType type;
    int64_t rows, cols;
    std::vector<Weight> parts;  // host model: the matrices whose rows are stacked (file layout)
    DeviceWeight* dst;
  };
  struct VecJob {
    uint64_t off;
    std::vector<std::pair<const float*, int64_t>> parts;  // host vectors stacked; empty: all ones
    int64_t n;
    const float** dst;
  };
  std::vector<MatJob> mats;
  std::vector<VecJob> vecs;
  uint64_t total = 0;

  uint64_t take(uint64_t bytes) {
    const uint64_t off = total;
    total += aligned(bytes);
    return off;
  }
  void mat(DeviceWeight* dst, DType t, int64_t rows, int64_t cols, std::vector<Weight> parts) {
    if (t != DType::F32 && t != DType::F16 && t != DType::BF16 && !row_fits(t, cols))
      throw UsageError("CUDA: a matrix of " + std::to_string(cols) + " columns cannot be " + dtype_name(t));
    mats.push_back({take(split_weight_bytes(t, rows, cols)), t, rows, cols, std::move(parts), dst});
  }
  void vec(const float** dst, int64_t n, std::vector<std::pair<const float*, int64_t>> parts) {
    vecs.push_back({take(uint64_t(n) * 4), std::move(parts), n, dst});
  }
  // Matrices of one type stacked into one matrix (one view), or kept apart (one each).
  void stacked(std::vector<DeviceWeight>& views, const std::vector<const Weight*>& ws, int64_t cols) {
    bool same = true;
    for (const Weight* w : ws) same = same && w->type == ws[0]->type;
    if (same) {
      views.resize(1);
      int64_t rows = 0;
      std::vector<Weight> parts;
      for (const Weight* w : ws) rows += w->rows, parts.push_back(*w);
      mat(&views[0], ws[0]->type, rows, cols, parts);
      return;
    }
    views.resize(ws.size());
    for (size_t i = 0; i < ws.size(); ++i) mat(&views[i], ws[i]->type, ws[i]->rows, cols, {*ws[i]});
  }
};

namespace {

// Uploads a matrix job's host rows in the split layout (matmul.h). Returns its bytes.
uint64_t upload_matrix(const UploadPlan::MatJob& j, uint8_t* base, std::vector<uint8_t>& file_rows, std::vector<uint8_t>& split) {
  const size_t rb = row_bytes(j.type, j.cols), bytes = size_t(j.rows) * rb;
  file_rows.resize(bytes);
  size_t at = 0;
  for (const Weight& w : j.parts) {
    std::memcpy(file_rows.data() + at, w.data, size_t(w.rows) * rb);
    at += size_t(w.rows) * rb;
  }
  split.resize(split_weight_bytes(j.type, j.rows, j.cols));
  split_weight(j.type, file_rows.data(), j.rows, j.cols, split.data());
  check(cudaMemcpy(base + j.off, split.data(), split.size(), cudaMemcpyHostToDevice), "cudaMemcpy (weights)");
  return split.size();
}

}  // namespace

// The jobs of a host model (or a tensor-parallel shard: its slices, the config its widths).
void CudaModel::plan_host(UploadPlan& u, const Model& m, const ModelShard* shard) {
  const ModelConfig& c = c_;
  const int64_t D = c.dim, Q = c.n_heads * c.head_dim, KV = c.n_kv_heads * c.head_dim, H = c.hidden_dim, V = c.vocab_size;
  const std::vector<LayerWeights>& src = shard ? shard->layers : m.layers;
  const Weight& out = shard ? shard->output : m.output;
  if (first_layer_ == 0 || c.tied_embeddings) u.mat(&token_embd, m.token_embd.type, V, D, {m.token_embd});
  for (int64_t i = first_layer_; i < c.n_layers; ++i) {
    const LayerWeights& l = src[size_t(i)];
    DeviceLayer& d = layers[size_t(i - first_layer_)];
    u.vec(&d.attn_norm, D, {{l.attn_norm, D}});
    u.stacked(d.qkv, {&l.wq, &l.wk, &l.wv}, D);
    if (l.bq) u.vec(&d.bqkv, Q + 2 * KV, {{l.bq, Q}, {l.bk, KV}, {l.bv, KV}});
    u.mat(&d.wo, l.wo.type, D, Q, {l.wo});
    if (l.bo) u.vec(&d.bo, D, {{l.bo, D}});
    if (l.q_norm) u.vec(&d.q_norm, c.head_dim, {{l.q_norm, c.head_dim}}), u.vec(&d.k_norm, c.head_dim, {{l.k_norm, c.head_dim}});
    if (l.post_attn_norm) u.vec(&d.post_attn_norm, D, {{l.post_attn_norm, D}});
    u.vec(&d.ffn_norm, D, {{l.ffn_norm, D}});
    u.stacked(d.gate_up, {&l.w_gate, &l.w_up}, D);
    u.mat(&d.w_down, l.w_down.type, D, H, {l.w_down});
    if (l.post_ffn_norm) u.vec(&d.post_ffn_norm, D, {{l.post_ffn_norm, D}});
  }
  u.vec(&output_norm, D, {{m.output_norm, D}});
  if (!c.tied_embeddings && out.rows > 0) u.mat(&output, out.type, out.rows, D, {out});  // rank 0's, under TP
}

// The jobs of a synthetic model: every matrix of `type`, norms of ones.
void CudaModel::plan_synthetic(UploadPlan& u, DType type) {
  const ModelConfig& c = c_;
  const int64_t D = c.dim, Q = c.n_heads * c.head_dim, KV = c.n_kv_heads * c.head_dim, H = c.hidden_dim, V = c.vocab_size;
  u.mat(&token_embd, type, V, D, {});
  for (DeviceLayer& d : layers) {
    u.vec(&d.attn_norm, D, {});
    d.qkv.resize(1);
    u.mat(&d.qkv[0], type, Q + 2 * KV, D, {});
    u.mat(&d.wo, type, D, Q, {});
    if (c.qk_norm) u.vec(&d.q_norm, c.head_dim, {}), u.vec(&d.k_norm, c.head_dim, {});
    if (c.norms == NormPlacement::PrePost) u.vec(&d.post_attn_norm, D, {}), u.vec(&d.post_ffn_norm, D, {});
    u.vec(&d.ffn_norm, D, {});
    d.gate_up.resize(1);
    u.mat(&d.gate_up[0], type, 2 * H, D, {});
    u.mat(&d.w_down, type, D, H, {});
  }
  u.vec(&output_norm, D, {});
  if (!c.tied_embeddings) u.mat(&output, type, V, D, {});
}

void CudaModel::build(const Model* m, const ModelShard* shard, DType type, uint64_t seed, bool progress) {
  layers.resize(size_t(c_.n_layers - first_layer_));
  UploadPlan u;
  if (m) plan_host(u, *m, shard);
  else plan_synthetic(u, type);
  const std::vector<double> freqs = c_.rope_freq_tables();  // [tables, hd/2], at the end of the allocation
  const uint64_t rope_off = u.take(freqs.size() * sizeof(double));
  const uint64_t free0 = mem_info().free;
  buf_ = DeviceBuffer(u.total);
  measured_ = free0 - mem_info().free;
  uint8_t* base = buf_.as<uint8_t>();
  rope_ = reinterpret_cast<const double*>(base + rope_off);
  check(cudaMemcpy(base + rope_off, freqs.data(), freqs.size() * sizeof(double), cudaMemcpyHostToDevice), "cudaMemcpy (RoPE)");
  std::vector<uint8_t> file_rows, split;
  uint64_t done = 0, shown = 0, k = 0;
  for (UploadPlan::MatJob& j : u.mats) {
    *j.dst = split_weight_view(j.type, j.rows, j.cols, base + j.off);
    if (!m) {
      fill_random(*j.dst, seed * 1000003 + k++, nullptr);
      continue;
    }
    done += upload_matrix(j, base, file_rows, split);
    if (progress && (done - shown) * 20 >= u.total) {
      shown = done;
      std::fprintf(stderr, "\rllmq: uploading weights to the GPU: %3d%%", int(100 * done / std::max<uint64_t>(u.total, 1)));
    }
  }
  if (progress && shown) std::fprintf(stderr, "\rllmq: uploading weights to the GPU: 100%%\n");
  for (UploadPlan::VecJob& j : u.vecs) {
    auto* p = reinterpret_cast<float*>(base + j.off);
    *j.dst = p;
    std::vector<float> host(size_t(j.n), 1.0f);
    size_t at = 0;
    for (const auto& [src, n] : j.parts) std::copy(src, src + n, host.begin() + ptrdiff_t(at)), at += size_t(n);
    check(cudaMemcpy(p, host.data(), host.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy (vectors)");
  }
  if (c_.tied_embeddings && (!shard || shard->output.rows > 0)) output = token_embd;
  check(cudaDeviceSynchronize(), "upload");
}

// ---------------------------------------------------------------- CudaSession


CudaSession::CudaSession(const CudaModel& dm, const Model* m, int64_t ctx, int64_t n_batch, int64_t logits_rows)
    : CudaSession(dm, m, plan_cuda(dm.config(), {}, ctx, n_batch, logits_rows)) {}

// Every size comes from the plan (engine/mem_plan.h plan_cuda), which llmq-mem reports.
CudaSession::CudaSession(const CudaModel& dm, const Model* m, const CudaPlan& p) : dm_(dm), m_(m), plan_(p) {
  const ModelConfig& c = dm.config();
  if (p.first_layer != dm.first_layer()) throw UsageError("CUDA: the session's plan starts at another layer than the model upload");
  const int64_t D = c.dim, hd = c.head_dim, Q = c.n_heads * hd, H = c.hidden_dim;
  if (hd > kMaxHeadDim || hd % 2) throw UsageError("CUDA: head_dim " + std::to_string(hd) + " is not supported (even, at most 256)");
  const int64_t group = dm.gqa().group ? dm.gqa().group : c.n_heads / c.n_kv_heads;  // a rank's uneven GQA slice: the model's group
  if ((!dm.gqa().group && c.n_heads % c.n_kv_heads) || group > 32)
    throw UsageError("CUDA: n_heads must be a multiple of n_kv_heads, at most 32 times it");
  const char* g = std::getenv("LLMQ_CUDA_GRAPH");
  use_graphs_ = !(g && std::string(g) == "0");
  skip_ = parse_skip(std::getenv("LLMQ_CUDA_SKIP"));

  const uint64_t free0 = mem_info().free;
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  kv_ = DeviceBuffer(p.kv);
  tokens_ = DeviceBuffer(p.tokens);
  pos_buf_ = DeviceBuffer(p.tokens);
  next_ = DeviceBuffer(4);
  topk_ids_ = DeviceBuffer(p.top_k);
  topk_vals_ = DeviceBuffer(p.top_k);
  x_ = DeviceBuffer(p.x);
  xb_ = DeviceBuffer(p.x);
  qkv_ = DeviceBuffer(p.qkv);
  att_ = DeviceBuffer(p.att);
  h_ = DeviceBuffer(p.h);
  hs_ = DeviceBuffer(p.hs);
  logits_ = DeviceBuffer(p.logits);
  partial_ = DeviceBuffer(p.attn_parts);
  if (p.paging) paging_ = DeviceBuffer(p.paging);
  mm_ = std::make_unique<MatmulContext>(plan_.n_batch, std::max({D, Q, H}), stream_, cuda_matmul_max_rows(c));
  attention_prepare(c.n_heads, c.n_kv_heads, c.head_dim);  // before any graph capture
  measured_ = free0 - mem_info().free;
  h_tokens_ = PinnedBuffer(p.tokens);
  h_pos_ = PinnedBuffer(p.tokens);
  h_next_ = PinnedBuffer(4);
  h_topk_ids_ = PinnedBuffer(p.top_k);
  h_topk_vals_ = PinnedBuffer(p.top_k);
  h_logits_ = PinnedBuffer(p.logits);
  if (p.paging) h_paging_ = PinnedBuffer(p.paging);
  if (p.first_layer > 0) h_hidden_ = PinnedBuffer(size_t(plan_.n_batch * D) * 4);
}

CudaSession::~CudaSession() {
  if (graph_logits_) cudaGraphExecDestroy(graph_logits_);
  if (graph_greedy_) cudaGraphExecDestroy(graph_greedy_);
  if (graph_topk_) cudaGraphExecDestroy(graph_topk_);
  for (cudaGraphExec_t g : batch_graphs_)
    if (g) cudaGraphExecDestroy(g);
  mm_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

const Model& CudaSession::model() const {
  if (!m_) throw UsageError("a synthetic CUDA session has no host model");
  return *m_;
}

void CudaSession::truncate(int64_t n) {
  if (n < 0 || n > pos_) throw UsageError("truncate: " + std::to_string(n) + " is past the cached " + std::to_string(pos_));
  pos_ = n;
}

uint64_t CudaSession::workspace_bytes() const {
  return tokens_.bytes() + pos_buf_.bytes() + next_.bytes() + topk_ids_.bytes() + topk_vals_.bytes() + paging_.bytes() + x_.bytes() +
         xb_.bytes() + qkv_.bytes() + att_.bytes() + h_.bytes() + hs_.bytes() + logits_.bytes() + partial_.bytes() + mm_->bytes();
}

void CudaSession::check_tokens(const int32_t* tokens, int64_t n) const {
  if (n <= 0) throw UsageError("forward: no tokens");
  if (pos_ + n > plan_.ctx)
    throw UsageError("context full: " + std::to_string(pos_) + " + " + std::to_string(n) + " tokens exceed the KV cache of " +
                     std::to_string(plan_.ctx));
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= dm_.config().vocab_size) throw UsageError("token id " + std::to_string(tokens[i]) + " out of range");
}

void CudaSession::stage(const int32_t* tokens, int64_t n) {
  std::memcpy(h_tokens_.as<int32_t>(), tokens, size_t(n) * 4);
  for (int64_t i = 0; i < n; ++i) h_pos_.as<int32_t>()[i] = int32_t(pos_ + i);
}

void CudaSession::mark(const char* op) {  // --profile: the time since the last mark is op's
  if (prof_) prof_->mark(op);
}

// LLMQ_CUDA_SKIP=norm,rope_kv,attention,gated_act,matmul: a timing experiment only, the output is
// wrong. The layers' ops of the named classes are not launched (matmul: the layers' products, not
// the output's), and what a skipped op would have quantized for the next product counts as
// quantized, so a graphed decode step's time without them tells what each costs inside the graph
// with programmatic launch, where --profile's events (ungraphed) cannot look. Bits of SkipOp;
// throws UsageError for a name not in the list.
unsigned CudaSession::parse_skip(const char* list) {
  static const char* const kNames[] = {"norm", "rope_kv", "attention", "gated_act", "matmul"};  // bit i: SkipOp 1 << i
  unsigned mask = 0;
  std::stringstream ss(list ? list : "");
  for (std::string item; std::getline(ss, item, ',');) {
    const auto* it = std::find_if(std::begin(kNames), std::end(kNames), [&](const char* n) { return item == n; });
    if (it == std::end(kNames)) throw UsageError("LLMQ_CUDA_SKIP: unknown op class '" + item + "' (norm, rope_kv, attention, gated_act, matmul)");
    mask |= 1u << (it - std::begin(kNames));
  }
  return mask;
}

// The pass's inputs to the device: token ids and positions; paged: per token its cache row and
// its sequence's row of the block tables, and the logits rows.
CudaSession::PassInputs CudaSession::stage_inputs(int64_t T, bool paged) {
  PassInputs in;
  in.tok = tokens_.as<int32_t>(), in.pos = pos_buf_.as<int32_t>();
  check(cudaMemcpyAsync(tokens_.get(), h_tokens_.get(), size_t(T) * 4, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (tokens)");
  check(cudaMemcpyAsync(pos_buf_.get(), h_pos_.get(), size_t(T) * 4, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (positions)");
  if (paged) {
    check(cudaMemcpyAsync(paging_.get(), h_paging_.get(), paging_.bytes(), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (block tables)");
    const auto* base = paging_.as<int32_t>();
    in.kv_row = base;
    in.pages = {base + plan_.n_batch, base + 2 * plan_.n_batch, plan_.table_stride, plan_.block_tokens};
    in.out_rows = in.pages.tables + plan_.parallel * plan_.table_stride;
  }
  return in;
}

// out = RMSNorm(x (+= y when y)) with weights w; when the product that reads out takes int8
// inputs (`next`), the norm quantizes out as it writes it (one pass instead of two) and tells
// the matmul context so.
void CudaSession::norm_for(const DeviceWeight& next, float* x, const float* y, float* out, const float* w, int64_t T) {
  const int64_t D = dm_.config().dim;
  const float eps = float(dm_.config().norm_eps);
  const DeviceActQ8* q = mm_->fusable(next, T, D);
  if (skip(kSkipNorm)) {
    if (q) mm_->note_quantized(out, T, D);
    return;
  }
  if (y) add_rmsnorm(x, y, out, w, T, D, eps, stream_, q);
  else rmsnorm(out, x, w, T, D, eps, stream_, q);
  if (q) mm_->note_quantized(out, T, D);
  mark("norm");
}

// Layer l's K and V in the cache: fp16 [rows, KV] each, or (CudaPlan::kv_q8) int8 [rows, KV] with
// fp16 scales [rows, KV/32] each (kc, vc null then).
CudaSession::LayerKv CudaSession::layer_kv(int64_t l) {
  const int64_t KV = dm_.config().n_kv_heads * dm_.config().head_dim;
  LayerKv kv;
  if (!plan_.kv_q8) {
    const size_t layer = size_t(plan_.kv_rows) * size_t(KV);  // fp16 elements of one layer's K (or V)
    kv.kc = kv_.as<uint16_t>() + size_t(2 * l) * layer, kv.vc = kv.kc + layer;
    return kv;
  }
  const size_t q_bytes = size_t(plan_.kv_rows) * size_t(KV), half_layer = q_bytes + q_bytes / 32 * 2;
  uint8_t* base = kv_.as<uint8_t>() + size_t(2 * l) * half_layer;
  kv.q8 = {reinterpret_cast<int8_t*>(base), reinterpret_cast<uint16_t*>(base + q_bytes), reinterpret_cast<int8_t*>(base + half_layer),
           reinterpret_cast<uint16_t*>(base + half_layer + q_bytes)};
  return kv;
}

// Matrices written side by side into one output [T, ld] (Q/K/V, gate/up), each at its column.
void CudaSession::matmul_cols(const std::vector<DeviceWeight>& ws, const float* in, float* y, int64_t ld, int64_t T) {
  if (skip(kSkipMatmul)) return;
  int64_t col = 0;
  mm_->hold_input(in);  // converted to 16 bits once for all of them (prefill)
  for (const DeviceWeight& w : ws) matmul(*mm_, w, in, y + col, T, ld), col += w.rows;
  mm_->release_input();
}

// Attention block of layer l on xb = RMSNorm(x): qkv = xb · [Wq; Wk; Wv]ᵀ (+ biases), RoPE on q
// and k, k and v to the cache, attention, xb = att · Woᵀ (all-reduced under TP, + bias).
// Shapes: Q = n_heads · hd, KV = n_kv · hd, D = dim.
void CudaSession::attention_block(int64_t l, int64_t T, const PassInputs& in) {
  const ModelConfig& c = dm_.config();
  const DeviceLayer& w = dm_.layers[size_t(l)];
  const int64_t D = c.dim, hd = c.head_dim, Q = c.n_heads * hd, KV = c.n_kv_heads * hd, QKV = Q + 2 * KV;
  const float scale = c.softmax_scale();
  float *xb = xb_.as<float>(), *qkv = qkv_.as<float>(), *att = att_.as<float>();
  const LayerKv kv = layer_kv(l);
  matmul_cols(w.qkv, xb, qkv, QKV, T);  // qkv [T, Q + 2KV]
  mark("matmul_qkv");
  if (w.bqkv) add_bias(qkv, QKV, w.bqkv, T, QKV, stream_), mark("bias");
  if (w.q_norm) head_rmsnorm(qkv, QKV, T, c.n_heads, c.n_kv_heads, hd, w.q_norm, w.k_norm, float(c.norm_eps), stream_), mark("qk_norm");
  const double* freqs = dm_.rope_freqs(dm_.first_layer() + l);  // by the model's layer index (offload holds the last ones)
  const int64_t window = c.window(dm_.first_layer() + l);  // 0, or a sliding-window layer's
  if (!skip(kSkipRopeKv))
    rope_store_kv(qkv, QKV, in.pos, in.kv_row, T, c.n_heads, c.n_kv_heads, hd, freqs, c.rope_layout, kv.kc, kv.vc, stream_);
  if (kv.q8.kq)
    store_kv_q8(qkv, QKV, in.pos, in.kv_row, T, c.n_heads, c.n_kv_heads, hd, const_cast<int8_t*>(kv.q8.kq), const_cast<uint16_t*>(kv.q8.kd),
                const_cast<int8_t*>(kv.q8.vq), const_cast<uint16_t*>(kv.q8.vd), stream_);
  mark("rope_kv");
  // Decode (one token, or one per sequence of a paged batch): flash-decoding parts, a fixed
  // count (graph-safe), whose merge also quantizes att for W_o when it takes int8 inputs; else
  // every position in one part.
  if (skip(kSkipAttention)) {
    if (mm_->fusable(w.wo, T, Q)) mm_->note_quantized(att, T, Q);
  } else if (T <= std::max<int64_t>(1, plan_.parallel) && plan_.decode_parts > 1) {
    const DeviceActQ8* q = mm_->fusable(w.wo, T, Q);
    if (attention(qkv, QKV, kv.kc, kv.vc, in.pos, T, c.n_heads, c.n_kv_heads, hd, scale, plan_.decode_parts, plan_.decode_part_len,
                  partial_.as<float>(), att, Q, stream_, in.pages, kv.q8, dm_.gqa(), q, window))
      mm_->note_quantized(att, T, Q);
  } else {
    attention(qkv, QKV, kv.kc, kv.vc, in.pos, T, c.n_heads, c.n_kv_heads, hd, scale, 1, (plan_.ctx + 31) / 32 * 32, nullptr, att, Q,
              stream_, in.pages, kv.q8, dm_.gqa(), nullptr, window);  // att [T, Q]
  }
  mark("attention");
  if (!skip(kSkipMatmul)) matmul(*mm_, w.wo, att, xb, T);  // xb [T, D] (a partial sum under TP)
  mark("matmul_o");
  if (comm_) all_reduce(xb, T * D), mark("all_reduce");
  if (w.bo) add_bias(xb, D, w.bo, T, D, stream_), mark("bias");
  if (w.post_attn_norm) rmsnorm(xb, xb, w.post_attn_norm, T, D, float(c.norm_eps), stream_), mark("norm");  // pre_post norms
}

// FFN block of layer l on xb = RMSNorm(x): xb = W_down · (act(xb · W_gateᵀ) ⊙ (xb · W_upᵀ))
// (all-reduced under TP; then its post norm with pre_post norms). Shapes: H = hidden.
void CudaSession::ffn_block(int64_t l, int64_t T) {
  const DeviceLayer& w = dm_.layers[size_t(l)];
  const int64_t D = dm_.config().dim, H = dm_.config().hidden_dim;
  float *xb = xb_.as<float>(), *h = h_.as<float>(), *hs = hs_.as<float>();
  matmul_cols(w.gate_up, xb, h, 2 * H, T);  // h [T, 2H]
  mark("matmul_gate_up");
  const DeviceActQ8* q = mm_->fusable(w.w_down, T, H);
  if (!skip(kSkipGatedAct)) gated_act(dm_.config().act, hs, h, T, H, stream_, q);  // hs [T, H], quantized for W_down when it takes int8 inputs
  if (q) mm_->note_quantized(hs, T, H);
  mark("gated_act");
  if (!skip(kSkipMatmul)) matmul(*mm_, w.w_down, hs, xb, T);  // xb [T, D] (a partial sum under TP)
  mark("matmul_down");
  if (comm_) all_reduce(xb, T * D), mark("all_reduce");
  if (w.post_ffn_norm) rmsnorm(xb, xb, w.post_ffn_norm, T, D, float(dm_.config().norm_eps), stream_), mark("norm");  // pre_post norms
}

// Logits of rows [r0, r0 + rows) of xb (paged: the flagged tokens', gathered) and what `out`
// copies back: the logits, the greedy token, or the top-k candidates.
void CudaSession::output(int64_t r0, int64_t rows, Out out, const PassInputs& in) {
  const int64_t D = dm_.config().dim, V = dm_.config().vocab_size;
  float *x = x_.as<float>(), *xb = xb_.as<float>(), *logits = logits_.as<float>();
  const float* final_rows = xb + r0 * D;
  if (in.out_rows) {  // paged: the flagged tokens' rows, gathered into x (the residual is spent)
    gather_rows(x, xb, in.out_rows, rows, D, stream_);  // x [rows, D]
    final_rows = x;
  }
  matmul(*mm_, dm_.output, final_rows, logits, rows);  // logits [rows, V]
  mark("matmul_output");
  if (const double cap = dm_.config().logit_softcap; cap > 0) softcap(logits, rows * V, float(cap), stream_), mark("softcap");
  cudaStream_t s = stream_;
  if (out == Out::Greedy) {
    argmax(logits, V, next_.as<int32_t>(), s);
    check(cudaMemcpyAsync(h_next_.get(), next_.get(), 4, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (token)");
  } else if (out == Out::TopK) {
    top_k(logits, V, top_k_, topk_ids_.as<int32_t>(), topk_vals_.as<float>(), s);
    check(cudaMemcpyAsync(h_topk_ids_.get(), topk_ids_.get(), size_t(top_k_) * 4, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (top-k)");
    check(cudaMemcpyAsync(h_topk_vals_.get(), topk_vals_.get(), size_t(top_k_) * 4, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (top-k)");
  } else {
    check(cudaMemcpyAsync(h_logits_.get(), logits, size_t(rows * V) * 4, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (logits)");
  }
  mark("sampling");
}

// The GPU forward pass (the CPU's is forward_shard, engine/model.cpp): the inputs staged, the
// embedding (or the CPU layers' residual stream), the first norm, then per layer the attention
// block, the residual add with the FFN norm, the FFN block and the residual add with the next
// norm; then the output. Shapes: T tokens, D = dim.
void CudaSession::enqueue(int64_t T, int64_t r0, int64_t rows, Out out, bool paged) {
  const int64_t D = dm_.config().dim;
  float *x = x_.as<float>(), *xb = xb_.as<float>();
  if (prof_) prof_->begin(stream_);
  const PassInputs in = stage_inputs(T, paged);
  const auto n_layers = int64_t(dm_.layers.size());  // all, or the last ones (partial offload)
  if (h_hidden_.bytes())  // partial offload: the CPU's layers left the residual stream in h_hidden_
    check(cudaMemcpyAsync(x, h_hidden_.get(), size_t(T * D) * 4, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (hidden state)");
  else
    embedding(x, dm_.token_embd, in.tok, T, stream_, dm_.config().embedding_multiplier());  // x [T, D]
  mark("embedding");
  mm_->clear_note();
  auto next_input = [&](int64_t l) -> const DeviceWeight& { return l < n_layers ? dm_.layers[size_t(l)].qkv[0] : dm_.output; };
  auto attn_norm = [&](int64_t l) { return l < n_layers ? dm_.layers[size_t(l)].attn_norm : dm_.output_norm; };
  norm_for(next_input(0), x, nullptr, xb, attn_norm(0), T);  // xb [T, D]
  for (int64_t l = 0; l < n_layers; ++l) {
    attention_block(l, T, in);
    norm_for(dm_.layers[size_t(l)].gate_up[0], x, xb, xb, dm_.layers[size_t(l)].ffn_norm, T);  // x += xb; xb = RMSNorm(x)
    ffn_block(l, T);
    norm_for(next_input(l + 1), x, xb, xb, attn_norm(l + 1), T);  // x += xb; xb = RMSNorm(x) for what follows
  }
  if (rows > 0 && out != Out::None && dm_.output.rows > 0) output(r0, rows, out, in);  // none on a rank other than 0
  if (prof_) prof_->end();
}

void CudaSession::launch(cudaGraphExec_t& exec, const std::function<void()>& enqueue_fn) {
  if (!use_graphs_ || prof_) return enqueue_fn();
  if (!exec) {  // capture once: every pointer is fixed, the inputs are copied from pinned memory at replay
    check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    cudaGraph_t graph = nullptr;
    try {
      enqueue_fn();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    check(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check(e, "cudaGraphInstantiate");
  }
  check(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
}

void CudaSession::run_decode(Out out) {
  launch(out == Out::Greedy ? graph_greedy_ : out == Out::TopK ? graph_topk_ : graph_logits_, [&] { enqueue(1, 0, 1, out); });
  check(cudaStreamSynchronize(stream_), "decode step");
}

const float* CudaSession::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  check_tokens(tokens, n);
  if (all_logits && n > plan_.logits_rows)
    throw UsageError("forward: all_logits for " + std::to_string(n) + " tokens, the session keeps " + std::to_string(plan_.logits_rows));
  for_each_chunk(n, plan_.n_batch, [&](int64_t i, int64_t len, bool last) {
    stage(tokens + i, len);
    if (len == 1 && !all_logits) {
      run_decode(Out::Logits);
    } else {
      enqueue(len, all_logits ? 0 : len - 1, all_logits ? len : (last ? 1 : 0), Out::Logits);
      check(cudaStreamSynchronize(stream_), "forward");
    }
    pos_ += len;
  });
  return h_logits_.as<float>();
}

int32_t CudaSession::decode_greedy(int32_t token) {
  check_tokens(&token, 1);
  stage(&token, 1);
  run_decode(Out::Greedy);
  ++pos_;
  return *h_next_.as<int32_t>();
}

int32_t CudaSession::forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) {
  const int64_t V = dm_.config().vocab_size;
  const int64_t k = std::min<int64_t>(sampler.top_k(), V);
  if (n == 1 && sampler.greedy()) return decode_greedy(tokens[0]);
  if (n != 1 || !sampler.top_k_suffices() || k > kMaxTopK) return sampler.sample(forward(tokens, n), V, history);
  check_tokens(tokens, 1);
  if (graph_topk_ && top_k_ != int(k)) {  // the graph holds k: capture again for another
    cudaGraphExecDestroy(graph_topk_);
    graph_topk_ = nullptr;
  }
  top_k_ = int(k);
  stage(tokens, 1);
  run_decode(Out::TopK);
  ++pos_;
  return sampler.sample_top(h_topk_ids_.as<int32_t>(), h_topk_vals_.as<float>(), k);
}

void CudaSession::prefill(const int32_t* tokens, int64_t n) {
  check_tokens(tokens, n);
  if (n > plan_.n_batch) throw UsageError("prefill: more tokens than n_batch");
  stage(tokens, n);
  enqueue(n, 0, 0, Out::None);
  check(cudaStreamSynchronize(stream_), "prefill");
  pos_ += n;
}

const float* CudaSession::forward_batch(KVCache& tables, const BatchToken* batch, int64_t T, bool advance) {
  if (plan_.parallel == 0) throw UsageError("forward_batch: this CUDA session holds one sequence (make it from plan_cuda_server)");
  if (tables.n_blocks() != plan_.kv_blocks || tables.block_tokens() != plan_.block_tokens)
    throw UsageError("forward_batch: the block tables were not made for this session's cache");
  plan_batch(dm_.config(), tables, batch, T, plan_.n_batch, bplan_);
  if (bplan_.n_logits > plan_.logits_rows)
    throw UsageError("forward_batch: logits for " + std::to_string(bplan_.n_logits) + " tokens, the session keeps " +
                     std::to_string(plan_.logits_rows));
  // Stage tokens, positions, cache rows, per-token table rows, the tables and the logits rows.
  auto* rows = h_paging_.as<int32_t>();
  int32_t* seq_row = rows + plan_.n_batch;
  int32_t* tab = seq_row + plan_.n_batch;
  int32_t* out = tab + plan_.parallel * plan_.table_stride;
  std::vector<int32_t> seqs;  // the batch's sequences in order of first appearance
  const int64_t bt = plan_.block_tokens;
  for (int64_t i = 0; i < T; ++i) {
    const int32_t seq = batch[i].seq;
    auto it = std::find(seqs.begin(), seqs.end(), seq);
    if (it == seqs.end()) {
      if (int64_t(seqs.size()) == plan_.parallel)
        throw UsageError("forward_batch: more than " + std::to_string(plan_.parallel) + " sequences in one batch");
      const std::vector<int32_t>& blocks = tables.blocks(seq);
      if (int64_t(blocks.size()) > plan_.table_stride)
        throw UsageError("forward_batch: a sequence holds more than the context of " + std::to_string(plan_.ctx) + " positions");
      std::copy(blocks.begin(), blocks.end(), tab + int64_t(seqs.size()) * plan_.table_stride);
      it = seqs.insert(seqs.end(), seq);
    }
    const int64_t p = bplan_.pos[size_t(i)];
    h_tokens_.as<int32_t>()[i] = batch[i].token;
    h_pos_.as<int32_t>()[i] = int32_t(p);
    seq_row[i] = int32_t(it - seqs.begin());
    rows[i] = int32_t(tables.blocks(seq)[size_t(p / bt)] * bt + p % bt);
  }
  for (int64_t i = 0; i < bplan_.n_logits; ++i) out[i] = int32_t(bplan_.out[size_t(i)]);
  // A decode step (every token flagged, every product on the GEMV or MMQ kernels: no cuBLAS in
  // the graph) replays the graph captured for its T; other batches are enqueued as they come.
  if (bplan_.n_logits == T && T <= kCudaMmqMaxTokens && no_cublas(T)) {
    if (batch_graphs_.empty()) batch_graphs_.assign(size_t(kCudaMmqMaxTokens) + 1, nullptr);
    launch(batch_graphs_[size_t(T)], [&] { enqueue(T, 0, T, Out::Logits, true); });
  } else {
    enqueue(T, 0, bplan_.n_logits, Out::Logits, true);
  }
  check(cudaStreamSynchronize(stream_), "forward_batch");
  if (advance)
    for (const auto& [seq, end] : bplan_.ends) tables.set_length(seq, end);
  return bplan_.n_logits ? h_logits_.as<float>() : nullptr;
}

bool CudaSession::no_cublas(int64_t T) const {
  if (T <= kGemvMaxTokens) return true;
  auto ours = [T](const DeviceWeight& w) { return w.rows == 0 || matmul_quantizes(w, T); };  // GEMV / MMQ
  for (const DeviceLayer& l : dm_.layers) {
    for (const DeviceWeight& w : l.qkv)
      if (!ours(w)) return false;
    for (const DeviceWeight& w : l.gate_up)
      if (!ours(w)) return false;
    if (!ours(l.wo) || !ours(l.w_down)) return false;
  }
  return ours(dm_.output);
}

void CudaSession::set_comm(Communicator* comm, bool device_memory) {
  comm_ = comm, comm_device_ = device_memory;
  use_graphs_ = false;
  if (comm && !device_memory) h_reduce_ = PinnedBuffer(size_t(plan_.n_batch * dm_.config().dim) * 4);
}

void CudaSession::all_reduce(float* x, int64_t n) {
  if (comm_device_) {  // NCCL: device buffers, ordered on this stream by the communicator
    check(cudaStreamSynchronize(stream_), "all-reduce");
    comm_->all_reduce_sum(x, n);
    return;
  }
  check(cudaMemcpyAsync(h_reduce_.get(), x, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (all-reduce)");
  check(cudaStreamSynchronize(stream_), "all-reduce");
  comm_->all_reduce_sum(h_reduce_.as<float>(), n);
  check(cudaMemcpyAsync(x, h_reduce_.get(), size_t(n) * 4, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (all-reduce)");
}

// ---------------------------------------------------------------- CudaOffloadSession

namespace {

ModelConfig first_layers(ModelConfig c, int64_t n) {
  c.n_layers = n;
  return c;
}

// The CPU layers of a partial offload of gpu_layers layers; UsageError out of [0, n_layers).
int64_t offload_cpu_layers(const ModelConfig& c, int64_t gpu_layers) {
  if (gpu_layers < 0 || gpu_layers >= c.n_layers)
    throw UsageError("--gpu-layers " + std::to_string(gpu_layers) + ": partial offload takes 0 .. " + std::to_string(c.n_layers - 1) +
                     " layers (all " + std::to_string(c.n_layers) + ": the whole model on the GPU)");
  return c.n_layers - gpu_layers;
}

// Partial offload: the CPU's first `layers` layers for a batch (their K and V into `cache`, whose
// lengths stay), the residual stream after them into the GPU session's hidden input. Returns the
// batch's plan in `plan`.
void run_cpu_layers(const Model& m, KVCache& cache, Workspace& ws, ThreadPool& pool, const BatchToken* batch, int64_t n, int64_t layers,
                    BatchPlan& plan, CudaSession& gpu) {
  plan_batch(m, cache, batch, n, ws.capacity(), plan);
  const float* x = forward_shard(m, nullptr, cache, ws, pool, nullptr, batch, n, plan, layers);  // [n, D]
  std::memcpy(gpu.hidden_input(), x, size_t(n * m.config.dim) * sizeof(float));
}

// A paged runner's cache must be the plan's blocks (the scheduler sizes it the same way).
void check_cache_shape(const CudaPlan& p, int64_t n_blocks, int64_t block_tokens) {
  if (n_blocks != p.kv_blocks || block_tokens != p.block_tokens)
    throw UsageError("CUDA: a KV cache of " + std::to_string(n_blocks) + " blocks of " + std::to_string(block_tokens) +
                     " positions was asked for; the GPU's holds " + std::to_string(p.kv_blocks) + " of " + std::to_string(p.block_tokens));
}

}  // namespace

CudaOffloadSession::CudaOffloadSession(const Model& m, ThreadPool& pool, int64_t gpu_layers, int64_t ctx, int64_t n_batch,
                                       int64_t logits_rows, bool progress, bool kv_q8)
    : m_(m),
      pool_(pool),
      cpu_layers_(offload_cpu_layers(m.config, gpu_layers)),
      cache_([&] {
        const ModelConfig c = first_layers(m.config, cpu_layers_);
        return KVCache(c, plan_kv(c, session_sizes(m.config, ctx, n_batch).ctx).n_blocks, kKvBlockTokens);
      }()),
      seq_(cache_.add_sequence()),
      ws_(m, [&] {
        const SessionSizes sz = session_sizes(m.config, ctx, n_batch, 1);  // logits come from the GPU
        return plan_workspace(m.config, llama_matmuls(m.config, m.file->tensors(), sz.n_batch, 1), sz.n_batch, sz.ctx, 1, pool.size());
      }()) {
  dm_ = std::make_unique<CudaModel>(m, progress, cpu_layers_);
  gpu_ = std::make_unique<CudaSession>(*dm_, &m, plan_cuda(m.config, m.file->tensors(), ctx, n_batch, logits_rows, gpu_layers, kv_q8));
}

CudaOffloadSession::~CudaOffloadSession() = default;

void CudaOffloadSession::truncate(int64_t n) {
  gpu_->truncate(n);  // checks n
  cache_.truncate(seq_, n);
}

void CudaOffloadSession::check_input(const int32_t* tokens, int64_t n, bool all_logits) const {
  if (n <= 0) throw UsageError("forward: no tokens");
  if (pos() + n > ctx())
    throw UsageError("context full: " + std::to_string(pos()) + " + " + std::to_string(n) + " tokens exceed the KV cache of " +
                     std::to_string(ctx()));
  if (all_logits && n > gpu_->logits_rows())
    throw UsageError("forward: all_logits for " + std::to_string(n) + " tokens, the session keeps " + std::to_string(gpu_->logits_rows()));
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= m_.config.vocab_size) throw UsageError("token id " + std::to_string(tokens[i]) + " out of range");
}

void CudaOffloadSession::run_cpu(const int32_t* tokens, int64_t n) {
  cache_.reserve(seq_, pos() + n);
  batch_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) batch_[size_t(i)] = {seq_, tokens[i], false};
  run_cpu_layers(m_, cache_, ws_, pool_, batch_.data(), n, cpu_layers_, plan_, *gpu_);
  for (const auto& [seq, end] : plan_.ends) cache_.set_length(seq, end);
}

const float* CudaOffloadSession::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  check_input(tokens, n, all_logits);
  const float* out = nullptr;
  for_each_chunk(n, gpu_->n_batch(), [&](int64_t i, int64_t len, bool last) {
    run_cpu(tokens + i, len);
    if (!last) gpu_->prefill(tokens + i, len);  // a chunk before the last: no logits
    else out = gpu_->forward(tokens + i, len, all_logits);
  });
  return out;
}

int32_t CudaOffloadSession::forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) {
  check_input(tokens, n, false);
  int32_t id = -1;
  for_each_chunk(n, gpu_->n_batch(), [&](int64_t i, int64_t len, bool last) {
    run_cpu(tokens + i, len);
    if (!last) gpu_->prefill(tokens + i, len);
    else id = gpu_->forward_sample(tokens + i, len, sampler, history);
  });
  return id;
}

// ---------------------------------------------------------------- CudaRanks

CudaRanks::CudaRanks(const Model& m, int n_ranks, const std::function<CudaPlan(const ModelConfig&)>& plan_of, bool progress,
                     CudaComms comms)
    : comms_(std::move(comms)) {
  TpOptions opt;
  opt.vocab_parallel = false;  // the embedding replicated, the whole output on rank 0
  if (comms_.local_rank >= 0) {  // one rank of a group over processes: its shard, its communicator
    const int r = comms_.local_rank;
    if (n_ranks < 2 || r >= n_ranks || comms_.comms.size() != 1 || comms_.devices.size() != 1)
      throw UsageError("CUDA tensor parallelism: one rank of a group needs its rank, one communicator and one GPU");
    devices_ = comms_.devices;
    check(cudaSetDevice(devices_[0]), "cudaSetDevice");
    const ModelShard shard = make_shard(m, plan_shards(m, n_ranks, opt), r, /*pack=*/false);
    models_.push_back(std::make_unique<CudaModel>(m, shard, progress));
    sessions_.push_back(std::make_unique<CudaSession>(*models_.back(), &m, plan_of(models_.back()->config())));
    sessions_[0]->set_comm(comms_.comms[0].get(), comms_.device_memory);
    return;
  }
  if (!comms_.comms.empty() && int(comms_.comms.size()) != n_ranks) throw UsageError("CUDA tensor parallelism: one communicator per rank");
  devices_ = comms_.comms.empty() ? std::vector<int>(size_t(std::max(n_ranks, 1)), 0) : comms_.devices;
  if (n_ranks <= 1) {  // the whole model, as uploaded for one GPU
    models_.push_back(std::make_unique<CudaModel>(m, progress));
    sessions_.push_back(std::make_unique<CudaSession>(*models_.back(), &m, plan_of(m.config)));
    return;
  }
  const std::vector<ShardRanges> plan = plan_shards(m, n_ranks, opt);
  for (int r = 0; r < n_ranks; ++r) {  // each rank's allocations on its device (current per host thread)
    check(cudaSetDevice(devices_[size_t(r)]), "cudaSetDevice");
    const ModelShard shard = make_shard(m, plan, r, /*pack=*/false);  // host copies of its columns, dropped after the upload
    models_.push_back(std::make_unique<CudaModel>(m, shard, progress));
    sessions_.push_back(std::make_unique<CudaSession>(*models_.back(), &m, plan_of(models_.back()->config())));
  }
  check(cudaSetDevice(devices_[0]), "cudaSetDevice");
  threads_ = std::make_unique<ThreadPool>(n_ranks);
  if (comms_.comms.empty()) host_ = std::make_unique<HostCommGroup>(n_ranks);
  for (int r = 0; r < n_ranks; ++r)
    sessions_[size_t(r)]->set_comm(host_ ? static_cast<Communicator*>(&host_->rank(r)) : comms_.comms[size_t(r)].get(),
                                   /*device_memory=*/!host_);
}

CudaRanks::~CudaRanks() {
  sessions_.clear();  // before the communicators they point at
  models_.clear();
}

void CudaRanks::run(const std::function<void(int)>& fn) {
  if (failed_) throw UsageError("tensor parallel: a rank failed earlier; the ranks cannot continue");
  if (comms_.local_rank >= 0) {  // one rank of a group over processes
    try {
      check(cudaSetDevice(devices_[0]), "cudaSetDevice");
      fn(0);
    } catch (const CommAborted&) {
      failed_ = true;
      throw;
    } catch (...) {
      failed_ = true;
      comms_.comms[0]->abort();  // release the other processes' ranks
      throw;
    }
    return;
  }
  if (!threads_) return fn(0);
  try {
    threads_->parallel_for(size(), [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        try {
          check(cudaSetDevice(devices_[size_t(r)]), "cudaSetDevice");
          fn(int(r));
        } catch (const CommAborted&) {
          throw;
        } catch (...) {  // release the ranks waiting for this one
          if (host_) host_->rank(int(r)).abort();
          else comms_.comms[size_t(r)]->abort();
          throw;
        }
      }
    });
  } catch (...) {
    failed_ = true;
    throw;
  }
}

uint64_t CudaRanks::kv_bytes() const {
  uint64_t b = 0;
  for (const auto& s : sessions_) b += s->kv_bytes();
  return b;
}

uint64_t CudaRanks::workspace_bytes() const {
  uint64_t b = 0;
  for (const auto& s : sessions_) b += s->workspace_bytes();
  return b;
}

// ---------------------------------------------------------------- CudaTpSession

CudaTpSession::CudaTpSession(const Model& m, int n_ranks, int64_t ctx, int64_t n_batch, int64_t logits_rows, bool progress,
                             CudaComms comms, bool kv_q8)
    : m_(m),
      ranks_(
          m, n_ranks, [&](const ModelConfig& c) { return plan_cuda(c, {}, ctx, n_batch, logits_rows, -1, kv_q8); }, progress,
          std::move(comms)) {}

const float* CudaTpSession::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  const float* out = nullptr;
  ranks_.run([&](int r) {
    const float* l = ranks_.session(r).forward(tokens, n, all_logits);
    if (r == 0) out = l;
  });
  return out;
}

int32_t CudaTpSession::forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) {
  int32_t id = -1;
  ranks_.run([&](int r) {  // rank 0 holds the output and samples; the others run the same layers
    if (r == 0) id = ranks_.session(0).forward_sample(tokens, n, sampler, history);
    else ranks_.session(r).forward(tokens, n);
  });
  return id;
}

void CudaTpSession::truncate(int64_t n) {
  for (int r = 0; r < ranks_.size(); ++r) ranks_.session(r).truncate(n);
}

// ---------------------------------------------------------------- CudaBatchRunner

CudaBatchRunner::CudaBatchRunner(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel, int64_t kv_tokens, bool progress, int tp,
                                 CudaComms comms, bool kv_q8)
    : m_(m),
      plan_(plan_cuda_server(m.config, tp > 1 ? std::vector<TensorInfo>{} : m.file->tensors(), ctx, n_batch, parallel, kv_tokens, -1,
                             kv_q8)),
      ranks_(
          m, tp,
          [&](const ModelConfig& c) { return tp > 1 ? plan_cuda_server(c, {}, ctx, n_batch, parallel, kv_tokens, -1, kv_q8) : plan_; },
          progress, std::move(comms)),
      tp_(tp) {
  if (tp > 1) plan_ = ranks_.session(0).plan();
}

KVCache CudaBatchRunner::make_cache(int64_t n_blocks, int64_t block_tokens, KvType) {
  check_cache_shape(plan_, n_blocks, block_tokens);
  return KVCache::tables_only(m_.config, n_blocks, block_tokens);
}

const float* CudaBatchRunner::forward(KVCache& cache, const BatchToken* batch, int64_t n) {
  if (tp_ == 1) return ranks_.session(0).forward_batch(cache, batch, n);
  const float* out = nullptr;
  ranks_.run([&](int r) {  // every rank reads the same tables; the lengths advance once, after all
    const float* l = ranks_.session(r).forward_batch(cache, batch, n, /*advance=*/false);
    if (ranks_.first_rank() + r == 0) out = l;  // the logits are rank 0's
  });
  for (const auto& [seq, end] : ranks_.session(0).batch_plan().ends) cache.set_length(seq, end);
  return out;
}

// ---------------------------------------------------------------- CudaOffloadBatchRunner

CudaOffloadBatchRunner::CudaOffloadBatchRunner(const Model& m, ThreadPool& pool, int64_t gpu_layers, int64_t ctx, int64_t n_batch,
                                               int64_t parallel, int64_t kv_tokens, bool progress, bool kv_q8)
    : m_(m),
      pool_(pool),
      cpu_layers_(offload_cpu_layers(m.config, gpu_layers)),
      plan_(plan_cuda_server(m.config, m.file->tensors(), ctx, n_batch, parallel, kv_tokens, gpu_layers, kv_q8)),
      ws_(m, plan_workspace(m.config, llama_matmuls(m.config, m.file->tensors(), plan_.n_batch, 1), plan_.n_batch, plan_.ctx, 1,
                            pool.size())) {
  dm_ = std::make_unique<CudaModel>(m, progress, cpu_layers_);
  session_ = std::make_unique<CudaSession>(*dm_, &m, plan_);
}

CudaOffloadBatchRunner::~CudaOffloadBatchRunner() = default;

KVCache CudaOffloadBatchRunner::make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) {
  check_cache_shape(plan_, n_blocks, block_tokens);
  return KVCache(first_layers(m_.config, cpu_layers_), n_blocks, block_tokens, type);
}

const float* CudaOffloadBatchRunner::forward(KVCache& cache, const BatchToken* batch, int64_t n) {
  run_cpu_layers(m_, cache, ws_, pool_, batch, n, cpu_layers_, bplan_, *session_);  // the lengths stay for the GPU's pass
  return session_->forward_batch(cache, batch, n);
}

}  // namespace llmq::cuda
