#include "mem/infer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include <malloc.h>

#include "engine/model.h"

#include "engine/tp.h"
#include "base/error.h"

namespace llmq::mem {

namespace {

constexpr const char* kPlan = "engine/mem_plan.cpp (the plan the engine allocates from)";
constexpr const char* kPaged = "Kwon et al. 2023, arXiv 2309.06180 (PagedAttention blocks)";
constexpr const char* kMegatron = "Shoeybi et al. 2019, arXiv 1909.08053 (Megatron-LM column/row-parallel split)";

std::string type_mix(const std::vector<TensorInfo>& tensors) {
  std::map<std::string, uint64_t> bytes;
  for (const auto& t : tensors) bytes[dtype_name(t.type)] += t.nbytes;
  std::string s;
  for (const auto& [name, b] : bytes) s += fmt::format("{}{} {}", s.empty() ? "" : ", ", name, format_bytes(double(b)));
  return s;
}

// The workspace (engine/mem_plan.h WorkspacePlan): the activation buffers as one line, then
// scores, logits and matmul scratch.
void add_workspace_lines(MemReport& r, const InferencePlan& p) {
  uint64_t act = 0;
  std::string act_f;
  std::vector<MemLine> rest;
  for (const auto& b : p.ws.buffers()) {
    const std::string name = b.name.substr(3);  // without "ws."
    if (name.rfind("att ", 0) == 0 || name == "logits" || name.rfind("matmul", 0) == 0) {
      rest.push_back({"workspace: " + name, double(b.bytes), b.shape, kPlan, Place::Device, Basis::Exact});
    } else {
      act += b.bytes;
      act_f += (act_f.empty() ? "" : " + ") + name.substr(0, name.find(' ')) + " " + b.shape;
    }
  }
  r.lines.push_back({"workspace: activations", double(act), act_f, kPlan, Place::Device, Basis::Exact});
  r.lines.insert(r.lines.end(), rest.begin(), rest.end());
}

void add_cpu_lines(MemReport& r, const InferencePlan& p, const ResidentPeak& peak, bool server, const ModelConfig& c, size_t n_tensors,
                   const std::string& mix) {
  r.lines.push_back({"mapped file (virtual)", double(p.file_bytes),
                     fmt::format("the whole file, {} tensors ({}), mapped read-only; what stays resident is counted below: the "
                                 "load reads it once and releases it",
                                 n_tensors, mix),
                     "", Place::Info, Basis::Exact});
  if (p.packed_bytes > 0)
    r.lines.push_back({"weights repacked for the CPU kernels", double(p.packed_bytes),
                       fmt::format("{} kernels' {}-row panels of the matmul weights (anonymous memory); their {} in the mapping "
                                   "are released after packing",
                                   cpu_kernels_name(), packed_panel_rows(), format_bytes(double(p.packed_from_file))),
                       kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"weights read from the mapping", double(p.mapped_matrix_bytes),
                     "file bytes of the matrices not packed, which every token reads (the embedding's rows are dropped after "
                     "each lookup)",
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"norms and biases", double(p.vector_bytes), "the 1-D tensors, copied out of the mapping at load (f32)", kPlan,
                     Place::Device, Basis::Exact});
  r.lines.push_back({"KV cache", double(p.kv.bytes()),
                     fmt::format("2 (K,V) x {} layers x {} kv_dim ({} heads x {}) x {} B x {} tokens ({} blocks of {})", c.n_layers,
                                 c.kv_dim(), c.n_kv_heads, c.head_dim, p.kv.elem_bytes, p.kv.tokens(), p.kv.n_blocks,
                                 p.kv.block_tokens),
                     kPaged, Place::Device, Basis::Exact});
  add_workspace_lines(r, p);
  r.lines.push_back({"metadata, vocabulary, tokenizer, chat template", double(peak.tables),
                     "measured: heap bytes in use after building them here as the load does (Model::open; glibc mallinfo2)", "",
                     Place::Device, Basis::Measured});
  r.lines.push_back({"runtime: binary, libraries, stacks, allocator", double(peak.runtime),
                     server ? "measured constant: llmq-server's peak RSS minus the other lines (HTTP threads, grammar engine and "
                              "requests included), median over three models and two settings"
                            : "measured constant: llmq-run's peak RSS minus the other lines, median over three models and two contexts",
                     "", Place::Device, Basis::Measured});
  if (peak.load > peak.run)
    r.lines.push_back({"load peak above the run", double(peak.load - peak.run),
                       fmt::format("the checksum pass holds the largest tensor ({}) with the tables: the peak is the load's",
                                   format_bytes(double(p.largest_tensor))),
                       "", Place::Device, Basis::Exact});
}

// --gpu-layers N below the model's layers: the CPU's part (CudaOffloadSession, CudaOffloadBatchRunner) in host memory,
// bytes of the first layers' KV cache (f32) and of the CPU engine's workspace.
void add_cuda_offload_lines(MemReport& r, const LlmqFile& f, const ModelConfig& c, const InferOptions& o, const CudaPlan& p) {
  ModelConfig ck = c;
  ck.n_layers = p.first_layer;
  const KVPlan kv = plan_kv(ck, p.kv_rows);  // a session's ctx, or the server's paged blocks
  const WorkspacePlan ws =
      plan_workspace(c, llama_matmuls(c, f.tensors(), p.n_batch, 1), p.n_batch, p.ctx, 1, resolve_threads(o.threads));
  r.lines.push_back({"CPU: KV cache (partial offload)", double(kv.bytes()),
                     fmt::format("2 (K,V) x {} layers x {} kv_dim x 4 B (f32) x {} tokens", ck.n_layers, c.kv_dim(), kv.tokens()), kPlan,
                     Place::Cpu, Basis::Exact});
  r.lines.push_back({"CPU: workspace (partial offload)", double(ws.bytes()),
                     fmt::format("the CPU engine's workspace for {} tokens, {} threads", p.n_batch, ws.threads), kPlan, Place::Cpu,
                     Basis::Exact});
  r.notes.push_back(fmt::format("partial offload: layers 0-{} run on the CPU from the mapped file ({} of it), their matrices "
                                "repacked for the CPU kernels at load; the GPU takes the residual stream after them",
                                p.first_layer - 1, format_bytes(double(f.file_size()))));
}

// llmq-run --device cuda (one sequence) or llmq-server --device cuda (server: a paged cache):
// every device buffer of the backend, from the plan it allocates from (engine/mem_plan.h
// plan_cuda, plan_cuda_server); the CUDA context is measured at load, not predicted here.
void add_cuda_lines(MemReport& r, const LlmqFile& f, const ModelConfig& c, const InferOptions& o, bool server) {
  const bool q8 = o.kv_type == "q8_0";
  const CudaPlan p = server ? plan_cuda_server(c, f.tensors(), o.ctx, o.n_batch, o.parallel, o.kv_tokens, o.gpu_layers, q8)
                            : plan_cuda(c, f.tensors(), o.ctx, o.n_batch, 1, o.gpu_layers, q8);
  const std::string kv_elem = q8 ? "(1 + 2/32) B (q8_0: int8 and an f16 scale per 32)" : "2 B (f16)";
  const int64_t hd = c.head_dim, Q = c.n_heads * hd, KV = c.n_kv_heads * hd;
  r.device = "cuda (GPU 0)";
  r.title = server ? fmt::format("{}: llmq-server --device cuda, parallel {}, ctx {}, batch {}", f.path(), p.parallel, p.ctx, p.n_batch)
                   : fmt::format("{}: llmq-run --device cuda, ctx {}, batch {}", f.path(), p.ctx, p.n_batch);
  const std::string layers = p.first_layer ? fmt::format("layers {}-{} and the output of", p.first_layer, c.n_layers - 1) : "Σ bytes of";
  r.lines.push_back({"weights", double(p.weights),
                     fmt::format("{} {} tensors ({}), rearranged into quants / scales arrays (the K-quants' scales unpacked: "
                                 "Q4_K 148, Q5_K 180, Q6_K 212 bytes per 256 weights); each tensor, or Q/K/V and gate/up "
                                 "stacked when of one type, 256-byte aligned",
                                 layers, f.tensors().size(), type_mix(f.tensors())),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"KV cache", double(p.kv),
                     server ? fmt::format("2 (K,V) x {} layers x {} kv_dim x {} x {} blocks of {} tokens (paged, shared by {} "
                                          "sequences)",
                                          c.n_layers - p.first_layer, c.kv_dim(), kv_elem, p.kv_blocks, p.block_tokens, p.parallel)
                            : fmt::format("2 (K,V) x {} layers x {} kv_dim x {} x {} tokens", c.n_layers - p.first_layer, c.kv_dim(), kv_elem,
                                          p.ctx),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"workspace: activations", double(p.activations),
                     fmt::format("{} tokens x (2 x {} x, xb + {} qkv + {} att + 3 x {} h, hs) x 4 B", p.n_batch, c.dim, Q + 2 * KV, Q,
                                 c.hidden_dim),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"workspace: logits", double(p.logits), fmt::format("{} row(s) x {} vocab x 4 B", p.logits_rows, c.vocab_size),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"workspace: decode attention parts", double(p.attn_parts),
                     fmt::format("{} token(s) x {} heads x {} parts of {} positions x ({} + 2) x 4 B", std::max<int64_t>(1, p.parallel),
                                 c.n_heads, p.decode_parts, p.decode_part_len, hd),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"workspace: matmul scratch", double(p.matmul.bytes() - p.matmul.cublas_workspace),
                     fmt::format("int8 activations [{} x {}] + scales; prefill: fp16 activations + a dequantized tile of {} rows + MMQ "
                                 "split-K sums",
                                 p.n_batch, p.matmul.cols, p.matmul.tile_rows),
                     kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"workspace: token ids, positions, top-k", double(p.io), "", kPlan, Place::Device, Basis::Exact});
  if (server)
    r.lines.push_back({"workspace: block tables", double(p.paging),
                       fmt::format("cache rows and table rows [{}] + tables [{} x {}] + logits rows [{}], int32", p.n_batch, p.parallel,
                                   p.table_stride, p.logits_rows),
                       kPlan, Place::Device, Basis::Exact});
  r.lines.push_back({"cuBLAS workspace", double(p.matmul.cublas_workspace), "cublasSetWorkspace, 32 MiB (prefill only)", kPlan,
                     Place::Device, Basis::Exact});
  r.lines.push_back({"CUDA context", double(kCudaContextBytes), "measured on an H100 80GB (driver 580, CUDA 13.0): in use before the first "
                     "allocation; other GPUs not measured", "bench/RESULTS.md (GPU memory)", Place::GpuOther, Basis::Measured});
  r.lines.push_back({"CUDA runtime beyond the plan", double(kCudaRuntimeBytes), "measured (H100): cuBLAS handle, kernel modules, cudaMalloc "
                     "rounding (67.6-73.3 MiB)", "bench/RESULTS.md (GPU memory)", Place::GpuOther, Basis::Measured});
  r.notes.push_back("exact: CudaModel and CudaSession allocate these sizes (tests/test_cuda.cpp checks); cudaMalloc rounds each "
                    "allocation up (2 MiB pages for large ones), which the measured line printed at load includes");
  if (p.first_layer > 0)  // partial offload: the CPU's part (CudaOffloadSession, CudaOffloadBatchRunner), in host memory
    add_cuda_offload_lines(r, f, c, o, p);
}

// llmq-run/llmq-server --tp N on the CPU: per rank, the weights of its slices, its pool of the
// KV cache (its KV heads) and its workspace, all from the plan TensorParallel allocates from
// (engine/tp.h: plan_shards, shard_weight_bytes, rank_workspace_plan). The ranks share one
// process and one mapping of the file; the row-parallel slices are copies each rank owns.
void add_cpu_tp_lines(MemReport& r, const LlmqFile& f, const ModelConfig& c, const InferencePlan& p, const InferOptions& o) {
  const std::vector<ShardRanges> ranks = plan_shards(c, f.tensors(), o.tp);
  const int total = resolve_threads(o.threads);
  r.device = fmt::format("cpu, {} tensor-parallel ranks in one process", o.tp);
  nlohmann::json per_rank = nlohmann::json::array();
  for (const ShardRanges& R : ranks) {
    const int threads = std::max(1, total / o.tp + (R.rank < total % o.tp));
    const uint64_t w = shard_weight_bytes(c, f.tensors(), R);
    const uint64_t kv = 2 * uint64_t(p.kv.n_blocks) * uint64_t(p.kv.block_tokens) * uint64_t(c.n_layers) *
                        uint64_t(R.n_kv_heads * c.head_dim) * uint64_t(p.kv.elem_bytes);
    const uint64_t ws = rank_workspace_plan(c, f.tensors(), R, p.n_batch, threads).bytes();
    const uint64_t packed = shard_packed_bytes(c, f.tensors(), R);
    r.lines.push_back({fmt::format("rank {}: weights", R.rank), double(w),
                       fmt::format("heads {}-{}, KV heads {}-{}, FFN {}-{}, vocab {}-{}: row slices of q/k/v/gate/up/embedding/output, "
                                   "column slices of attn_output/ffn_down (copied), norms replicated",
                                   R.head0, R.head0 + R.n_heads - 1, R.kv_head0, R.kv_head0 + R.n_kv_heads - 1, R.ffn0,
                                   R.ffn0 + R.ffn_dim - 1, R.vocab0, R.vocab0 + R.n_vocab - 1),
                       kMegatron, Place::Device, Basis::Exact});
    if (packed > 0)
      r.lines.push_back({fmt::format("rank {}: packed copies", R.rank), double(packed),
                         fmt::format("{} kernels' panels of the rank's own slices (column slices of attn_output/ffn_down, row "
                                     "slices not starting on a 16-row panel)",
                                     cpu_kernels_name()),
                         kPlan, Place::Device, Basis::Exact});
    r.lines.push_back({fmt::format("rank {}: KV cache", R.rank), double(kv),
                       fmt::format("2 x {} blocks x {} tokens x {} layers x {} KV heads x {} head_dim x {} B", p.kv.n_blocks,
                                   p.kv.block_tokens, c.n_layers, R.n_kv_heads, c.head_dim, p.kv.elem_bytes),
                       kPaged, Place::Device, Basis::Exact});
    r.lines.push_back({fmt::format("rank {}: workspace", R.rank), double(ws),
                       fmt::format("activations of the rank's widths for {} tokens, matmul scratch for {} threads (scores and logits "
                                   "grow with use)",
                                   p.n_batch, threads),
                       kPlan, Place::Device, Basis::Exact});
    per_rank.push_back(
        {{"rank", R.rank}, {"weights", w}, {"packed", packed}, {"kv_cache", kv}, {"workspace", ws}, {"threads", threads}});
  }
  uint64_t shared_from = 0;
  const uint64_t shared = model_packed_bytes(f.tensors(), c.n_layers, 0, o.tp, &shared_from);
  if (shared > 0)
    r.lines.push_back({"weights repacked for the CPU kernels (shared)", double(shared),
                       fmt::format("{} kernels' 16-row panels of the whole model's column-parallel matrices (not attn_output, "
                                   "ffn_down: each rank packs its columns of those), one allocation the ranks' row slices "
                                   "point into (Model::load with tp {}); their {} in the mapping are released",
                                   cpu_kernels_name(), o.tp, format_bytes(double(shared_from))),
                       kPlan, Place::Device, Basis::Exact});
  r.extra["ranks"] = per_rank;
  r.notes.push_back("weights per rank are what its tensors point at or own (TensorParallel, engine/tp.h); the ranks are threads of "
                    "one process sharing one mapping of the file, so the process maps the file once and adds the row-parallel copies");
}

// CUDA with --tp N, per rank (bytes): its weights, KV cache and workspace on the GPU, its all-reduce staging in host memory.
void add_cuda_tp_lines(MemReport& r, const LlmqFile& f, const ModelConfig& c, const InferencePlan& p, const InferOptions& o,
                       bool server) {
  TpOptions topt;
  topt.vocab_parallel = false;
  const std::vector<ShardRanges> ranges = plan_shards(c, f.tensors(), o.tp, topt);
  r.device = fmt::format("cuda, {} ranks", o.tp);
  r.title = fmt::format("{}: {} --device cuda --tp {}, ctx {}, batch {}", f.path(), server ? "llmq-server" : "llmq-run", o.tp, p.ctx,
                        p.n_batch);
  nlohmann::json per_rank = nlohmann::json::array();
  for (const ShardRanges& R : ranges) {
    const CudaPlan rp = plan_cuda_rank(c, f.tensors(), R, o.ctx, o.n_batch, 1, server ? o.parallel : 0, o.kv_tokens, o.kv_type == "q8_0");
    const std::string k = fmt::format("rank {}: ", R.rank);
    r.lines.push_back({k + "weights", double(rp.weights),
                       fmt::format("heads {}-{}, KV heads {}-{}, FFN {}-{} (Megatron split), embedding whole{}; 256-byte aligned pieces",
                                   R.head0, R.head0 + R.n_heads - 1, R.kv_head0, R.kv_head0 + R.n_kv_heads - 1, R.ffn0,
                                   R.ffn0 + R.ffn_dim - 1, R.n_vocab > 0 ? ", output" : ""),
                       kPlan, Place::Device, Basis::Exact});
    r.lines.push_back({k + "KV cache", double(rp.kv),
                       fmt::format("2 (K,V) x {} layers x {} kv heads x {} head_dim x {} x {} tokens", c.n_layers, R.n_kv_heads,
                                   c.head_dim, o.kv_type == "q8_0" ? "(1 + 2/32) B (q8_0)" : "2 B (f16)", rp.kv_rows),
                       kPlan, Place::Device, Basis::Exact});
    r.lines.push_back({k + "workspace (cuBLAS's included)", double(rp.workspace()),
                       fmt::format("activations for {} tokens at the rank's widths, logits {}, matmul scratch", rp.n_batch,
                                   R.n_vocab > 0 ? "here" : "on rank 0"),
                       kPlan, Place::Device, Basis::Exact});
    r.lines.push_back({k + "all-reduce staging (pinned host)", double(rp.n_batch * c.dim * 4),
                       fmt::format("[{} tokens, {} dim] fp32, ranks on one GPU (with one GPU per rank NCCL keeps its own buffers)",
                                   rp.n_batch, c.dim),
                       kPlan, Place::Cpu, Basis::Exact});
    per_rank.push_back({{"rank", R.rank}, {"weights", rp.weights}, {"kv_cache", rp.kv}, {"workspace", rp.workspace()}});
  }
  r.extra["ranks"] = per_rank;
  r.lines.push_back({"CUDA context (per GPU)", 0, "not predicted: measured at load", "", Place::GpuOther, Basis::NotMeasured});
  r.lines.push_back({"NCCL buffers (one GPU per rank)", 0, "not measured: NCCL allocates its own", "", Place::GpuOther,
                     Basis::NotMeasured});
  r.notes.push_back("exact: CudaRanks allocates these sizes per rank (tests/test_cuda.cpp checks); with every rank on one GPU their "
                    "sum is that GPU's; lines marked 'not measured' are not in the total");
}

// UsageError unless --device, --kv-type (for that device) and --tp are valid.
void check_infer_options(const InferOptions& o) {
  if (o.device != "cpu" && o.device != "cuda") throw UsageError("--device must be cpu or cuda");
  if (o.kv_type != "f32" && o.kv_type != "bf16" && o.kv_type != "f16" && o.kv_type != "q8_0")
    throw UsageError("--kv-type must be f32, bf16, f16 or q8_0");
  if (o.device == "cpu" && (o.kv_type == "f16" || o.kv_type == "q8_0"))
    throw UsageError("the CPU engine stores the KV cache as f32 or bf16 (--kv-type)");
  if (o.tp < 1) throw UsageError("--tp must be >= 1");
}

uint64_t heap_in_use() {
  const struct mallinfo2 m = ::mallinfo2();
  return uint64_t(m.uordblks + m.hblkhd);
}

}  // namespace

uint64_t measure_tables(const std::string& path) {
  const uint64_t before = heap_in_use();
  auto m = Model::open(path, /*verify=*/false);
  const uint64_t after = heap_in_use();
  return after > before ? after - before : 0;
}

ResidentPeak resident_peak(const InferencePlan& p, uint64_t tables, bool server) {
  ResidentPeak r;
  r.tables = tables;
  r.runtime = server ? kServerRuntimeBytes : kRuntimeBytes;
  r.run = p.resident() + tables + r.runtime;
  r.load = p.largest_tensor + tables + r.runtime;
  return r;
}

int resolve_threads(int threads) { return threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency())); }

