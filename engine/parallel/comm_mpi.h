// A tensor-parallel group of processes (one rank each, on one machine or several) started by
// mpirun and joined over MPI (Open MPI, or any MPI-3 library; the C API only).
//
//   mpirun -np N build/llmq-run -m MODEL --tp N ...        (llmq-server and llmq-bench alike)
//
// Launch: a process is taken for a rank of an MPI job when mpirun's environment says so
// before MPI is initialised (mpi_launch_size(): OMPI_COMM_WORLD_SIZE, PMI_SIZE, or PMIX_RANK);
// the world is then the group: rank and size come from MPI, --tp must equal the size. A world
// of one process is no group (--tp N then runs N rank threads, engine/comm_host.h).
//
// MpiComm serves two purposes, as the TCP star it replaced did:
//   - it implements Communicator (engine/comm.h) for ranks in separate processes, with results
//     bit-identical to HostComm's (N in-process ranks): all_reduce_sum never uses MPI_SUM, whose
//     order of addition MPI leaves to the library (it may differ between ranks, message sizes
//     and algorithms). Each element is summed by one rank, always in rank order
//     ((b_0 + b_1) + b_2) + ... + b_{N-1}, and those bits are copied to every rank:
//       small buffers (n * 4 bytes <= kAllgatherBytes): MPI_Allgather of every rank's buffer,
//         then each rank adds the N copies in rank order itself;
//       larger ones: a reduce-scatter as MPI_Alltoallv (rank c receives chunk c of every rank's
//         buffer) and adds them in rank order, then MPI_Allgatherv spreads the summed chunks;
//         each rank sends and receives 2 (N-1)/N of the buffer, as a ring all-reduce does.
//     gather is MPI_Gather of the counts (checked against root's capacity) then MPI_Gatherv;
//     barrier is MPI_Barrier;
//   - broadcast()/recv_broadcast() carry rank 0's commands to the others (engine/parallel/
//     tp_process.h) and, for GPU ranks, NCCL's unique id.
//
// Failure: MPI's default error handler (MPI_ERRORS_ARE_FATAL) ends the job on a communication
// error, and mpirun ends the job when a rank's process dies (a signal, or an exit without
// MPI_Finalize): the ranks waiting in a collective are killed with it and mpirun exits non-zero.
// A rank that cannot go on calls abort() (or abort_job()): it prints why on stderr and ends
// every rank (end_mpi_job: an exit that mpirun answers by ending the job, or MPI_Abort). A rank
// that leaves without the group's orderly end (see ~MpiComm) does the same, so no rank is left
// waiting in a collective.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm.h"

