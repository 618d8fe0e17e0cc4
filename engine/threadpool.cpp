#include "engine/threadpool.h"

#include <algorithm>

namespace llmq {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunk(int index) {
  const int64_t begin = n_ * index / n_threads_;
  const int64_t end = n_ * (index + 1) / n_threads_;
  if (begin >= end) return;
  try {
    (*fn_)(begin, end, index);
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunk(index);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  if (n_threads_ == 1 || n == 1) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    n_ = n;
    fn_ = &fn;
    pending_ = n_threads_ - 1;
    error_ = nullptr;
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunk(0);
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

}  // namespace llmq
