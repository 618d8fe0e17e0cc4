#include "base/threadpool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLMQ_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define LLMQ_CPU_RELAX() asm volatile("yield")
#else
#define LLMQ_CPU_RELAX() ((void)0)
#endif

namespace llmq {

namespace {

// Polls `done()` for up to `micros`; true when it became true.
template <typename F>
bool spin_until(int micros, F done) {
  if (micros <= 0) return done();
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::microseconds(micros);
  for (;;) {
    for (int i = 0; i < 16; ++i) {
      if (done()) return true;
      LLMQ_CPU_RELAX();
    }
    // Give the core away if anything else wants it (an oversubscribed machine), else go on.
    std::this_thread::yield();
    if (clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  spin_us_ = kSpinMicros;
  if (const char* e = std::getenv("LLMQ_SPIN_US")) spin_us_ = std::clamp(std::atoi(e), 0, 1000000);
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
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
    auto ready = [&] { return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(spin_us_, ready)) {
      std::unique_lock<std::mutex> lk(mu_);
      start_cv_.wait(lk, ready);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);  // publishes n_ and fn_
    run_chunk(index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);  // the caller may be between its check and its wait
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  if (n_threads_ == 1 || n == 1) {
    fn(0, n, 0);
    return;
  }
  n_ = n;
  fn_ = &fn;
  error_ = nullptr;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    // Under the mutex, so a worker that checked `ready` and is about to sleep sees it.
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_cv_.notify_all();
  run_chunk(0);
  auto done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(spin_us_, done)) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, done);
  }
  fn_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

}  // namespace llmq
