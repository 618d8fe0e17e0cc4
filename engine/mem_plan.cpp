#include "engine/mem_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "engine/model.h"
#include "base/error.h"
#include "formats/quant.h"

namespace llmq {

KVPlan plan_kv(const ModelConfig& c, int64_t tokens, int elem_bytes, int64_t block_tokens) {
  if (tokens <= 0 || block_tokens <= 0) throw UsageError("KV cache: the token count and block size must be positive");
  KVPlan p;
  p.block_tokens = block_tokens;
  p.n_blocks = (tokens + block_tokens - 1) / block_tokens;
  p.n_layers = c.n_layers;
  p.kv_dim = c.kv_dim();
  p.elem_bytes = elem_bytes;
  return p;
}

std::vector<MatmulUse> llama_matmuls(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t capacity,
                                     int64_t logits_rows) {
  std::map<std::string, const TensorInfo*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  auto find = [&](const std::string& name) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw UsageError("tensor '" + name + "' is missing");
    return it->second;
  };
  std::vector<MatmulUse> uses;
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (const char* what : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
      const TensorInfo* t = find(layer_tensor(l, what));
      uses.push_back({t->type, t->cols(), capacity});
    }
  const TensorInfo* out = find(c.tied_embeddings ? "token_embd.weight" : "output.weight");
  if (logits_rows > 0) uses.push_back({out->type, out->cols(), logits_rows});
  return uses;
}

uint64_t WorkspacePlan::bytes() const {
  uint64_t b = 0;
  for (const auto& buf : buffers()) b += buf.bytes;
  return b;
}

std::vector<PlannedBuffer> WorkspacePlan::buffers() const {
  auto f32 = [](const char* name, size_t n, const std::string& shape) {
    return PlannedBuffer{name, shape + " f32", uint64_t(n) * sizeof(float)};
  };
  const auto B = size_t(std::max<int64_t>(1, capacity));
  auto rows = [&](size_t n) { return fmt::format("[{}, {}]", B, n / B); };
  std::vector<PlannedBuffer> out = {
      f32("ws.x (residual stream)", x, rows(x)),
      f32("ws.xb (normed input / projections)", xb, rows(xb)),
      f32("ws.q", q, rows(q)),
      f32("ws.k", k, rows(k)),
      f32("ws.v", v, rows(v)),
      f32("ws.att_out", att_out, rows(att_out)),
      f32("ws.h1 (FFN gate)", h1, rows(h1)),
      f32("ws.h2 (FFN up)", h2, rows(h2)),
      f32("ws.rope (RoPE cos, sin per token)", rope, rows(rope)),
      PlannedBuffer{"ws.pos, ws.out (positions, flagged tokens)", fmt::format("2 x [{}] i64", pos),
                    2 * uint64_t(pos) * sizeof(int64_t)},
      PlannedBuffer{"ws.att (scores, per thread)", fmt::format("{} x [{}] f32", threads, att), uint64_t(threads) * att * sizeof(float)},
      f32("ws.att_part (split decode attention)", att_part, fmt::format("[{}]", att_part)),
      f32("ws.logits", logits, fmt::format("[{}, {}]", logits_rows, logits_rows > 0 ? logits / size_t(logits_rows) : 0)),
      PlannedBuffer{"ws.matmul scratch (" + std::string(cpu_kernels_name()) + ")",
                    fmt::format("xq {} blocks, prep {} B, {} x {} B per thread", matmul.xq, matmul.prep, matmul.threads,
                                matmul.tbuf + matmul.rowbuf * sizeof(float)),
                    matmul.bytes()},
  };
  return out;
}

