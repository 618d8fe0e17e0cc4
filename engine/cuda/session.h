// The Llama forward pass on one NVIDIA GPU: the weights uploaded once (CudaModel) and one
// sequence with its fp16 KV cache (CudaSession). The kernels are in the files beside this one:
// matmul.h (GEMV, cuBLAS), ops.h (norms, RoPE, SwiGLU, embedding), attention.h, sampling.h.
// The CPU forward pass it mirrors, step for step, is forward_shard in engine/model.cpp.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/cuda/attention.h"
#include "engine/cuda/cuda.h"
#include "engine/cuda/matmul.h"
#include "engine/comm.h"
#include "engine/comm_host.h"
#include "engine/model.h"

namespace llmq::cuda {

/// One transformer block's weights on the GPU (views into CudaModel's allocation).
struct DeviceLayer {
  const float* attn_norm = nullptr;    // [D]
  std::vector<DeviceWeight> qkv;       // wq [Q, D], wk [KV, D], wv [KV, D], or one [Q + 2KV, D] matrix
  const float* bqkv = nullptr;         // [Q + 2KV] or null (Qwen2-style biases)
  DeviceWeight wo;                     // [D, Q]
  const float* bo = nullptr;           // [D] or null
  const float* q_norm = nullptr;       // [hd] or null (QK-norm)
  const float* k_norm = nullptr;       // [hd] or null
  const float* post_attn_norm = nullptr;  // [D] or null (pre_post norms)
  const float* ffn_norm = nullptr;     // [D]
  std::vector<DeviceWeight> gate_up;   // w_gate [H, D], w_up [H, D], or one [2H, D] matrix
  DeviceWeight w_down;                 // [D, H]
  const float* post_ffn_norm = nullptr;  // [D] or null (pre_post norms)
};

struct UploadPlan;  // CudaModel's upload jobs (session.cpp)

/// A model's weights on the current GPU, in one device allocation: every matrix in the split
/// layout of matmul.h (the file's bytes rearranged; the K-quants' scales unpacked: Q4_K, Q5_K 4
/// bytes more per 256 weights, Q6_K 2), norms and biases as fp32.
/// Q/K/V (and gate/up) of the same type are stored as one matrix, so one GEMV reads them.
class CudaModel {
 public:
  /// Uploads the weights of m (progress on stderr when `progress`). Throws CudaError when
  /// they do not fit on the device. first_layer > 0 (partial offload, llmq-run --gpu-layers):
  /// only layers first_layer .. n_layers-1, the output norm and the output (no embedding unless
  /// tied to the output); the CPU runs the layers before (CudaOffloadSession).
  explicit CudaModel(const Model& m, bool progress = false, int64_t first_layer = 0);
  /// One tensor-parallel rank's weights (engine/tp.h make_shard: its query and KV heads, FFN
  /// units and output rows; embedding replicated). config() is then the rank's: n_heads,
  /// n_kv_heads, hidden_dim of its slices (so the kernels run on its widths); a shard whose
  /// query heads do not start and end on KV-group boundaries (an uneven GQA split: a KV head
  /// held by two ranks) keeps the mapping in gqa(). Throws UsageError with a
  /// vocabulary-parallel embedding.
  CudaModel(const Model& m, const ModelShard& shard, bool progress = false);
  /// Weights of type `type` with the shapes of c, random and made on the device (norms 1, no
  /// biases, untied output unless c.tied_embeddings): for synthetic benchmarks of large shapes
  /// without a file. Throws CudaError when they do not fit.
  CudaModel(const ModelConfig& c, DType type, uint64_t seed);
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return c_; }
  /// How this rank's query heads map onto its KV heads (default: evenly, n_heads / n_kv_heads).
  const GqaSlice& gqa() const { return gqa_; }
  /// The model's first layer held here: layers[i] is model layer first_layer() + i.
  int64_t first_layer() const { return first_layer_; }
  /// Bytes of the weight allocation (the file's tensor bytes plus alignment padding).
  uint64_t weight_bytes() const { return buf_.bytes(); }
  /// Device memory the upload took, measured with cudaMemGetInfo before and after.
  uint64_t measured_bytes() const { return measured_; }
  /// RoPE frequencies of model layer `layer` (ModelConfig::rope_freqs): [hd/2] device fp64.
  const double* rope_freqs(int64_t layer) const { return rope_ + c_.rope_table(layer) * (c_.head_dim / 2); }

