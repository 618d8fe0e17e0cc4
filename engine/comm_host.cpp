#include "engine/comm_host.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/threadpool.h"
#include "base/error.h"

namespace llmq {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
// How long a rank polls at a barrier before it sleeps on the futex: the thread pool's policy
// (ThreadPool::kSpinMicros, LLMQ_SPIN_US overrides; 0 sleeps at once). Polling yields the core
// between short bursts, so on an oversubscribed machine the rank being waited for can run.
int spin_micros() {
  static const int us = [] {
    const char* e = std::getenv("LLMQ_SPIN_US");
    return e ? std::clamp(std::atoi(e), 0, 1000000) : ThreadPool::kSpinMicros;
  }();
  return us;
}
}  // namespace

HostCommGroup::HostCommGroup(int n) : n_(n) {
  if (n < 1) throw UsageError("communicator: a group needs at least one rank");
  slots_[0].resize(size_t(n));
  slots_[1].resize(size_t(n));
  for (int r = 0; r < n; ++r) comms_.push_back(std::unique_ptr<HostComm>(new HostComm(*this, r)));
}

HostCommGroup::~HostCommGroup() = default;

void HostCommGroup::barrier() {
  if (n_ == 1) return;
  const uint32_t ph = phase_.load(std::memory_order_acquire);
  if (aborted_.load(std::memory_order_acquire)) throw CommAborted("communicator: another rank failed");
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_add(1, std::memory_order_release);
    phase_.notify_all();
    return;
  }
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::microseconds(spin_micros());
  while (phase_.load(std::memory_order_acquire) == ph) {
    for (int i = 0; i < 16 && phase_.load(std::memory_order_acquire) == ph; ++i) cpu_relax();
    if (clock::now() >= deadline) break;
    std::this_thread::yield();
  }
  while (phase_.load(std::memory_order_acquire) == ph) phase_.wait(ph, std::memory_order_acquire);
  if (aborted_.load(std::memory_order_acquire)) throw CommAborted("communicator: another rank failed");
}

void HostCommGroup::abort() {
  aborted_.store(true, std::memory_order_release);
  phase_.fetch_add(1, std::memory_order_release);  // wakes every waiter; they see aborted_
  phase_.notify_all();
}

int HostComm::size() const { return g_.n_; }

void HostComm::barrier() { g_.barrier(); }

void HostComm::abort() { g_.abort(); }

const float* HostComm::stage(const float* data, int64_t n) {
  // No other rank reads this buffer now: its last reader finished before the barrier of the
  // previous collective, which this rank has passed.
  std::vector<float>& st = staged_[calls_ & 1];
  if (st.size() < size_t(n)) st.resize(size_t(n));
  if (n > 0) std::memcpy(st.data(), data, size_t(n) * sizeof(float));
  g_.slots_[calls_ & 1][size_t(rank_)] = {st.data(), n};
  return st.data();
}

void HostComm::all_reduce_sum(float* buf, int64_t n) {
  const int N = g_.n_;
  if (N == 1 || n <= 0) return;
  const auto& slots = g_.slots_[calls_ & 1];
  stage(buf, n);
  ++calls_;
  g_.barrier();
  // buf = ((s_0 + s_1) + s_2) + ...: rank order, the same on every rank.
  std::memcpy(buf, slots[0].ptr, size_t(n) * sizeof(float));
  for (int r = 1; r < N; ++r) {
    const float* src = slots[size_t(r)].ptr;
    for (int64_t i = 0; i < n; ++i) buf[i] += src[i];
  }
}

void HostComm::gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) {
  const int N = g_.n_;
  if (N == 1) {
    if (count > capacity) throw CommAborted("gather: " + std::to_string(count) + " values into room for " + std::to_string(capacity));
    if (send != recv && count > 0) std::memcpy(recv, send, size_t(count) * sizeof(float));
    return;
  }
  const auto& slots = g_.slots_[calls_ & 1];
  stage(send, count);
  ++calls_;
  g_.barrier();
  if (rank_ != root) return;
  int64_t total = 0;
  for (int r = 0; r < N; ++r) total += std::max<int64_t>(slots[size_t(r)].count, 0);
  if (total > capacity) {
    abort();
    throw CommAborted("gather: " + std::to_string(total) + " values into room for " + std::to_string(capacity) + " (ranks out of step)");
  }
  for (int r = 0; r < N; ++r) {
    const auto& s = slots[size_t(r)];
    if (s.count > 0) std::memcpy(recv, s.ptr, size_t(s.count) * sizeof(float));
    recv += s.count;
  }
}

}  // namespace llmq