WorkspacePlan plan_workspace(const ModelConfig& c, const std::vector<MatmulUse>& matmuls, int64_t capacity, int64_t max_ctx,
                             int64_t logits_rows, int threads) {
  WorkspacePlan p;
  p.capacity = std::max<int64_t>(1, capacity);
  p.max_ctx = std::max<int64_t>(0, max_ctx);
  p.logits_rows = std::max<int64_t>(0, logits_rows);
  p.threads = std::max(0, threads);
  const auto B = size_t(p.capacity);
  p.x = B * size_t(c.dim);
  p.xb = B * size_t(std::max(c.dim, c.q_dim()));
  p.q = p.att_out = B * size_t(c.q_dim());
  p.k = p.v = B * size_t(c.kv_dim());
  p.h1 = p.h2 = B * size_t(c.hidden_dim);
  p.pos = B;
  p.rope = B * size_t(c.head_dim) * size_t(c.rope_tables());  // one table of angles per distinct RoPE frequencies
  // forward_batch scores G query heads per work item: the GQA group (1 for uneven TP splits),
  // over parts of kAttnPartTokens positions (engine/model.cpp, attention).
  const int64_t G = c.n_heads / c.n_kv_heads;
  const auto max_parts = size_t(std::max<int64_t>(1, (p.max_ctx + kAttnPartTokens - 1) / kAttnPartTokens));
  const auto part_floats = size_t(G * (c.head_dim + 2));
  // Scores [G, part], the bf16 copies of q and of the softmax weights (bf16 KV cache) and the
  // parts of one item.
  p.att = size_t(G * kAttnPartTokens) + size_t(G * (c.head_dim + kAttnPartTokens) + 1) / 2 + max_parts * part_floats;
  // Fewer (token, head group) items than 2 · threads (decode): each part is an item of its own.
  p.att_part = size_t(2 * std::max(1, p.threads)) * max_parts * part_floats;
  p.logits = size_t(p.logits_rows * c.vocab_size);
  p.matmul.threads = p.threads;
  for (const MatmulUse& u : matmuls) plan_matmul_scratch(p.matmul, u.type, u.cols, u.max_tokens, p.threads);
  return p;
}

SessionSizes session_sizes(const ModelConfig& c, int64_t ctx, int64_t n_batch, int64_t logits_rows) {
  SessionSizes s{};
  s.ctx = ctx > 0 ? ctx : std::min(c.context_length, kDefaultMaxCtx);
  s.n_batch = std::max<int64_t>(1, std::min(n_batch, s.ctx));
  s.logits_rows = std::max<int64_t>(1, std::min(logits_rows, s.n_batch));
  return s;
}

int64_t server_kv_tokens(int64_t ctx, int64_t parallel, int64_t kv_tokens) {
  const int64_t want = kv_tokens > 0 ? kv_tokens : std::max<int64_t>(ctx, parallel * std::min<int64_t>(ctx, 2048));
  return std::max(want, ctx);
}

uint64_t model_packed_bytes(const std::vector<TensorInfo>& tensors, int64_t n_layers, int64_t gpu_layers, int tp, uint64_t* from_file) {
  const bool has_output =
      std::any_of(tensors.begin(), tensors.end(), [](const TensorInfo& t) { return t.name == "output.weight"; });
  const int64_t cpu_layers = n_layers - std::clamp<int64_t>(gpu_layers, 0, n_layers);
  std::set<std::string> names;  // the matrices Model::load packs (engine/model.cpp)
  for (int64_t l = 0; l < cpu_layers; ++l)
    for (const char* what : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})
      if (tp <= 1 || (std::string(what) != "attn_output" && std::string(what) != "ffn_down")) names.insert(layer_tensor(l, what));
  if (gpu_layers <= 0) names.insert(has_output ? "output.weight" : "token_embd.weight");
  uint64_t bytes = 0, file = 0;
  for (const auto& t : tensors) {
    if (t.shape.size() != 2 || !names.count(t.name)) continue;
    const Weight w{t.type, nullptr, t.shape[0], t.shape[1]};
    const uint64_t n = packed_weights_bytes({&w});
    if (n > 0) bytes += n, file += t.nbytes;
  }
  if (from_file) *from_file = file;
  return bytes;
}

