#include "base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace llmq {

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
  if (base_) munmap(const_cast<uint8_t*>(base_), size_);
}

}  // namespace llmq
