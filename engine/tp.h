// Tensor parallelism: one model split over N ranks, every layer cut the way Megatron-LM cuts
// it (Shoeybi et al. 2019, section 3), with the same results as the unsplit model up to the
// order of fp32 sums (see engine/comm_host.h for the numerics).
//
// Per layer, rank r of N holds
//   attention: Q heads [head0, head0 + n_heads) — contiguous, as even as possible — and the KV
//     heads those query heads read (GQA: KV heads are split when the rank boundaries fall on
//     KV-group boundaries, e.g. N divides n_kv_heads; otherwise a KV head whose group straddles
//     a boundary is held by both ranks, "replicated"); Wq/Wk/Wv column-parallel (their output
//     rows), Wo row-parallel (its input columns of those heads);
//   FFN: hidden units [ffn0, ffn0 + ffn_dim), W_gate/W_up column-parallel, W_down row-parallel;
//   one all-reduce after the attention output projection and one after W_down.
// Embedding and output projection: vocab-parallel (rows [v0, v1) per rank; the embedding sums
// one extra all-reduce of [T, dim], the logits are gathered on rank 0) or replicated (every rank
// holds the whole embedding; rank 0 alone computes the output projection). Measured on
// SmolLM2-135M (bench/RESULTS.md): vocab-parallel is the default.
//
// Load: column-parallel slices are row ranges of the mapped tensors (a pointer and a row count:
// nothing is copied, a rank touches only its rows). Row-parallel slices are column ranges,
// strided in the file: each rank copies its columns into a buffer it owns (ModelShard::owned),
// so its slice is contiguous (as a GPU rank would upload it) and its memory is exactly its shard.
// For block-quantized types (blocks of 32 along the input dimension) a column range must start
// and end on a block boundary: the FFN split is rounded to 32 columns; a head split that cannot
// be (head_dim x heads not a multiple of 32 at a boundary) is an error for that N.
#pragma once
#include <memory>
#include <vector>

#include "engine/comm_host.h"
#include "engine/model.h"

namespace llmq {

/// How the output projection and embedding are placed across ranks.
struct TpOptions {
  /// true: vocab-parallel embedding and output (each rank its vocabulary rows); false:
  /// replicated embedding on every rank and the whole output projection on rank 0.
  bool vocab_parallel = true;
};

/// The ranges of every rank for n_ranks (Megatron-LM's partition, generalised to head counts N
/// does not divide). Throws UsageError with a clear message when the ranks cannot be formed:
/// n_ranks < 1, n_ranks > n_heads, n_ranks > the FFN width (in blocks for quantized W_down), or a
/// quantized Wo whose column split falls inside a 32-wide block.
std::vector<ShardRanges> plan_shards(const Model& m, int n_ranks, const TpOptions& opt = {});
/// The same from a model's config and tensor directory alone (what `llmq-mem infer --tp`
/// reads: nothing is loaded). Throws UsageError as above, or when a layer tensor is missing.
std::vector<ShardRanges> plan_shards(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int n_ranks,
                                     const TpOptions& opt = {});

/// Bytes of weights the rank with ranges R holds, from the tensor directory: the same sum as
/// ModelShard::weight_bytes() of that rank (row slices of column-parallel matrices, column
/// slices of Wo and W_down at their stored type, norms and the output bias replicated, q/k/v
/// biases sliced).
uint64_t shard_weight_bytes(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R);

/// Bytes of the packed copies the rank with ranges R makes for itself (ModelShard::packed, the
/// same sum as its bytes()): at the active CPU level, every matrix of the rank that the model's
/// own packed panels do not cover, i.e. the column slices of Wo and W_down and the row slices
/// that do not start on a 16-row panel (weight_rows). The model's panels themselves
/// (Model::packed, plan_inference's packed_bytes) are one allocation all ranks share.
uint64_t shard_packed_bytes(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R);

/// Rank r's view of the model for ranges r (from plan_shards): slices the weights (see above),
/// copying the row-parallel ones into owned buffers. vocab_bounds is filled from `all`.
/// pack = false: no packed copies for the CPU kernels (a shard whose slices go to a GPU).
ModelShard make_shard(const Model& m, const std::vector<ShardRanges>& all, int rank, bool pack = true);

/// The workspace plan (engine/mem_plan.h) of a rank: activations of the rank's widths (its
/// heads, KV heads, FFN units and vocabulary rows) for `capacity` tokens, matmul scratch for its
/// slices, `threads` threads; attention scores and logits grow on demand.
WorkspacePlan rank_workspace_plan(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R,
                                  int64_t capacity, int threads);

/// The model split over N in-process ranks (CPU tensor parallelism), each a thread with its
/// own ThreadPool, its weight shard and its Workspace; they meet in a HostCommGroup. With
/// N = 1 it wraps a given pool and runs forward_batch's code with no extra thread or copy.
/// Used by Session, Scheduler and perplexity to run a model either way.
class TensorParallel : public BatchRunner {
 public:
  /// N = 1: the whole model on `pool` (which must outlive this object); forward passes of up to
  /// `capacity` tokens.
  TensorParallel(const Model& m, ThreadPool& pool, int64_t capacity);
  /// N = 1 with the workspace allocated exactly to `plan` (engine/mem_plan.h), as Session and
  /// Scheduler do so that `llmq-mem infer` reports what is allocated.
  TensorParallel(const Model& m, ThreadPool& pool, const WorkspacePlan& plan);
  /// N = n_ranks ranks sharing total_threads threads (<= 0: all cores): rank r gets
  /// total/N threads (+1 for r < total % N), at least 1 each. Each rank's workspace is planned
  /// from its slices (rank_workspace_plan). Throws UsageError (see plan_shards) when the ranks
  /// cannot be formed.
  TensorParallel(const Model& m, int n_ranks, int total_threads, int64_t capacity, const TpOptions& opt = {});
  /// Rank `rank` of n_ranks whose other ranks live elsewhere (other processes, engine/
  /// tp_process.h), reached through `comm` (rank() == rank, size() == n_ranks; it must outlive
  /// this object): this object holds that rank's shard only, on `threads` threads (<= 0: all
  /// cores); make_cache makes one pool (its KV heads); forward must run on every rank with the
  /// same batch and tables at once, and returns the logits on rank 0 (nullptr elsewhere).
  TensorParallel(const Model& m, int n_ranks, int rank, Communicator& comm, int threads, int64_t capacity, const TpOptions& opt = {});
  ~TensorParallel() override;
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;

