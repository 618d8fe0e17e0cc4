#include "formats/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "formats/error.h"

namespace llmq {

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FileError(path, "not a regular file");
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

MappedFile::~MappedFile() {
  if (base_) munmap(const_cast<uint8_t*>(base_), size_);
}

}  // namespace llmq