  DeviceWeight token_embd;           // [V, D] (empty when first_layer > 0, unless tied)
  std::vector<DeviceLayer> layers;   // [n_layers - first_layer]
  const float* output_norm = nullptr;  // [D]
  DeviceWeight output;               // [V, D] (the embedding when tied)

 private:
  void build(const Model* m, const ModelShard* shard, DType type, uint64_t seed, bool progress);
  void plan_host(UploadPlan& u, const Model& m, const ModelShard* shard);  // the upload jobs of a host model or shard
  void plan_synthetic(UploadPlan& u, DType type);                          // ... of random weights
  ModelConfig c_;
  GqaSlice gqa_;  // an uneven GQA split's head mapping (attention.h)
  int64_t first_layer_ = 0;
  DeviceBuffer buf_;
  const double* rope_ = nullptr;  // [rope tables, hd/2] fp64 RoPE frequencies (in buf_)
  uint64_t measured_ = 0;
};

/// One sequence on the GPU: its fp16 KV cache [n_layers, 2, ctx, KV] (or Q8_0, CudaPlan::kv_q8), the activation buffers
/// for n_batch tokens and the decode step captured as a CUDA graph (replayed for every token;
/// LLMQ_CUDA_GRAPH=0 turns graphs off). All device memory is allocated at construction.
/// Made from plan_cuda_server instead, the cache is a pool of paged blocks
/// [n_layers, 2, kv_blocks · block_tokens, KV] that forward_batch runs many sequences over
/// (continuous batching; CudaBatchRunner below).
class CudaSession : public SessionBase {
 public:
  /// ctx, n_batch as Session (engine/mem_plan.h session_sizes); logits_rows: logits rows kept
  /// for forward(..., all_logits) (at most n_batch). `m` is the host model (config, tokenizer);
  /// null for a synthetic model, whose session has no model(). Throws CudaError when the
  /// buffers do not fit, UsageError for shapes the kernels do not take.
  CudaSession(const CudaModel& dm, const Model* m, int64_t ctx, int64_t n_batch = 512, int64_t logits_rows = 1);
  /// The buffers of `plan` (plan_cuda, or plan_cuda_server for a paged cache); errors as above.
  CudaSession(const CudaModel& dm, const Model* m, const CudaPlan& plan);
  ~CudaSession() override;
  /// Tensor parallelism: this session is rank comm->rank() of a group whose ranks each run a
  /// session on their CudaModel shard with the same tokens; after the attention output and FFN
  /// down projections the partial sums [T, dim] are all-reduced through `comm` (device_memory:
  /// comm takes device pointers, as NCCL; else they are staged through pinned host memory, as
  /// for HostComm). Only rank 0 computes logits. CUDA graphs are off (the collectives wait on
  /// the host). Call before the first forward.
  void set_comm(Communicator* comm, bool device_memory);
  /// Times every later forward pass per op class into `p` (null: off): each pass waits for the
  /// GPU at its end and runs without CUDA graphs (llmq-bench --profile).
  void set_profile(OpProfile* p) { prof_ = p; }
  /// Hands the session its model upload to keep (freed with the session).
  void own(std::unique_ptr<CudaModel> dm) { own_model_ = std::move(dm); }
  const CudaModel& device_model() const { return dm_; }

  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false) override;
  /// Feeds `token` at pos() and returns the greedy next token, chosen on the GPU (only the id
  /// is copied back).
  int32_t decode_greedy(int32_t token);
  /// One token through the step whose graph copies back only what `sampler` needs: the id
  /// (greedy: argmax on the GPU), or the top_k candidates (top_k <= kMaxTopK, no penalties:
  /// Sampler::sample_top draws from them); otherwise, and for prompts, forward() + sample().
  int32_t forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) override;
  /// Partial offload (a model uploaded from first_layer > 0): the residual stream entering the
  /// first GPU layer, [n_batch, dim] pinned host memory. forward() and forward_sample() then take
  /// rows 0 .. n-1 of it as the input of their n tokens (the tokens still give the count and
  /// the positions); the caller fills it first. Null for a whole model.
  float* hidden_input() { return h_hidden_.bytes() ? h_hidden_.as<float>() : nullptr; }
  /// Runs `tokens` [n] (n <= n_batch) without copying logits back: for measuring prefill.
  void prefill(const int32_t* tokens, int64_t n);
  /// Continuous batching on a session made from plan_cuda_server: a batch mixing the sequences
  /// of `tables` (a KVCache::tables_only of the plan's kv_blocks and block_tokens, whose block
  /// tables say where each sequence's positions are in this session's cache), with
  /// forward_batch's contract (engine/model.h): logits [n_flagged, vocab] in host memory, the
  /// cache lengths advanced. Throws UsageError as forward_batch, and for more flagged tokens
  /// than the plan's logits_rows, more sequences than its `parallel`, or a sequence holding
  /// more than ctx positions; on a session of one sequence.
  /// advance = false leaves the cache lengths (tensor-parallel ranks share one table: their
  /// driver advances it once, from batch_plan().ends).
  const float* forward_batch(KVCache& tables, const BatchToken* batch, int64_t T, bool advance = true);
  /// The positions of the last forward_batch.
  const BatchPlan& batch_plan() const { return bplan_; }

  const Model& model() const override;
  int64_t pos() const override { return pos_; }
  int64_t ctx() const override { return plan_.ctx; }
  int64_t n_batch() const override { return plan_.n_batch; }
  /// The plan the session was made from.
  const CudaPlan& plan() const { return plan_; }
  /// Logits rows forward(..., all_logits) can return.
  int64_t logits_rows() const { return plan_.logits_rows; }
  void truncate(int64_t n) override;
  uint64_t kv_bytes() const override { return kv_.bytes(); }
  uint64_t workspace_bytes() const override;
  /// Device memory the session's allocations took, measured with cudaMemGetInfo.
  uint64_t measured_bytes() const { return measured_; }
  /// Positions per part of decode attention (flash-decoding), and the number of parts.
  int64_t decode_part_len() const { return plan_.decode_part_len; }
  int64_t decode_parts() const { return plan_.decode_parts; }

 private:
  enum class Out { None, Logits, Greedy, TopK };
  void check_tokens(const int32_t* tokens, int64_t n) const;
  void stage(const int32_t* tokens, int64_t n);  // tokens and positions into the pinned buffers
  // The forward pass of T staged tokens, enqueued on the stream: logits of rows [r0, r0 + rows)
  // (Out::Logits: copied to the host buffer; Out::Greedy: rows = 1, argmax copied back;
  // Out::TopK: rows = 1, the top_k_ candidates copied back).
  // Paged (forward_batch): the cache rows, block tables and logits rows staged in h_paging_.
  void enqueue(int64_t T, int64_t r0, int64_t rows, Out out, bool paged = false);
  void run_decode(Out out);  // one staged token: the graph of this Out (captured on first use)
  bool no_cublas(int64_t T) const;  // every product of a T-token pass runs on our kernels (graph-safe)
  // enqueue's steps (engine/cuda/session.cpp).
  struct PassInputs {
    const int32_t *tok = nullptr, *pos = nullptr;  // [T] device
    const int32_t* kv_row = nullptr;                // paged: [T] cache rows
    KvPages pages;                                  // paged: the block tables
    const int32_t* out_rows = nullptr;              // paged: the flagged tokens' batch rows
  };
  struct LayerKv {
    uint16_t *kc = nullptr, *vc = nullptr;  // fp16 cache, or null with
    KvQ8 q8;                                // a Q8_0 cache
  };
  void mark(const char* op);
  PassInputs stage_inputs(int64_t T, bool paged);
  void norm_for(const DeviceWeight& next, float* x, const float* y, float* out, const float* w, int64_t T);
  LayerKv layer_kv(int64_t l);
  void matmul_cols(const std::vector<DeviceWeight>& ws, const float* in, float* y, int64_t ld, int64_t T);
  void attention_block(int64_t l, int64_t T, const PassInputs& in);
  void ffn_block(int64_t l, int64_t T);
  void output(int64_t r0, int64_t rows, Out out, const PassInputs& in);
  // Runs what enqueue_fn enqueues through `exec`, capturing it into a CUDA graph on first use
  // (every pointer and size fixed; tokens, positions and tables are read from pinned host
  // buffers by the graph's copies at each replay), or directly when graphs are off.
  void launch(cudaGraphExec_t& exec, const std::function<void()>& enqueue_fn);

  std::unique_ptr<CudaModel> own_model_;  // set by own(); destroyed after every buffer below
  const CudaModel& dm_;
  const Model* m_;
  CudaPlan plan_;            // every size (ctx, n_batch, logits rows, cache rows, decode parts, paging)
  int64_t pos_ = 0;
  BatchPlan bplan_;          // paged: forward_batch's positions
  cudaStream_t stream_ = nullptr;
  bool use_graphs_ = true;
  // LLMQ_CUDA_SKIP (a timing experiment, session.cpp parse_skip): op classes of the layers not launched
  enum SkipOp : unsigned { kSkipNorm = 1, kSkipRopeKv = 2, kSkipAttention = 4, kSkipGatedAct = 8, kSkipMatmul = 16 };
  static unsigned parse_skip(const char* list);
  bool skip(SkipOp op) const { return (skip_ & op) != 0; }
  unsigned skip_ = 0;
  cudaGraphExec_t graph_logits_ = nullptr, graph_greedy_ = nullptr, graph_topk_ = nullptr;
  std::vector<cudaGraphExec_t> batch_graphs_;  // forward_batch decode steps of T tokens at [T] (T <= kCudaMmqMaxTokens)
  int top_k_ = 0;                           // k of graph_topk_
  DeviceBuffer kv_;                         // [L, 2, ctx, KV] fp16
  DeviceBuffer tokens_, pos_buf_, next_;    // [n_batch] int32 x2, [1] int32
  DeviceBuffer topk_ids_, topk_vals_;       // [kMaxTopK] int32, float
  DeviceBuffer x_, xb_, qkv_, att_, h_, hs_, logits_, partial_;
  DeviceBuffer paging_;  // paged: rows [n_batch], seq [n_batch], tables [parallel, table_stride], out [logits_rows] int32
  PinnedBuffer h_tokens_, h_pos_, h_next_, h_logits_, h_topk_ids_, h_topk_vals_, h_paging_;
  PinnedBuffer h_hidden_;  // partial offload: [n_batch, D] input of the first GPU layer
  Communicator* comm_ = nullptr;  // tensor parallelism (set_comm)
  bool comm_device_ = false;
  PinnedBuffer h_reduce_;  // host-staged all-reduce: [n_batch, D]
  void all_reduce(float* x, int64_t n);
  std::unique_ptr<MatmulContext> mm_;
  uint64_t measured_ = 0;
  OpProfile* prof_ = nullptr;  // set_profile
};

