// Collective communication between the ranks of a tensor-parallel group.
//
// Tensor parallelism as in Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training
// Multi-Billion Parameter Language Models Using Model Parallelism", section 3) needs, in the
// forward pass, one all-reduce (sum) after each row-parallel matrix (attention output and FFN
// down projection: every rank holds a partial sum of the full output) and a gather of the
// vocabulary-parallel logits. This interface is all the engine uses; implementations:
//   - HostComm (engine/comm_host.h): N rank threads in one process, shared-memory buffers;
//   - MpiComm (engine/parallel/comm_mpi.h): N processes of an MPI job (mpirun), host buffers, summed
//     in rank order over MPI_Allgather / MPI_Alltoallv (never MPI_SUM, whose order MPI leaves open);
//   - NcclComm (engine/cuda/comm_nccl.h, CUDA builds with NCCL): one rank per GPU, device buffers:
//     ncclAllReduce / grouped ncclSend+ncclRecv / a one-float all-reduce as barrier.
//
// Every rank of a group must make the same sequence of calls with the same sizes (collectives
// are matched by order, as in MPI and NCCL).
#pragma once
#include <cstdint>
#include <stdexcept>

namespace llmq {

/// Thrown by a collective when another rank of the group failed (see Communicator::abort):
/// the group is unusable afterwards.
struct CommAborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One rank's handle on a communication group of size() ranks.
class Communicator {
 public:
  virtual ~Communicator() = default;
  /// This rank, 0 <= rank() < size().
  virtual int rank() const = 0;
  /// Ranks in the group.
  virtual int size() const = 0;

  /// buf [n] on every rank becomes Σ_r buf_r [n] (elementwise). Every rank gets bit-identical
  /// results (implementations must sum in one fixed order, e.g. rank order, for all ranks), so
  /// the replicated residual stream stays identical on all ranks.
  virtual void all_reduce_sum(float* buf, int64_t n) = 0;

  /// Gathers send [count_r] of every rank r into recv on `root`, concatenated in rank order
  /// (recv [Σ_r count_r]); counts may differ between ranks. recv [capacity] is ignored on other
  /// ranks; on root, Σ_r count_r > capacity (a rank out of step, or a corrupt peer) aborts the
  /// group and throws CommAborted without writing past recv. Returns when every rank may reuse
  /// its send buffer.
  virtual void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) = 0;

  /// Returns when every rank of the group has called barrier().
  virtual void barrier() = 0;

  /// Marks the group failed (called by a rank that cannot go on, e.g. it threw): collectives
  /// waiting now, or called later, on any rank throw CommAborted instead of waiting forever.
  virtual void abort() = 0;
};

}  // namespace llmq
