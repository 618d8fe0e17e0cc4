// In-process host communicator: N ranks are N threads of one process that exchange data
// through shared memory. For CPU tensor parallelism and for tests of the sharded forward pass.
//
// Numerics: all_reduce_sum adds the N partial buffers in rank order,
//   out[i] = ((buf_0[i] + buf_1[i]) + buf_2[i]) + ... + buf_{N-1}[i]   (fp32),
// the same order on every rank and on every call, so results are reproducible run to run and
// bit-identical across ranks. Against TP = 1 the order differs: a row-parallel matmul computes
// N partial dot products over slices of the input dimension and adds them here, where the
// unsplit kernel accumulates the whole row in its own order. Each such sum differs by a few
// fp32 ulp (relative ~1e-7 per sum), which is why the tests compare TP > 1 logits with TP = 1
// within 1e-5 relative rather than exactly.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/comm.h"

namespace llmq {

class HostCommGroup;

/// One rank of a HostCommGroup (obtained from HostCommGroup::rank()).
class HostComm final : public Communicator {
 public:
  int rank() const override { return rank_; }
  int size() const override;
  /// Every rank copies buf into its staging buffer, then (after one barrier) sums all ranks'
  /// staging buffers in rank order into its own buf. Staging is double-buffered by call parity,
  /// so one barrier per call suffices: a rank can only reuse a staging buffer two collectives
  /// later, when every rank has passed the barrier of the collective in between and so has
  /// finished reading it. Cost per rank: n copied, N x n read.
  void all_reduce_sum(float* buf, int64_t n) override;
  /// Every rank stages send; after one barrier root copies all staged buffers into recv.
  void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) override;
  void barrier() override;
  void abort() override;

 private:
  friend class HostCommGroup;
  HostComm(HostCommGroup& g, int rank) : g_(g), rank_(rank) {}
  HostCommGroup& g_;
  // Copies data [n] into this rank's staging buffer for the next collective and publishes it.
  const float* stage(const float* data, int64_t n);
  int rank_;
  uint64_t calls_ = 0;           // collectives so far: calls_ & 1 picks the staging buffer
  std::vector<float> staged_[2];  // [n] this rank's data of the last two collectives
};

/// The shared state of N in-process ranks. Create it once, hand rank(r) to the thread that runs
/// rank r; the group must outlive those threads' use of it.
class HostCommGroup {
 public:
  /// n >= 1 ranks. Throws UsageError for n < 1.
  explicit HostCommGroup(int n);
  ~HostCommGroup();
  HostCommGroup(const HostCommGroup&) = delete;
  HostCommGroup& operator=(const HostCommGroup&) = delete;

  int size() const { return n_; }
  /// The communicator of rank r (0 <= r < size()).
  HostComm& rank(int r) { return *comms_.at(size_t(r)); }
  /// True once any rank called abort().
  bool aborted() const { return aborted_.load(); }

 private:
  friend class HostComm;
  void barrier();
  void abort();

  struct alignas(64) Slot {  // what a rank publishes for a collective (one cache line each)
    const float* ptr = nullptr;
    int64_t count = 0;
  };
  int n_;
  std::vector<Slot> slots_[2];       // [n] per call parity
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> phase_{0};
  std::atomic<bool> aborted_{false};
  std::vector<std::unique_ptr<HostComm>> comms_;
};

}  // namespace llmq