/// Partial offload (llmq-run --gpu-layers N, llama.cpp's -ngl): the first n_layers - N layers on
/// the CPU (their KV cache in host memory; forward_shard with layer_end), the last N layers, the
/// final norm and the output on the GPU (a CudaSession of a CudaModel uploaded from that layer).
/// The residual stream [T, dim] crosses to the GPU once per forward pass, through pinned
/// memory; the GPU part is as CudaSession (decode graph, sampling on the GPU).
class CudaOffloadSession : public SessionBase {
 public:
  /// gpu_layers in [0, n_layers) (all layers: use CudaSession); ctx, n_batch, logits_rows as
  /// Session; m must have been loaded with pack_layers = n_layers - gpu_layers (or unpacked).
  /// Throws UsageError for gpu_layers out of range, CudaError when the GPU part does not fit.
  CudaOffloadSession(const Model& m, ThreadPool& pool, int64_t gpu_layers, int64_t ctx, int64_t n_batch = 512,
                     int64_t logits_rows = 1, bool progress = false, bool kv_q8 = false);
  ~CudaOffloadSession() override;
  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false) override;
  int32_t forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) override;
  const Model& model() const override { return m_; }
  int64_t pos() const override { return gpu_->pos(); }
  int64_t ctx() const override { return gpu_->ctx(); }
  int64_t n_batch() const override { return gpu_->n_batch(); }
  void truncate(int64_t n) override;
  /// KV cache bytes: the CPU layers' (host) plus the GPU layers' (device).
  uint64_t kv_bytes() const override { return cache_.bytes() + gpu_->kv_bytes(); }
  uint64_t workspace_bytes() const override { return ws_.bytes() + gpu_->workspace_bytes(); }
  uint64_t host_kv_bytes() const { return cache_.bytes(); }
  uint64_t host_workspace_bytes() const { return ws_.bytes(); }
  int64_t cpu_layers() const { return cpu_layers_; }
  const CudaModel& device_model() const { return *dm_; }
  const CudaSession& gpu() const { return *gpu_; }

 private:
  void check_input(const int32_t* tokens, int64_t n, bool all_logits) const;
  // The CPU's layers for one chunk of tokens at pos(): the residual stream into the GPU's input.
  void run_cpu(const int32_t* tokens, int64_t n);

  const Model& m_;
  ThreadPool& pool_;
  int64_t cpu_layers_;
  KVCache cache_;  // the CPU layers only
  int32_t seq_;
  Workspace ws_;
  BatchPlan plan_;
  std::vector<BatchToken> batch_;
  std::unique_ptr<CudaModel> dm_;
  std::unique_ptr<CudaSession> gpu_;
};

