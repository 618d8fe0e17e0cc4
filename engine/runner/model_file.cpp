#include "engine/runner/model_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "base/error.h"
#include "formats/readers/convert.h"
#include "formats/readers/source.h"
#include "text/tokenizer.h"

namespace llmq {

namespace fs = std::filesystem;

void check_source_vocab(const SourceModel& src, const std::string& what) {
  if (!src.has_vocab) throw UsageError(what + " carries no tokenizer: give one with --tokenizer");
  try {
    const Tokenizer check(src.vocab);
  } catch (const std::exception& e) {
    throw FileError(what, e.what());
  }
  if (int64_t(src.vocab.tokens.size()) != src.config.vocab_size)
    throw FileError(what, "the tokenizer has " + std::to_string(src.vocab.tokens.size()) + " tokens, the model's vocabulary " +
                              std::to_string(src.config.vocab_size));
}

std::string model_cache_dir() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v && *v ? v : "";
  };
  if (std::string d = env("LLMQ_CACHE"); !d.empty()) return d;
  if (std::string d = env("XDG_CACHE_HOME"); !d.empty()) return d + "/llmq";
  if (std::string d = env("HOME"); !d.empty()) return d + "/.cache/llmq";
  throw UsageError("no cache directory for converted GGUF files: set LLMQ_CACHE (or HOME), or convert with llmq-convert");
}

namespace {

bool is_gguf(const std::string& path) {
  struct stat sb {};
  if (::stat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) return false;  // (a FIFO would block here; Model::load refuses it)
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

// A Hugging Face checkpoint directory (it holds a config.json).
bool is_hf_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "config.json", ec);
}

// "size.mtime" of a file (symbolic links followed).
std::string stamp(const std::string& path) {
  struct stat sb {};
  if (::stat(path.c_str(), &sb) != 0) throw FileError(path, "cannot stat");
  return std::to_string(sb.st_size) + '.' + std::to_string(sb.st_mtim.tv_sec) + '.' + std::to_string(sb.st_mtim.tv_nsec);
}

// STEM-HHHHHHHHHHHHHHHH.llmq for the GGUF file or checkpoint directory at `path` as it is now:
// H hashes its real path and the size and modification time of the file (of a directory: of
// every regular file in it, by name).
std::string cache_name(const std::string& path) {
  const fs::path real = fs::weakly_canonical(path);
  std::string key = real.string();
  if (fs::is_directory(real)) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(real))
      if (e.is_regular_file()) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    for (const auto& n : names) key += '\0' + n + '\0' + stamp((real / n).string());
  } else {
    key += '\0' + stamp(path);
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH64(key.data(), key.size(), 0));
  return (real.has_filename() ? real.stem().string() : std::string("model")) + "-" + hex + ".llmq";
}

}  // namespace

std::string model_file_for(const std::string& path) {
  if (!is_gguf(path) && !is_hf_dir(path)) return path;
  const std::string dir = model_cache_dir();
  const std::string out = (fs::path(dir) / cache_name(path)).string();
  std::error_code ec;
  if (fs::is_regular_file(out, ec)) return out;
  fs::create_directories(dir, ec);
  if (ec) throw FileError(dir, "cannot create the cache directory for converted GGUF files: " + ec.message() + " (set LLMQ_CACHE)");
  // One converter at a time per entry (MPI ranks start together): the others wait on the lock
  // and then find the file. Without a lock (a file system that refuses it) every caller
  // converts, and LlmqWriter lets the first to finish publish.
  std::string lock_name = fs::path(out).filename().string();
  lock_name.insert(0, 1, '.');
  lock_name.append(".lock");
  const std::string lock_path = (fs::path(dir) / lock_name).string();
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  struct Unlock {
    int fd;
    ~Unlock() {
      if (fd >= 0) ::close(fd);  // releases the flock
    }
  } unlock{lock};
  if (lock >= 0) {
    while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
    }
    if (fs::is_regular_file(out, ec)) return out;  // converted while we waited
  }
  const auto t0 = std::chrono::steady_clock::now();
  SourceModel src = open_source(path);
  check_source_vocab(src, path);
  ConvertOptions opts;
  opts.source_path = path;
  opts.chat_template = src.chat_template;
  try {
    const ConvertReport rep = convert_to_llmq(src, src.vocab, out, opts);
    std::fprintf(stderr, "llmq: converted %s to %s (types kept, %.1f MiB, %.1f s); later runs load it from there\n", path.c_str(),
                 out.c_str(), double(rep.file_bytes) / (1 << 20),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } catch (const FileError&) {
    if (fs::is_regular_file(out, ec)) return out;  // another process finished the same conversion first
    throw;
  }
  return out;
}

}  // namespace llmq