InferencePlan infer_plan(const LlmqFile& f, const ModelConfig& c, const InferOptions& o) {
  InferencePlan p = plan_inference(f, c, o.ctx, o.n_batch, resolve_threads(o.threads), o.parallel, o.server, o.kv_tokens);
  p.kv.elem_bytes = o.kv_type == "f32" ? 4 : 2;  // bf16 (CPU) or f16 (CUDA plan)
  return p;
}

MemReport infer_report(const std::string& path, const InferOptions& o) {
  check_infer_options(o);
  auto f = LlmqFile::open(path, /*verify=*/false);
  const ModelConfig c = file_config(*f);
  const InferencePlan p = infer_plan(*f, c, o);
  MemReport r;
  r.budget = o.budget;
  const bool server = o.parallel > 1 || o.server;
  r.title = fmt::format("{}: {} ctx {}, {} sequence{}, KV {} tokens, batch {}, {} threads", f->path(), server ? "llmq-server" : "llmq-run",
                        p.ctx, p.parallel, p.parallel > 1 ? "s" : "", p.kv_tokens, p.n_batch, p.ws.threads);
  r.extra["plan"] = {{"ctx", p.ctx},           {"parallel", p.parallel},        {"kv_tokens", p.kv_tokens},
                     {"kv_blocks", p.kv.n_blocks}, {"n_batch", p.n_batch},       {"threads", p.ws.threads},
                     {"cpu_kernels", cpu_kernels_name()}, {"weights", p.weight_bytes}, {"file", p.file_bytes},
                     {"kv_cache", p.kv.bytes()},   {"workspace", p.ws.bytes()},  {"packed_weights", p.packed_bytes}, {"total", p.total()}};
  if (o.device == "cpu" && o.tp == 1) {
    r.device = "cpu";
    const ResidentPeak peak = resident_peak(p, measure_tables(path), server);
    r.extra["plan"]["resident"] = p.resident();
    r.extra["peak"] = {{"run", peak.run}, {"load", peak.load}, {"peak", peak.peak()}, {"tables", peak.tables}};
    add_cpu_lines(r, p, peak, server, c, f->tensors().size(), type_mix(f->tensors()));
    r.notes.push_back(fmt::format("the total is the predicted peak RSS of llmq-run (tests/test_mem.cpp checks it against measured "
                                  "peaks); the exact lines are what llmq-run/llmq-server allocate from this plan (CPU kernels: {}; "
                                  "LLMQ_CPU and --threads change the matmul scratch)",
                                  cpu_kernels_name()));
    return r;
  }
  if (o.device == "cpu") {  // --tp N on the CPU: the engine's own shards (engine/tp.h), every rank
    add_cpu_tp_lines(r, *f, c, p, o);
    return r;
  }
  if (o.tp == 1) {  // one GPU: the plan CudaModel and CudaSession allocate from (engine/cuda/session.h)
    if (o.kv_type == "bf16") throw UsageError("the CUDA backend's KV cache is f16 or q8_0 (--kv-type)");
    add_cuda_lines(r, *f, c, o, server);
    return r;
  }
  // CUDA with --tp N: every rank from the plan CudaRanks allocates from (engine/cuda/session.h):
  // its shard's weights (embedding replicated, the output on rank 0), its KV heads' cache, its
  // widths' workspace; ranks on one GPU stage each all-reduce through pinned host memory.
  if (o.kv_type == "bf16") throw UsageError("the CUDA backend's KV cache is f16 or q8_0 (--kv-type)");
  if (o.gpu_layers >= 0) throw UsageError("--gpu-layers with --tp: partial offload runs one rank, so far");
  add_cuda_tp_lines(r, *f, c, p, o, server);
  return r;
}