/// Communicators for tensor-parallel ranks on GPUs: comms[r] for the rank on device devices[r]
/// (NCCL, device buffers). Empty: every rank on GPU 0 over a HostCommGroup.
struct CudaComms {
  std::vector<std::unique_ptr<Communicator>> comms;  // one per rank held here
  std::vector<int> devices;                          // each held rank's GPU
  /// >= 0: a group over processes (engine/parallel/tp_process.h) of which this process holds rank
  /// `local_rank` only, with comms[0] and devices[0] its communicator and GPU; the other ranks
  /// run elsewhere at the same time. -1: every rank is held here.
  int local_rank = -1;
  /// Whether the communicators take device buffers (NCCL) or host ones (staged through pinned
  /// memory: HostComm, MpiComm).
  bool device_memory = true;
};

/// N tensor-parallel ranks on the GPU: each a CudaSession on its CudaModel shard (engine/tp.h's
/// Megatron-LM split; embedding replicated, the output projection on rank 0), run at once by N
/// host threads, meeting for the two all-reduces per layer in a HostCommGroup (every rank on
/// GPU 0: what checks the sharded path against TP = 1 on one device) or over NCCL (one rank per
/// GPU, CudaComms), or one rank of a group over processes (CudaComms::local_rank). One rank: the
/// whole model, no thread or communicator. A KV head whose GQA group straddles two ranks is held
/// by both (CudaModel::gqa).
class CudaRanks {
 public:
  /// plan_of(c) gives the session plan of a rank whose config (widths) is c. Throws UsageError
  /// when the ranks cannot be formed (plan_shards), CudaError when they do not fit.
  CudaRanks(const Model& m, int n_ranks, const std::function<CudaPlan(const ModelConfig&)>& plan_of, bool progress,
            CudaComms comms = {});
  ~CudaRanks();
  int size() const { return int(sessions_.size()); }
  CudaSession& session(int r) { return *sessions_.at(size_t(r)); }
  const CudaSession& session(int r) const { return *sessions_.at(size_t(r)); }
  const CudaModel& model(int r) const { return *models_.at(size_t(r)); }
  /// fn(r) for every rank at once, each on its own thread with its device current; when one
  /// throws, the others are released (the communicator aborted) and every later call throws.
  void run(const std::function<void(int)>& fn);
  /// The rank of session(0) in the group (0 unless this holds one rank of a group over processes).
  int first_rank() const { return std::max(comms_.local_rank, 0); }
  uint64_t kv_bytes() const;
  uint64_t workspace_bytes() const;

