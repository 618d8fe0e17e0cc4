// Tensor parallelism over processes: the N ranks of a group (engine/tp.h's Megatron split) in
// N processes of an MPI job, on one machine or several (engine/parallel/comm_mpi.h).
//
// Every process builds the runner of its own rank from the same flags: on the CPU a
// TensorParallel holding rank r of N over the group's MpiComm; on a GPU a cuda batch runner
// holding rank r (engine/runner/device.h: make_cuda_rank_runner), its all-reduce over NCCL or the
// MpiComm. Rank 0 wraps its runner in a ProcessGroupRunner, the BatchRunner that Session,
// the Scheduler and the tools drive; the other ranks call serve_process_group. Rank 0's KV cache
// allocates; before each forward pass it sends the batch and the block tables of its sequences,
// which the other ranks mirror into their own caches (KVCache::mirror), and then every rank runs
// its part of the pass, meeting in the all-reduces. Rank 0 alone returns logits.
//
// Commands (one MpiComm broadcast each; host byte order, packed; every rank is the same build):
//   kCache    i64 n_blocks, i64 block_tokens, i32 KV type (engine/kv_cache.h KvType)
//   kForward  i64 T, i64 S; T x (i32 seq, i32 token, i32 logits); S x (i32 seq, i64 length,
//             i64 n_blocks, n_blocks x i32 block): the batch and its sequences' tables before
//             the pass
//   kStop     the other ranks return (and the group may end in order: MpiComm::mark_done)
#pragma once
#include <cstdint>
#include <vector>

#include "engine/model.h"

namespace llmq {

class MpiComm;  // engine/parallel/comm_mpi.h

/// Rank 0 of a group of processes: each make_cache and forward call is sent to the other ranks
/// (which serve_process_group), then run on `local`, this process's rank. One KV cache at a
/// time: making another replaces it on the other ranks (the earlier one must not be used
/// again). The destructor tells the others to stop and marks the group done (MpiComm::mark_done).
class ProcessGroupRunner : public BatchRunner {
 public:
  /// `local` (rank 0's runner) and `comm` (rank 0 of the group) must outlive this object.
  /// Throws UsageError when comm is not rank 0.
  ProcessGroupRunner(BatchRunner& local, MpiComm& comm);
  ~ProcessGroupRunner() override;
  ProcessGroupRunner(const ProcessGroupRunner&) = delete;
  ProcessGroupRunner& operator=(const ProcessGroupRunner&) = delete;

  const Model& model() const override { return local_.model(); }
  int64_t capacity() const override { return local_.capacity(); }
  /// The local cache; every other rank makes the same shape of its own.
  KVCache make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) override;
  /// forward_batch's contract and errors (the batch is checked before any rank is told of it).
  /// A failure of this rank's pass ends the whole MPI job (MpiComm::abort, with its message); a
  /// rank that dies is ended by mpirun with the job.
  const float* forward(KVCache& cache, const BatchToken* batch, int64_t n) override;
  uint64_t kv_bytes(const KVCache& cache) const override { return local_.kv_bytes(cache); }
  /// This rank's scratch bytes.
  uint64_t workspace_bytes() const override { return local_.workspace_bytes(); }

 private:
  void send(const std::vector<uint8_t>& msg);
  BatchRunner& local_;
  MpiComm& comm_;
  BatchPlan plan_;
  std::vector<uint8_t> msg_;
  bool failed_ = false;
};

/// A rank other than 0: runs rank 0's commands on `local` (this rank's runner: the cache it
/// makes, one at a time; forward passes over the tables rank 0 sends) until rank 0 says stop,
/// then marks the group done (MpiComm::mark_done) and returns. A malformed command (truncated,
/// trailing bytes, a token whose sequence came without its table) and whatever a forward pass
/// here throws end the whole MPI job with the error's message (MpiComm::abort), so rank 0 is
/// not left waiting.
void serve_process_group(BatchRunner& local, MpiComm& comm);

}  // namespace llmq