namespace llmq {

/// The number of processes of the MPI job that started this one, read from the launcher's
/// environment before MPI is initialised: OMPI_COMM_WORLD_SIZE (Open MPI) or PMI_SIZE (MPICH's
/// hydra); -1 when only PMIX_RANK says there is a job (its size is known after MPI_Init); 0
/// when this process was not started by mpirun.
int mpi_launch_size();

/// This process's rank in its MPI job from the same environment (OMPI_COMM_WORLD_RANK,
/// PMI_RANK, PMIX_RANK); 0 when not started by mpirun or not said.
int mpi_launch_rank();

/// Ends every rank of the MPI job from this one, printing nothing; never returns. `code` (0 reads
/// as 1) is this process's exit status. Under Open MPI's own launcher (mpirun, prterun: it sets
/// OMPI_COMM_WORLD_SIZE) this process just exits non-zero without MPI_Finalize, and mpirun ends
/// the job (mpirun(1), "orte_abort_on_non_zero_status", on by default). MPI_Abort there goes
/// through mpirun's abort handler, which in Open MPI 4.1.4 (Debian 12) now and then hangs or
/// crashes mpirun after the ranks are gone (4 in 600 and 2 in 260 aborts with 3 jobs at once on
/// 2 cores; none in 1,100 exits: bench/RESULTS.md). Under other launchers (srun, MPICH's
/// hydra): MPI_Abort(code).
[[noreturn]] void end_mpi_job(int code);

/// Where MPI is initialised and not yet finalised: end_mpi_job(code). Otherwise returns. For
/// the tools' error path (cli::run_guarded), after the error was printed.
void abort_mpi_job_if_running(int code);

/// This process's rank of the MPI job's world (MPI_COMM_WORLD): one per process.
class MpiComm final : public Communicator {
 public:
  /// Initialises MPI (MPI_Init_thread, MPI_THREAD_SERIALIZED: the tools call MPI from one
  /// thread at a time, not always the same one) and returns this process's rank of the world.
  /// Call it once per process, from the main thread (MPI_Finalize, in the destructor, must run
  /// on the thread that initialised MPI). Throws UsageError when MPI was initialised before, or
  /// the library gives less than MPI_THREAD_SERIALIZED.
  static std::unique_ptr<MpiComm> init_world();
  /// MPI_Finalize once the group ended in order (mark_done() was called: rank 0 told the others
  /// to stop, or this rank was told to). Otherwise, unless an exception is unwinding (then the
  /// tool's error path prints it and calls abort_mpi_job_if_running), prints why and ends the job
  /// (end_mpi_job): a rank that leaves early must not leave the others waiting in a collective.
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// This process's rank among the ranks on its machine (MPI_Comm_split_type SHARED): GPU ranks
  /// take GPU local_rank() mod the GPUs present.
  int local_rank() const { return local_rank_; }
  /// The ranks on this process's machine (MPI_Comm_split_type SHARED).
  int local_size() const { return local_size_; }

  /// Σ over ranks in rank order, every rank the same bits (HostComm's): see the file comment.
  void all_reduce_sum(float* buf, int64_t n) override;
  /// MPI_Gather of the counts, then MPI_Gatherv into recv on root. On root, Σ counts > capacity
  /// (or a negative count, or one over INT_MAX) ends the job (abort_job) before anything is
  /// written.
  void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) override;
  /// MPI_Barrier.
  void barrier() override;
  /// Ends the whole job (end_mpi_job), after printing on stderr the message of the exception being
  /// handled, if any (callers call it from a catch block). Never returns.
  void abort() override;
  /// Prints "rank R of N: <why>; ending the MPI job" on stderr and calls end_mpi_job(1).
  [[noreturn]] void abort_job(const std::string& why);

  /// Rank 0 sends `bytes` [n] (n <= 1 GiB) to every other rank, which must call recv_broadcast
  /// for it; other ranks must not call it (UsageError).
  void broadcast(const void* bytes, uint64_t n);
  /// A rank other than 0 receives the next message of rank 0's broadcast, as sent. While it
  /// waits (a server's followers wait between requests) it polls, then sleeps in steps of up to
  /// 1 ms instead of spinning a core. UsageError on rank 0.
  std::vector<uint8_t> recv_broadcast();
  /// The group ended in order (rank 0 told the others to stop; a follower heard it): the
  /// destructor finalises MPI instead of ending the job.
  void mark_done() { done_ = true; }
  /// True: a rank's process that dies ends the whole job under mpirun, so there is no dead peer
  /// to report (a communicator beside this one, NCCL, needs no watch).
  bool peers_alive() const { return true; }

 private:
  MpiComm(int rank, int size, int local_rank, int local_size)
      : rank_(rank), size_(size), local_rank_(local_rank), local_size_(local_size) {}
  // One all-reduce of at most INT_MAX / size floats, by the small or the large algorithm.
  void all_reduce_piece(float* buf, int n);
  void bcast(void* p, int bytes);  // MPI_Ibcast from rank 0, waited for (polling, then sleeping)
  int rank_, size_, local_rank_, local_size_;
  bool done_ = false;
  std::vector<float> scratch_;
  std::vector<int> counts_, displs_, rcounts_, rdispls_;
};

/// Bytes up to which all_reduce_sum all-gathers whole buffers (one collective, N x the data);
/// above it, a reduce-scatter and an all-gather (two collectives, 2 (N-1)/N x the data).
inline constexpr int64_t kAllgatherBytes = 64 << 10;

}  // namespace llmq
