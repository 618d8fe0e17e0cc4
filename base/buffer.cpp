#include "base/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace llmq {

void HugeBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

HugeBuffer::HugeBuffer(uint64_t bytes, bool zero) : bytes_(bytes) {
  if (bytes == 0) return;
  constexpr size_t kHuge = size_t(2) << 20;
  void* p = nullptr;
  if (posix_memalign(&p, bytes >= kHuge ? kHuge : 64, size_t(bytes)) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (bytes >= kHuge) madvise(p, size_t(bytes), MADV_HUGEPAGE);  // advice only: errors are ignored
#endif
  if (zero) std::memset(p, 0, size_t(bytes));
  p_.reset(static_cast<uint8_t*>(p));
}

}  // namespace llmq
