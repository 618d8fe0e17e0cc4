// A tensor-parallel group of processes (one rank each, on one machine or several) joined
// through a rendezvous and connected as a star of TCP sockets around rank 0.
//
// Rendezvous (the `--tp-init` flag), as PyTorch's init_method and vLLM's distributed init:
//   tcp://HOST:PORT  rank 0 listens on HOST:PORT, the other ranks connect to it; anyone who can
//                    reach the port can try to join, so use a private network, or set the same
//                    LLMQ_TP_TOKEN on every rank (a secret the hello must carry);
//   file://PATH      rank 0 listens on a free port and writes "HOSTNAME:PORT SECRET" to PATH
//                    (mode 0600, atomically: temp file + rename), the other ranks read PATH
//                    (again on every retry: a stale file from an earlier run is overwritten) and
//                    connect there with the secret; for machines that share a file system. Rank 0
//                    removes PATH once every rank has joined.
// Every rank sends a hello (magic, group size, rank, the secret, and a job signature: the model
// and the options that must agree); rank 0 accepts ranks 1..N-1 once each and answers each with
// its verdict, so a mismatched rank fails at once with one clear message on both sides, while a
// connection that is not a rank of this job (silent, another protocol, a wrong secret) is
// dropped without failing the group.
//
// The sockets serve two purposes:
//   - SocketComm implements Communicator (engine/comm.h) for ranks in separate processes: all_reduce_sum
//     sends each rank's buffer to rank 0, which adds them in rank order (as HostComm does, so the
//     results are bit-identical to N in-process ranks) and sends the sum back; gather and
//     barrier likewise through rank 0;
//   - broadcast()/recv_broadcast() carry rank 0's commands to the others (engine/parallel/tp_process.h)
//     and, for GPU ranks, NCCL's unique id.
// A rank that fails calls abort(): its sockets are shut down, so every peer's next receive
// throws CommAborted instead of waiting; keepalive probes find a peer machine that vanished.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm.h"

namespace llmq {

/// One process's end of the star; rank 0 holds a socket per other rank, the others one to rank 0.
class SocketComm final : public Communicator {
 public:
  /// Joins the group `init` (tcp://HOST:PORT or file://PATH) as `rank` of `size`. `signature`
  /// must be equal on every rank (say the model file's size and the options); a rank whose
  /// signature, size or rank does not fit is refused. Waits up to `timeout` for all ranks
  /// (rank 0) or for rank 0 to appear (others). Throws UsageError for a malformed `init`, bad
  /// rank/size, a refused hello or the timeout, and (within 0.1 s) once *cancel is set.
  static std::unique_ptr<SocketComm> join(const std::string& init, int rank, int size, const std::string& signature,
                                          std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                          const std::atomic<bool>* cancel = nullptr);
  ~SocketComm() override;
  SocketComm(const SocketComm&) = delete;
  SocketComm& operator=(const SocketComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// Σ over ranks, added on rank 0 in rank order and sent back: every rank gets the same bits.
  void all_reduce_sum(float* buf, int64_t n) override;
  void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) override;
  void barrier() override;
  void abort() override;

  /// Rank 0 sends `bytes` [n] to every other rank (each must call recv for it); other ranks
  /// must not call it.
  void broadcast(const void* bytes, uint64_t n);
  /// A rank other than 0 receives the next message of rank 0's broadcast, as sent (n bytes,
  /// n prefixed on the wire; at most 1 GiB). Throws CommAborted when rank 0 is gone or the
  /// message is larger.
  std::vector<uint8_t> recv_broadcast();
  /// False once a peer's connection has closed or failed (or this group was aborted); never
  /// blocks. For a communicator beside this one (NCCL) that cannot see a peer process die.
  bool peers_alive() const;

 private:
  SocketComm(int rank, int size, std::vector<int> fds);
  // One length-prefixed message to / from rank `peer` (rank 0's socket for the other ranks).
  void send_all(int peer, const void* p, uint64_t n);
  void recv_all(int peer, void* p, uint64_t n);
  std::string gone(int peer) const;
  int fd_of(int r) const { return rank_ == 0 ? fds_.at(size_t(r)) : fds_.at(0); }
  int rank_, size_;
  std::vector<int> fds_;      // rank 0: [size] (fds_[0] unused, -1); others: [1], the socket to rank 0
  std::atomic<bool> aborted_{false};
  std::vector<float> scratch_;
};

}  // namespace llmq
