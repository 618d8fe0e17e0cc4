#include "tools/cli_common.h"

#include <sys/resource.h>

#include <cstdio>

#include "formats/error.h"
#include "formats/llmq_file.h"
#include "formats/tokenizer_files.h"

namespace llmq::cli {

int run_guarded(const char* tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const FileError& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return kBadFile;
  } catch (const MetadataError& e) {
    std::fprintf(stderr, "%s: error: bad model metadata: %s\n", tool, e.what());
    return kBadFile;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: error: out of memory\n", tool);
    return kUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return kUsage;
  }
}

uint64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return uint64_t(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

Vocab load_tokenizer_file(const std::string& path, int64_t expected_vocab) {
  const bool spm = path.size() >= 6 && path.compare(path.size() - 6, 6, ".model") == 0;
  return spm ? read_sentencepiece_model(path) : read_llama2c_tokenizer(path, int32_t(expected_vocab));
}

}  // namespace llmq::cli