FitResult fit_inference(const LlmqFile& f, const ModelConfig& c, InferOptions o, double budget, bool fix_ctx, bool fix_parallel) {
  // llmq-run (one Session) when parallel stays 1; otherwise llmq-server with parallel x ctx KV tokens.
  const bool session = fix_parallel && o.parallel <= 1 && !o.server;
  auto plan = [&](int64_t ctx, int64_t par) {
    InferOptions t = o;
    t.ctx = ctx, t.parallel = par, t.server = !session;
    t.kv_tokens = session ? 0 : ctx * par;
    return std::pair{t, infer_plan(f, c, t)};
  };
  const bool gpu = o.device == "cuda";
  const uint64_t tables = gpu ? 0 : measure_tables(f.path());
  auto cuda_plan = [&](const InferOptions& t) {
    return session ? plan_cuda(c, f.tensors(), t.ctx, t.n_batch, 1) : plan_cuda_server(c, f.tensors(), t.ctx, t.n_batch, t.parallel, t.kv_tokens);
  };
  auto total = [&](int64_t ctx, int64_t par) {
    const auto [t, pl] = plan(ctx, par);
    return gpu ? double(cuda_plan(t).total() + kCudaContextBytes + kCudaRuntimeBytes) : double(resident_peak(pl, tables, t.server).peak());
  };
  auto fits = [&](int64_t ctx, int64_t par) { return total(ctx, par) <= budget; };
  const int64_t bt = kKvBlockTokens;
  // Largest x in [lo, hi] (in units of step) with ok(x); lo when none.
  auto largest = [](int64_t lo, int64_t hi, const std::function<bool(int64_t)>& ok) {
    if (!ok(lo)) return lo;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (ok(mid)) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  int64_t par = fix_parallel ? std::max<int64_t>(1, o.parallel) : 1;
  int64_t ctx = fix_ctx && o.ctx > 0 ? o.ctx : 0;
  if (ctx == 0) {
    const int64_t max_blocks = std::max<int64_t>(1, c.context_length / bt);
    ctx = bt * largest(1, max_blocks, [&](int64_t n) { return fits(n * bt, par); });
  }
  if (!fix_parallel) par = largest(1, 256, [&](int64_t p) { return fits(ctx, p); });
  auto [opt, pl] = plan(ctx, par);
  FitResult r{opt, pl, std::nullopt, total(ctx, par) <= budget, resident_peak(pl, tables, opt.server)};
  if (gpu) r.cuda = cuda_plan(opt);
  return r;
}

int64_t fit_gpu_layers(const LlmqFile& f, const ModelConfig& c, const InferOptions& o, double gpu_budget) {
  const bool server = o.parallel > 1 || o.server;
  auto fits = [&](int64_t n) {
    const CudaPlan p = server ? plan_cuda_server(c, f.tensors(), o.ctx, o.n_batch, o.parallel, o.kv_tokens, n)
                              : plan_cuda(c, f.tensors(), o.ctx, o.n_batch, 1, n);
    return double(p.total()) <= gpu_budget;
  };
  if (!fits(0)) return -1;
  int64_t lo = 0, hi = c.n_layers;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

nlohmann::json fit_json(const FitResult& r, double budget) {
  const InferencePlan& p = r.plan;
  if (r.cuda) {
    const CudaPlan& g = *r.cuda;
    return {{"fits", r.fits},         {"device", "cuda"},         {"budget", std::llround(budget)}, {"ctx", g.ctx},
            {"parallel", r.options.parallel}, {"kv_tokens", g.kv_rows}, {"n_batch", g.n_batch},       {"weights", g.weights},
            {"kv_cache", g.kv},       {"workspace", g.workspace()}, {"total", g.total()},
            {"cuda_context", kCudaContextBytes + kCudaRuntimeBytes},
            {"note", "GPU memory: the plan's allocations plus the CUDA context and runtime measured on an H100 (cuda_context)"}};
  }
  return {{"fits", r.fits},
          {"budget", std::llround(budget)},
          {"ctx", p.ctx},
          {"parallel", p.parallel},
          {"kv_tokens", p.kv_tokens},
          {"n_batch", p.n_batch},
          {"threads", p.ws.threads},
          {"weights", p.weight_bytes},
          {"file", p.file_bytes},
          {"kv_cache", p.kv.bytes()},
          {"workspace", p.ws.bytes()},
          {"total", r.peak.peak()},
          {"mapped", p.total()},
          {"gpu_layers", "n/a (CPU plan: every layer on the CPU; with --device cuda --fit plans GPU layers)"}};
}

double parse_size(const std::string& text) {
  std::string s;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch))) s += ch;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw UsageError("bad size '" + text + "' (e.g. 8GiB, 512MiB, 80GB, 123456)");
  }
  std::string unit = s.substr(used);
  for (auto& ch : unit) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> units = {
      {"", 1},          {"b", 1},           {"k", 1024},       {"kib", 1024},     {"kb", 1e3},  {"m", 1024.0 * 1024},
      {"mib", 1024.0 * 1024}, {"mb", 1e6}, {"g", 1024.0 * 1024 * 1024}, {"gib", 1024.0 * 1024 * 1024}, {"gb", 1e9},
      {"t", 1024.0 * 1024 * 1024 * 1024}, {"tib", 1024.0 * 1024 * 1024 * 1024}, {"tb", 1e12}};
  auto it = units.find(unit);
  if (it == units.end() || v < 0) throw UsageError("bad size '" + text + "' (e.g. 8GiB, 512MiB, 80GB, 123456)");
  return v * it->second;
}

uint64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

ModelConfig file_config(const LlmqFile& f) {
  try {
    return ModelConfig::from_metadata(f.meta());
  } catch (const std::exception& e) {
    throw FileError(f.path(), e.what());
  }
}

}  // namespace llmq::mem