InferencePlan plan_inference(const LlmqFile& file, const ModelConfig& c, int64_t ctx, int64_t n_batch, int threads,
                             int64_t parallel, bool server, int64_t kv_tokens) {
  if (parallel < 1) throw UsageError("--parallel must be at least 1");
  InferencePlan p;
  for (const auto& t : file.tensors()) p.weight_bytes += t.nbytes;
  p.file_bytes = file.file_size();
  p.packed_bytes = model_packed_bytes(file.tensors(), c.n_layers, 0, 1, &p.packed_from_file);
  for (const auto& t : file.tensors()) p.largest_tensor = std::max(p.largest_tensor, t.nbytes);
  for (const TensorSpec& spec : tensor_table(c)) {  // what Model::load binds
    const TensorInfo* t = file.find(spec.name);
    if (!t) continue;  // Model::load refuses the file
    if (t->shape.size() == 1) p.vector_bytes += t->nbytes;  // f32, copied
    else if (t->name != "token_embd.weight" || c.tied_embeddings) p.mapped_matrix_bytes += t->nbytes;  // the matmuls' weights
  }
  p.mapped_matrix_bytes -= std::min(p.mapped_matrix_bytes, p.packed_from_file);
  p.parallel = parallel;
  if (parallel == 1 && !server) {  // llmq-run: one Session
    const SessionSizes s = session_sizes(c, ctx, n_batch);
    p.ctx = s.ctx, p.n_batch = s.n_batch, p.kv_tokens = s.ctx;
    p.kv = plan_kv(c, s.ctx);
    p.ws = plan_workspace(c, llama_matmuls(c, file.tensors(), s.n_batch, s.logits_rows), s.n_batch, s.ctx, s.logits_rows,
                          threads);
    return p;
  }
  // llmq-server: a Scheduler (server/scheduler.cpp) with one logits row per running sequence.
  p.ctx = ctx > 0 ? ctx : std::min(c.context_length, kDefaultMaxCtx);
  p.n_batch = std::max<int64_t>(n_batch, parallel);
  p.kv_tokens = server_kv_tokens(p.ctx, parallel, kv_tokens);
  p.kv = plan_kv(c, p.kv_tokens);
  p.ws = plan_workspace(c, llama_matmuls(c, file.tensors(), p.n_batch, parallel), p.n_batch, p.ctx, parallel, threads);
  return p;
}

uint64_t tensor_bytes_per_rank(const TensorInfo& t, int tp) {
  if (tp <= 1 || t.shape.size() < 2) return t.nbytes;
  const std::string& n = t.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  const bool row_parallel = has("attn_output") || has("ffn_down");
  if (!row_parallel) {  // split output features (rows); vocab-parallel embedding and output likewise
    const int64_t rows = (t.rows() + tp - 1) / tp;
    return uint64_t(rows) * (t.nbytes / uint64_t(t.rows()));
  }
  if (t.cols() % tp != 0 || !row_fits(t.type, t.cols() / tp))
    throw UsageError(fmt::format("{}: {} columns cannot be split {} ways in whole {} blocks", n, t.cols(), tp, dtype_name(t.type)));
  return uint64_t(t.rows()) * row_bytes(t.type, t.cols() / tp);
}

CudaMatmulPlan plan_cuda_matmul(int64_t cap, int64_t max_cols, int64_t max_rows) {
  CudaMatmulPlan p;
  p.cols = (max_cols + 31) / 32 * 32;
  const uint64_t T = uint64_t(cap), c = uint64_t(p.cols);
  p.act_q = T * c, p.act_d = p.act_s = T * (c / 32) * 4;
  if (cap > kCudaGemvMaxTokens) {  // prefill through cuBLAS
    constexpr uint64_t kTileBytes = 128ull << 20;  // one tile for most 7B matrices: each cuBLAS call whole
    p.tile_rows = max_cols > 0 ? std::max<int64_t>(128, int64_t(kTileBytes / (uint64_t(max_cols) * 2)) / 128 * 128) : 0;
    if (max_rows > 0) p.tile_rows = std::min(p.tile_rows, (max_rows + 127) / 128 * 128);  // a small model needs no 128 MiB
    p.act_h = T * c * 2, p.tile = uint64_t(p.tile_rows) * c * 2, p.cublas_workspace = 32ull << 20;
    const uint64_t rows = max_rows > 0 ? uint64_t(max_rows) : uint64_t(1) << 20;
    p.mmq_split = std::min<uint64_t>(16ull << 20, 8 * std::min<uint64_t>(T, kCudaMmqMaxTokens) * rows * 4);
  }
  return p;
}

int64_t cuda_matmul_max_rows(const ModelConfig& c) {
  return std::max({c.vocab_size, c.n_heads * c.head_dim + 2 * c.kv_dim(), 2 * c.hidden_dim, c.dim});
}

