// Helpers shared by the fuzz targets (fuzz/*.cpp). Each target defines
// LLVMFuzzerTestOneInput; it is linked either with libFuzzer (clang, LLMQ_FUZZ=ON) or with
// fuzz/regress_main.cpp (any compiler, run by CTest over the seed corpus and the regressions).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

namespace llmq::fuzz {

/// Stops the process with a message: a broken invariant is a finding, like a crash.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what.c_str());
  std::abort();
}

/// Path inside the shared data folder: $LLMQ_SHARED_DIR when set, else the folder the build
/// was configured with (../shared beside the repository).
inline std::string shared(const std::string& rel) {
  const char* env = std::getenv("LLMQ_SHARED_DIR");
  return std::string(env && *env ? env : LLMQ_SHARED_DIR) + "/" + rel;
}

/// An in-memory file (memfd) holding the current input, for readers that take a path. One
/// per process, rewritten for every input: no disk traffic, no clash between processes.
/// path() is "/proc/self/fd/N", which open() and stat() follow to the memfd.
class InputFile {
 public:
  InputFile() {
    fd_ = memfd_create("llmq-fuzz-input", MFD_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error("memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  /// Replaces the file's contents by data[0, size).
  void write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) fail("ftruncate failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, off_t(done));
      if (n <= 0) fail("pwrite to the memfd failed");
      done += size_t(n);
    }
  }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

/// The process's input file, with `data` written to it; returns its path.
inline const std::string& input_file(const uint8_t* data, size_t size) {
  static InputFile f;
  f.write(data, size);
  return f.path();
}

/// True if `s` is well-formed UTF-8 (RFC 3629: no overlong forms, surrogates or code points
/// above U+10FFFF).
inline bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = uint8_t(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07;
    else return false;
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto b = uint8_t(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n + 1;
  }
  return true;
}

}  // namespace llmq::fuzz
