#include "base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "base/error.h"

namespace llmq {

namespace {

// The mappings alive now, for the SIGBUS handler: a file truncated by another program while we
// have it mapped turns the next read of a page past its new end into SIGBUS. The handler finds
// the mapping the faulting address is in, names its file and exits 2 (a clear error instead of
// a crash); a SIGBUS anywhere else is re-raised as it was. Fixed slots and plain stores, so the
// handler only reads memory it may read.
constexpr int kSlots = 64;
struct Slot {
  std::atomic<uintptr_t> lo{0}, hi{0};
  char path[512];
};
Slot g_slots[kSlots];
std::mutex g_slots_mu;

void on_sigbus(int sig, siginfo_t* info, void*) {
  const auto addr = uintptr_t(info ? info->si_addr : nullptr);
  for (const Slot& s : g_slots) {
    const uintptr_t lo = s.lo.load(std::memory_order_acquire), hi = s.hi.load(std::memory_order_acquire);
    if (lo != 0 && addr >= lo && addr < hi) {
      const char head[] = "llmq: error: ";
      const char tail[] = ": the file shrank while it was in use (another program truncated or rewrote it in place); stopping\n";
      (void)!::write(2, head, sizeof head - 1);
      (void)!::write(2, s.path, strnlen(s.path, sizeof s.path));
      (void)!::write(2, tail, sizeof tail - 1);
      _exit(2);
    }
  }
  signal(sig, SIG_DFL);  // not one of ours: the default action, as before
  raise(sig);
}

void register_mapping(const uint8_t* base, uint64_t size, const std::string& path) {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, nullptr);
  });
  std::lock_guard<std::mutex> lk(g_slots_mu);
  for (Slot& s : g_slots)
    if (s.lo.load() == 0) {
      std::snprintf(s.path, sizeof s.path, "%s", path.c_str());
      s.hi.store(uintptr_t(base) + size, std::memory_order_release);
      s.lo.store(uintptr_t(base), std::memory_order_release);
      return;
    }
}

void unregister_mapping(const uint8_t* base) {
  std::lock_guard<std::mutex> lk(g_slots_mu);
  for (Slot& s : g_slots)
    if (s.lo.load() == uintptr_t(base)) s.lo.store(0, std::memory_order_release);
}

}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO does not block the open
  if (fd < 0) throw FileError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FileError(path, "not a regular file (a FIFO, device or directory)");
  }
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = uint64_t(st.st_size);
  if (m->size_ > 0) {
    void* p = mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw FileError(path, std::string("cannot mmap: ") + std::strerror(err));
    }
    m->base_ = static_cast<const uint8_t*>(p);
    register_mapping(m->base_, m->size_, path);
  }
  ::close(fd);
  return m;
}

void MappedFile::release(const uint8_t* p, uint64_t n) const {
  if (!base_ || n == 0 || p < base_ || p >= base_ + size_) return;
  const auto page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t end = (uintptr_t(base_) + size_ + page - 1) / page * page;  // base_ is page-aligned
  const uintptr_t lo = uintptr_t(p) / page * page;
  const uintptr_t hi = std::min(end, (uintptr_t(p) + n + page - 1) / page * page);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

std::ifstream open_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw FileError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  const bool regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ::close(fd);
  if (!regular) throw FileError(path, "not a regular file (a FIFO, device or directory)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open");
  return in;
}

MappedFile::~MappedFile() {
  if (base_) unregister_mapping(base_);
  if (base_) munmap(const_cast<uint8_t*>(base_), size_);
}

}  // namespace llmq
