// Large buffers the engine streams through: weights packed for the CPU kernels, the KV cache.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>

namespace llmq {

/// One allocation of `bytes`, zero-filled (unless `zero` is false: then the caller writes every
/// byte, and the pages become resident as it does), 2 MiB aligned when at least 2 MiB (else 64 bytes)
/// and advised as transparent huge pages (madvise MADV_HUGEPAGE; where the kernel's THP mode is
/// "madvise", the default on Debian). Decode reads the weights and the KV cache once per token;
/// with 4 KiB pages the TLB misses cost a third of the streaming bandwidth on the machine of
/// bench/RESULTS.md. Throws std::bad_alloc when the memory is not there.
class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(uint64_t bytes, bool zero = true);
  HugeBuffer(HugeBuffer&& o) noexcept : p_(std::move(o.p_)), bytes_(std::exchange(o.bytes_, 0)) {}
  HugeBuffer& operator=(HugeBuffer&& o) noexcept {
    p_ = std::move(o.p_);
    bytes_ = std::exchange(o.bytes_, 0);
    return *this;
  }
  uint8_t* data() const { return p_.get(); }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> p_;
  uint64_t bytes_ = 0;
};

}  // namespace llmq