 private:
  std::unique_ptr<HostCommGroup> host_;               // ranks on one GPU
  CudaComms comms_;                                   // one rank per GPU (NCCL)
  std::vector<int> devices_;                          // [N] each rank's GPU
  std::unique_ptr<ThreadPool> threads_;
  std::vector<std::unique_ptr<CudaModel>> models_;
  std::vector<std::unique_ptr<CudaSession>> sessions_;
  bool failed_ = false;
};

/// Tensor parallelism on the GPU for one sequence (llmq-run --device cuda --tp N): CudaRanks
/// driven as a session; rank 0 returns the logits and samples.
class CudaTpSession : public SessionBase {
 public:
  /// Errors as CudaRanks.
  CudaTpSession(const Model& m, int n_ranks, int64_t ctx, int64_t n_batch = 512, int64_t logits_rows = 1, bool progress = false,
                CudaComms comms = {}, bool kv_q8 = false);
  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false) override;
  int32_t forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history) override;
  const Model& model() const override { return m_; }
  int64_t pos() const override { return ranks_.session(0).pos(); }
  int64_t ctx() const override { return ranks_.session(0).ctx(); }
  int64_t n_batch() const override { return ranks_.session(0).n_batch(); }
  void truncate(int64_t n) override;
  uint64_t kv_bytes() const override { return ranks_.kv_bytes(); }
  uint64_t workspace_bytes() const override { return ranks_.workspace_bytes(); }
  int size() const { return ranks_.size(); }
  const CudaModel& rank_model(int r) const { return ranks_.model(r); }
  const CudaSession& rank_session(int r) const { return ranks_.session(r); }

 private:
  const Model& m_;
  CudaRanks ranks_;
};