namespace {

// Weights as CudaModel uploads them (engine/cuda/session.cpp): rows of cuda_row_bytes (the split
// layouts of Q4_K, Q5_K and Q6_K: 148, 180 and 212 bytes a super-block), 256-byte aligned
// pieces, Q/K/V and gate/up stacked when of one type; rank R's rows of the column-parallel
// matrices and columns of the row-parallel ones (R whole: the model), layers from first_layer
// on, the embedding when all layers are there or it is tied, the output rows R.n_vocab when
// untied.
uint64_t cuda_weight_bytes(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R, int64_t first_layer) {
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : tensors) by_name[t.name] = &t;
  auto find = [&](const std::string& name) -> const TensorInfo& {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw UsageError("plan_cuda: no tensor " + name);
    return *it->second;
  };
  auto al = [](uint64_t n) { return (n + 255) / 256 * 256; };
  struct Piece { DType type; uint64_t bytes; };
  auto rows = [&](const std::string& name, int64_t n) {  // n rows of [rows, cols]
    const TensorInfo& t = find(name);
    return Piece{t.type, uint64_t(n) * cuda_row_bytes(t.type, t.shape.back())};
  };
  auto cols = [&](const std::string& name, int64_t n) {  // n columns of [rows, cols]
    const TensorInfo& t = find(name);
    return Piece{t.type, uint64_t(t.shape.front()) * cuda_row_bytes(t.type, n)};
  };
  auto stacked = [&](std::initializer_list<Piece> ps) {
    bool same = true;
    uint64_t sum = 0, apart = 0;
    for (const Piece& q : ps) same = same && q.type == ps.begin()->type, sum += q.bytes, apart += al(q.bytes);
    return same ? al(sum) : apart;
  };
  const int64_t D = c.dim, hd = c.head_dim, Q = R.n_heads * hd, KV = R.n_kv_heads * hd;
  const uint64_t vec = al(uint64_t(D) * 4);
  uint64_t w = vec;  // output_norm
  if (first_layer == 0 || c.tied_embeddings) w += al(rows("token_embd.weight", R.n_embd).bytes);
  if (!c.tied_embeddings && R.n_vocab > 0) w += al(rows("output.weight", R.n_vocab).bytes);
  for (int64_t i = first_layer; i < c.n_layers; ++i) {
    auto name = [&](const char* what) { return layer_tensor(i, what); };
    w += 2 * vec;  // attn_norm, ffn_norm
    w += stacked({rows(name("attn_q"), Q), rows(name("attn_k"), KV), rows(name("attn_v"), KV)});
    w += stacked({rows(name("ffn_gate"), R.ffn_dim), rows(name("ffn_up"), R.ffn_dim)});
    w += al(cols(name("attn_output"), Q).bytes) + al(cols(name("ffn_down"), R.ffn_dim).bytes);
    if (c.attn_qkv_bias) w += al(uint64_t(Q + 2 * KV) * 4);
    if (c.attn_out_bias) w += vec;
    if (c.qk_norm) w += 2 * al(uint64_t(hd) * 4);
    if (c.norms == NormPlacement::PrePost) w += 2 * vec;
  }
  w += al(uint64_t(c.rope_tables()) * uint64_t(hd / 2) * 8);  // the fp64 RoPE frequency tables
  return w;
}

// The plan of a session of p.ctx tokens per sequence, p.n_batch tokens per pass, p.logits_rows
// logits rows, p.kv_rows cache rows, and p.parallel sequences (0: one, contiguous).
CudaPlan plan_cuda_buffers(const ModelConfig& c, const std::vector<TensorInfo>& tensors, CudaPlan p) {
  p.decode_parts = (p.ctx + kCudaDecodePartTokens - 1) / kCudaDecodePartTokens;
  p.decode_part_len = p.decode_parts == 1 ? (p.ctx + 31) / 32 * 32 : kCudaDecodePartTokens;
  const int64_t D = c.dim, hd = c.head_dim, Q = c.n_heads * hd, KV = c.n_kv_heads * hd, H = c.hidden_dim, V = c.vocab_size;
  const uint64_t T = uint64_t(p.n_batch);
  if (p.kv_q8 && c.head_dim % 32 != 0)
    throw UsageError("a Q8_0 KV cache needs head_dim a multiple of 32 (this model's is " + std::to_string(c.head_dim) + ")");
  const uint64_t kv_row = p.kv_q8 ? uint64_t(KV) + uint64_t(KV / 32) * 2 : uint64_t(KV) * 2;  // bytes of one position's K (or V)
  p.kv = uint64_t(c.n_layers - p.first_layer) * 2 * uint64_t(p.kv_rows) * kv_row;
  p.tokens = T * 4, p.top_k = uint64_t(kCudaMaxTopK) * 4;
  p.io = 2 * p.tokens + 4 + 2 * p.top_k;
  if (p.parallel > 0) {
    p.table_stride = (p.ctx + p.block_tokens - 1) / p.block_tokens;
    p.paging = 2 * p.tokens + uint64_t(p.parallel) * uint64_t(p.table_stride) * 4 + uint64_t(p.logits_rows) * 4;
  }
  p.x = T * uint64_t(D) * 4, p.qkv = T * uint64_t(Q + 2 * KV) * 4, p.att = T * uint64_t(Q) * 4;
  p.h = T * uint64_t(2 * H) * 4, p.hs = T * uint64_t(H) * 4;
  p.activations = 2 * p.x + p.qkv + p.att + p.h + p.hs;
  p.logits = uint64_t(p.logits_rows) * uint64_t(V) * 4;
  p.attn_parts = p.decode_parts > 1
                     ? uint64_t(std::max<int64_t>(1, p.parallel)) * uint64_t(c.n_heads) * uint64_t(p.decode_parts) * uint64_t(hd + 2) * 4
                     : 0;
  p.matmul = plan_cuda_matmul(p.n_batch, std::max({D, Q, H}), cuda_matmul_max_rows(c));
  // Weights as CudaModel lays them out (engine/cuda/session.cpp): 256-byte aligned pieces.
  if (!tensors.empty()) p.weights = cuda_weight_bytes(c, tensors, ShardRanges::whole(c), p.first_layer);
  return p;
}

}  // namespace

