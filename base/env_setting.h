// A process-wide setting read from the environment on first use, then settable by code (tests,
// benchmarks, labs): LLMQ_KQUANT_ACT and LLMQ_MATMUL_ACT (engine/cpu/cpu_ops.cpp),
// LLMQ_CUDA_DECODE_ATTN and LLMQ_CUDA_V3_BLOCKS (engine/cuda/attention.cu), LLMQ_CUDA_PDL (engine/cuda/cuda.cpp),
// LLMQ_CUDA_MMQ_F16 (engine/cuda/matmul.cu).
#pragma once
#include <atomic>
#include <mutex>

namespace llmq {

/// An int setting: `parse()` (which reads the environment) on the first get(), once, unless set()
/// came first; then whatever set() stores. Readable from any thread; set() while no kernel that
/// reads it runs.
class EnvSetting {
 public:
  explicit EnvSetting(int (*parse)()) : parse_(parse) {}
  int get() {
    int v = v_.load(std::memory_order_acquire);
    if (v == kUnset) {
      std::call_once(once_, [this] {
        int expected = kUnset;
        v_.compare_exchange_strong(expected, parse_(), std::memory_order_acq_rel);
      });
      v = v_.load(std::memory_order_acquire);
    }
    return v;
  }
  void set(int v) { v_.store(v, std::memory_order_release); }

 private:
  static constexpr int kUnset = -1;
  std::atomic<int> v_{kUnset};
  std::once_flag once_;
  int (*parse_)();
};

}  // namespace llmq
