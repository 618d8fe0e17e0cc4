// A persistent thread pool: threads are created once and reused by every operation.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llmq {

class ThreadPool {
 public:
  /// n_threads counts the calling thread too (n_threads - 1 workers are started);
  /// n_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  /// Splits [0, n) into size() contiguous chunks of equal length (±1) and runs
  /// fn(begin, end, thread_index) on each, the caller taking chunk 0. Returns when all chunks are
  /// done. Not reentrant: fn must not call parallel_for. Exceptions thrown by fn are rethrown here.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void worker(int index);
  void run_chunk(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  int64_t n_ = 0;
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace llmq