CudaPlan plan_cuda(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t ctx, int64_t n_batch, int64_t logits_rows,
                   int64_t gpu_layers, bool kv_q8) {
  if (gpu_layers > c.n_layers)
    throw UsageError("--gpu-layers " + std::to_string(gpu_layers) + ": the model has " + std::to_string(c.n_layers) + " layers");
  const SessionSizes sz = session_sizes(c, ctx, n_batch, logits_rows);
  CudaPlan p;
  p.first_layer = gpu_layers < 0 ? 0 : c.n_layers - gpu_layers;
  p.kv_q8 = kv_q8;
  p.ctx = p.kv_rows = sz.ctx, p.n_batch = sz.n_batch, p.logits_rows = std::min(sz.logits_rows, sz.n_batch);
  return plan_cuda_buffers(c, tensors, p);
}

ModelConfig rank_config(const ModelConfig& c, const ShardRanges& R) {
  ModelConfig rc = c;
  rc.n_heads = R.n_heads, rc.n_kv_heads = R.n_kv_heads, rc.hidden_dim = R.ffn_dim;
  return rc;
}

CudaPlan plan_cuda_rank(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R, int64_t ctx, int64_t n_batch,
                        int64_t logits_rows, int64_t parallel, int64_t kv_tokens, bool kv_q8) {
  const ModelConfig rc = rank_config(c, R);
  CudaPlan p = parallel > 0 ? plan_cuda_server(rc, {}, ctx, n_batch, parallel, kv_tokens, -1, kv_q8)
                            : plan_cuda(rc, {}, ctx, n_batch, logits_rows, -1, kv_q8);
  p.weights = cuda_weight_bytes(c, tensors, R, 0);
  return p;
}

CudaPlan plan_cuda_server(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t ctx, int64_t n_batch,
                          int64_t parallel, int64_t kv_tokens, int64_t gpu_layers, bool kv_q8) {
  if (parallel < 1) throw UsageError("--parallel must be at least 1");
  if (gpu_layers > c.n_layers)
    throw UsageError("--gpu-layers " + std::to_string(gpu_layers) + ": the model has " + std::to_string(c.n_layers) + " layers");
  CudaPlan p;
  p.first_layer = gpu_layers < 0 ? 0 : c.n_layers - gpu_layers;
  p.kv_q8 = kv_q8;
  p.ctx = ctx > 0 ? ctx : std::min(c.context_length, kDefaultMaxCtx);
  p.parallel = parallel;
  p.n_batch = std::max<int64_t>({1, n_batch, parallel});  // the Scheduler's capacity
  p.logits_rows = std::min(parallel, p.n_batch);
  p.block_tokens = kKvBlockTokens;
  p.kv_blocks = plan_kv(c, server_kv_tokens(p.ctx, parallel, kv_tokens)).n_blocks;
  p.kv_rows = p.kv_blocks * p.block_tokens;
  return plan_cuda_buffers(c, tensors, p);
}

}  // namespace llmq
