// The one way the tools get a model running: RunnerOptions (their flags, resolved) in,
// a Runner out. Every choice of what runs the forward passes — CPU threads, tensor-parallel
// rank threads or processes, a GPU, GPU ranks, a partial offload — is made here, in
// make_runner, and nowhere in the tools.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/runner/device.h"
#include "engine/tp.h"

namespace llmq {

class MpiComm;  // engine/parallel/comm_mpi.h

/// What runs a model, as the tools' flags say.
struct RunnerOptions {
  Placement place;               ///< device, GPU layers, ranks: as load_model was given
  int threads = 0;               ///< CPU threads in all, shared by the ranks (0: every core)
  int64_t ctx = 0;               ///< KV positions per sequence (<= 0: the model's, at most kDefaultMaxCtx)
  int64_t n_batch = 512;         ///< most tokens per forward pass
  int64_t logits_rows = 1;       ///< one sequence: logits rows a forward may return (perplexity: its chunk)
  int64_t parallel = 0;          ///< 0: one sequence (a session); >= 1: continuous batching of that many
  int64_t kv_tokens = 0;         ///< batching: KV positions shared by all sequences (0: parallel · ctx)
  int64_t capacity = 0;          ///< CPU ranks: tokens per forward (0: n_batch, or parallel when larger)
  KvType kv_type = KvType::F32;  ///< the CPU's KV cache (partial offload: its CPU layers')
  bool gpu_kv_q8 = false;        ///< the GPU's KV cache as Q8_0 (else fp16)
  bool vocab_parallel = true;    ///< CPU ranks: embedding and output split by vocabulary (else replicated)
  bool progress = true;          ///< upload progress and the GPU's memory on stderr
  MpiComm* group = nullptr;      ///< ranks as processes (mpirun): this process's rank of the MPI job
};

/// A model's forward passes, however they run. One sequence (parallel == 0): session(), what
/// generate(), perplexity() and llmq-bench drive. Continuous batching (parallel >= 1): batch(),
/// what the server's Scheduler drives. A process group's ranks other than 0 only follow: serve().
class Runner {
 public:
  ~Runner();
  const Model& model() const { return m_; }
  /// The one sequence. Throws UsageError when made for batching or on a following rank.
  SessionBase& session();
  /// The batch runner (CPU ranks, GPU, offload, or rank 0 driving a process group). Throws
  /// UsageError when made for one sequence on the GPU (that session has no batch runner).
  BatchRunner& batch();
  /// A rank > 0 of a process group: it runs rank 0's passes (serve()) instead of its own.
  bool follower() const { return follower_; }
  /// Follows rank 0's forward passes until it stops; returns the exit code (0).
  int serve();
  /// This process's rank in its process group (0 without one).
  int group_rank() const;
  /// The CPU's tensor-parallel ranks held in this process (for reports), or nullptr.
  const TensorParallel* cpu_ranks() const { return ranks_; }

 private:
  friend std::unique_ptr<Runner> make_runner(const Model& m, const RunnerOptions& o);
  explicit Runner(const Model& m) : m_(m) {}
  const Model& m_;
  std::unique_ptr<ThreadPool> pool_;      // TP = 1 on the CPU, or the CPU layers of a partial offload
  std::unique_ptr<BatchRunner> local_;    // this process's rank of a process group
  std::unique_ptr<BatchRunner> batch_;    // what batch() returns
  std::unique_ptr<SessionBase> session_;  // what session() returns
  const TensorParallel* ranks_ = nullptr;
  MpiComm* group_ = nullptr;
  bool follower_ = false;
};

/// `o` with ctx (KV positions per sequence) and capacity (tokens per forward of CPU ranks)
/// worked out for m, as make_runner uses them; rank 0 of a process group sends these to the
/// other ranks (cli::join_tp_group), so every rank builds the same runner.
RunnerOptions resolve(const Model& m, RunnerOptions o);

/// Builds what runs `m` (loaded with load_model(path, verify, o.place)) as `o` says. Prints the
/// GPU's memory when o.progress. Throws UsageError for combinations that do not exist (partial
/// offload with ranks, perplexity-sized logits on GPU process ranks, ...), CudaError when the
/// model does not fit the GPU, and as the constructors it calls.
std::unique_ptr<Runner> make_runner(const Model& m, const RunnerOptions& o);

}  // namespace llmq