  const Model& model() const override { return m_; }
  /// Ranks held here: N, or 1 for a rank of a group over processes.
  int size() const { return int(shards_.size()); }
  /// Threads over all ranks (rank threads included).
  int threads() const;
  /// Threads of rank r's pool.
  int rank_threads(int r) const;
  /// Most tokens per forward call.
  int64_t capacity() const override { return cap_; }
  /// Rank r's weights; for N = 1 a view of the whole model.
  const ModelShard& shard(int r) const { return *shards_.at(size_t(r)); }
  /// A KV cache for these ranks: one pool per rank, each with its KV heads only.
  KVCache make_cache(int64_t n_blocks, int64_t block_tokens = 16, KvType type = KvType::F32) override;
  /// The forward pass over a batch as forward_batch (same contract and errors), every rank on
  /// its shard, the cache lengths advanced once at the end. Returns logits [n_flagged, vocab]
  /// (rank 0's buffer) or nullptr. After a rank failed, every call throws.
  const float* forward(KVCache& cache, const BatchToken* batch, int64_t n) override;
  /// In this process only (not a rank of a group over processes, whose other ranks would run
  /// the logits' collectives).
  bool has_hidden() const override { return ext_comm_ == nullptr; }
  /// forward() returning the final-norm states [n_flagged, dim] (rank 0's buffer).
  const float* forward_hidden(KVCache& cache, const BatchToken* batch, int64_t n) override;
  /// Bytes of all ranks' scratch buffers.
  uint64_t workspace_bytes() const override;
  /// Bytes of rank r's scratch buffers.
  uint64_t rank_workspace_bytes(int r) const { return ws_.at(size_t(r))->bytes(); }

 private:
  const Model& m_;
  int64_t cap_;
  ThreadPool* single_pool_ = nullptr;                  // N = 1
  std::vector<std::unique_ptr<ModelShard>> shards_;    // [N]
  std::vector<std::unique_ptr<ThreadPool>> pools_;     // [N] (N > 1)
  std::vector<std::unique_ptr<Workspace>> ws_;         // [N]
  std::unique_ptr<HostCommGroup> comm_;                // N > 1 in this process
  Communicator* ext_comm_ = nullptr;                   // one rank of a group over processes
  std::unique_ptr<ThreadPool> ranks_;                  // N > 1: runs rank r on its thread r
  BatchPlan plan_;
  bool failed_ = false;
  const float* run(KVCache& cache, const BatchToken* batch, int64_t n, Output out);  // forward / forward_hidden
};

/// The text every rank of a process group must agree on for model m at tp ranks: the file's
/// size and shape (rank 0 sends it to the other processes, which must match it: cli::join_tp_group).
std::string tp_signature(const Model& m, int tp);

}  // namespace llmq
