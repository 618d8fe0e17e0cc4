// A read-only memory mapping of a whole file, shared by every reader.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

namespace llmq {

class MappedFile {
 public:
  /// Maps `path` read-only. While the mapping lives, a read past the end of the file (another
  /// program truncated it) ends the process with exit 2 and a message naming the file, instead
  /// of SIGBUS (a handler installed with the first mapping; other SIGBUS keep their default).
  /// Throws FileError if it cannot be opened, is not a regular file
  /// (checked without blocking: a FIFO is refused, not waited on), or cannot be mapped. An
  /// empty file maps to data() == nullptr, size() == 0.
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  /// Drops the pages that [p, p + n) touches from the resident set (madvise MADV_DONTNEED).
  /// The mapping is read-only and private, so every byte stays valid: touching it again reads
  /// it from the page cache or the file. Ranges outside the mapping are ignored, as are errors.
  void release(const uint8_t* p, uint64_t n) const;

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

/// Opens `path` for reading (binary) after checking, without blocking, that it is a regular
/// file: a FIFO would block the open until a writer came (forever, for a tool that was handed
/// one), a device would never end. Throws FileError naming the path ("cannot open: ...", "not a
/// regular file"). Every reader of a user-named file goes through this or MappedFile::open.
std::ifstream open_regular_file(const std::string& path);

}  // namespace llmq
