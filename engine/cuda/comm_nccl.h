// NCCL communicator: one tensor-parallel rank per GPU (Megatron-LM's setting, Shoeybi et al.
// 2019, section 3), over NVIDIA's collective library.
//
// Built only when CMake finds the CUDA toolkit and NCCL (target llmq_nccl, linked into
// llmq_device): llmq-run --device cuda --tp N uses it when the machine has N GPUs (one rank per
// GPU, engine/cuda/session.h CudaTpSession; with fewer, the ranks share GPU 0 over HostComm).
// Buffers handed to its collectives must be device memory of this rank's GPU; every call is
// synchronous (it waits on the rank's stream).
//
// Numerics: NCCL's all-reduce (ring or tree, chosen by NCCL for the topology) adds the partial
// sums in an order that is fixed for a given topology and rank count, and its final broadcast
// phase gives every rank the same bits, so the replicated residual stream stays identical on
// all ranks; the order differs from both TP = 1 and HostComm's rank order (results agree within
// the same ~1e-7-per-sum relative bound, see engine/comm_host.h).
#pragma once
#include <nccl.h>

#include <functional>

#include "engine/comm.h"

namespace llmq {

class NcclComm final : public Communicator {
 public:
  /// A fresh group identity: made once (by rank 0) and given to every rank's constructor, by
  /// sharing memory (one process, a thread per GPU) or any side channel (one process per GPU).
  static ncclUniqueId make_id();

  /// Joins group `id` as rank `rank` of `size` on CUDA device `device` (ncclCommInitRank; blocks
  /// until all ranks have joined; the ranks may be in other processes or on other machines, so
  /// `size` is not checked against this machine's GPUs: engine/runner/device.cpp checks that for ranks
  /// in one process). Throws UsageError when `rank` or `device` does not exist, runtime_error
  /// with NCCL's or CUDA's message for any other failure.
  NcclComm(int rank, int size, const ncclUniqueId& id, int device);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// ncclAllReduce(sum) in place on device buffer buf [n].
  void all_reduce_sum(float* buf, int64_t n) override;
  /// Counts are exchanged first (ncclAllGather of one int64 per rank), then grouped
  /// ncclSend/ncclRecv bring each rank's send [count_r] to root's recv at offset Σ_{q<r} count_q.
  void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) override;
  /// A one-element all-reduce, waited for.
  void barrier() override;
  /// ncclCommAbort: pending and later collectives of this rank fail (and throw CommAborted).
  void abort() override;
  /// `alive()` is asked every 50 ms while a collective waits; false (a peer process is gone)
  /// aborts the communicator and the collective throws CommAborted, where NCCL alone would wait
  /// forever. Unused under mpirun, which ends the whole job when a rank's process dies.
  void set_watch(std::function<bool()> alive) { watch_ = std::move(alive); }

 private:
  void sync();  // waits for the stream; throws on a CUDA or asynchronous NCCL error
  int rank_, size_, device_;
  ncclComm_t comm_ = nullptr;
  void* stream_ = nullptr;     // cudaStream_t (kept opaque so this header needs no CUDA headers)
  int64_t* counts_ = nullptr;  // device [size] for gather's count exchange
  float* scratch_ = nullptr;   // device [1] for barrier
  bool aborted_ = false;
  std::function<bool()> watch_;  // set_watch
};

}  // namespace llmq
