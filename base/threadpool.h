// A persistent thread pool: threads are created once and reused by every operation.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llmq {

/// Fork-join pool for the forward pass. A decode step is a few hundred short parallel
/// operations (one per matmul, attention, ...), so waking sleeping threads for each would cost
/// more than the work: threads spin for a short while (kSpinMicros) waiting for the next
/// operation, and only then sleep on a condition variable (as ggml's thread pool polls before
/// it sleeps). Between requests the threads sleep and cost nothing.
class ThreadPool {
 public:
  /// n_threads counts the calling thread too (n_threads - 1 workers are started);
  /// n_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  /// True when the threads poll between operations (then a parallel_for costs about a
  /// microsecond, not a wake-up of tens of microseconds, and small work is worth splitting).
  bool spins() const { return spin_us_ > 0; }

  /// Splits [0, n) into size() contiguous chunks of equal length (±1) and runs
  /// fn(begin, end, thread_index) on each, the caller taking chunk 0. Returns when all chunks are
  /// done. Not reentrant: fn must not call parallel_for. Exceptions thrown by fn are rethrown here.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

  /// How long a thread polls for the next operation (or the caller for the last chunk) before
  /// it sleeps, in microseconds; the environment variable LLMQ_SPIN_US overrides it (0: sleep
  /// at once, the behaviour of a plain condition-variable pool).
  static constexpr int kSpinMicros = 200;

 private:
  void worker(int index);
  void run_chunk(int index);

  int n_threads_;
  int spin_us_;  // kSpinMicros or LLMQ_SPIN_US
  std::vector<std::thread> workers_;
  std::mutex mu_;  // guards the sleeps/wake-ups and error_
  std::condition_variable start_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped (release) once per operation
  std::atomic<int> pending_{0};          // workers still running the current operation
  std::atomic<bool> stop_{false};
  int64_t n_ = 0;                        // the current operation (published by generation_)
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace llmq