/// llmq-server on the GPU: `parallel` sequences of up to ctx tokens over a paged fp16 KV cache
/// (the block tables of engine/kv_cache.h on the host, the blocks on the device), each forward
/// pass one batch of the sequences' tokens through CudaSession's kernels (continuous batching;
/// no CUDA graph, the batch changes every step); with tp > 1 over tensor-parallel ranks
/// (CudaRanks), each holding its KV heads' part of every block. Every buffer is allocated at
/// construction, to the sizes of plan_cuda_server (what `llmq-mem infer --device cuda
/// --parallel N` reports for one rank).
class CudaBatchRunner : public BatchRunner {
 public:
  /// Uploads m's weights (progress on stderr when `progress`) and allocates the sessions.
  /// ctx, n_batch, parallel, kv_tokens as the Scheduler's options. Throws CudaError when it does
  /// not fit, UsageError for shapes the kernels do not take or ranks that cannot be formed.
  CudaBatchRunner(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel, int64_t kv_tokens = 0, bool progress = false,
                  int tp = 1, CudaComms comms = {}, bool kv_q8 = false);
  const Model& model() const override { return m_; }
  int64_t capacity() const override { return plan_.n_batch; }
  /// The block tables for the device cache: n_blocks and block_tokens must be the plan's.
  KVCache make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) override;
  const float* forward(KVCache& cache, const BatchToken* batch, int64_t n) override;
  uint64_t kv_bytes(const KVCache&) const override { return ranks_.kv_bytes(); }
  uint64_t workspace_bytes() const override { return ranks_.workspace_bytes(); }
  /// The session plan of rank 0; with tp = 1 the whole model's, weights included (with tp > 1
  /// its weights field is 0: the shards are not planned by tensor name).
  const CudaPlan& plan() const { return plan_; }
  const CudaModel& device_model(int r = 0) const { return ranks_.model(r); }
  const CudaSession& session(int r = 0) const { return ranks_.session(r); }
  int ranks() const { return ranks_.size(); }

 private:
  const Model& m_;
  CudaPlan plan_;
  CudaRanks ranks_;
  int tp_;  // ranks in the group (ranks() of them here, or one of a group over processes)
};

/// llmq-server with partial offload (--device cuda --gpu-layers N): the first n_layers - N layers
/// of every batch on the CPU (forward_shard with layer_end, their KV cache the host pools of the
/// scheduler's KVCache), the last N layers and the output on the GPU (a paged CudaSession from
/// that layer, reading the same block tables); the residual stream crosses once per step.
class CudaOffloadBatchRunner : public BatchRunner {
 public:
  /// gpu_layers in [0, n_layers); the rest as CudaBatchRunner; m loaded with that gpu_layers
  /// (engine/model.h). Throws UsageError for gpu_layers out of range, CudaError when the GPU
  /// part does not fit.
  CudaOffloadBatchRunner(const Model& m, ThreadPool& pool, int64_t gpu_layers, int64_t ctx, int64_t n_batch, int64_t parallel,
                         int64_t kv_tokens = 0, bool progress = false, bool kv_q8 = false);
  ~CudaOffloadBatchRunner() override;
  const Model& model() const override { return m_; }
  int64_t capacity() const override { return plan_.n_batch; }
  /// Host K/V pools for the CPU's layers (element type `type`), whose block tables the GPU reads
  /// for its layers: n_blocks and block_tokens must be the plan's.
  KVCache make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) override;
  const float* forward(KVCache& cache, const BatchToken* batch, int64_t n) override;
  /// The CPU layers' pools (host) plus the GPU layers' (device).
  uint64_t kv_bytes(const KVCache& cache) const override { return cache.bytes() + session_->kv_bytes(); }
  uint64_t workspace_bytes() const override { return ws_.bytes() + session_->workspace_bytes(); }
  const CudaPlan& plan() const { return plan_; }
  const CudaModel& device_model() const { return *dm_; }
  const CudaSession& session() const { return *session_; }
  int64_t cpu_layers() const { return cpu_layers_; }
  uint64_t host_workspace_bytes() const { return ws_.bytes(); }

 private:
  const Model& m_;
  ThreadPool& pool_;
  int64_t cpu_layers_;
  CudaPlan plan_;
  Workspace ws_;
  BatchPlan bplan_;
  std::unique_ptr<CudaModel> dm_;
  std::unique_ptr<CudaSession> session_;
};

}  // namespace llmq::cuda
