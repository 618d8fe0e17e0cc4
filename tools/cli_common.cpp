#include "tools/cli_common.h"

#include "engine/device.h"
#include "formats/error.h"
#include "formats/llmq_file.h"

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

int64_t resolve_gpu_layers(const char* tool, const std::string& spec, bool cuda, const std::string& model_path,
                           const mem::InferOptions& o, const std::string& budget_s) {
  if (spec == "all") return -1;
  if (!cuda) throw UsageError("--gpu-layers needs --device cuda (or auto with a GPU)");
  auto f = LlmqFile::open(model_path, false);
  const LlamaConfig c = mem::file_config(*f);
  if (spec == "auto") {  // the plan of llmq-mem infer --device cuda --fit
    const double budget = budget_s.empty() ? double(cuda_free_bytes()) : mem::parse_size(budget_s);
    const int64_t n = mem::fit_gpu_layers(*f, c, o, budget);
    if (n < 0) throw UsageError("--gpu-layers auto: not even the output layer fits in " + human_bytes(uint64_t(budget)));
    std::fprintf(stderr, "%s: --gpu-layers auto: %lld of %lld layers on the GPU (%s to plan for)\n", tool, (long long)n,
                 (long long)c.n_layers, human_bytes(uint64_t(budget)).c_str());
    return n;
  }
  int64_t n = -1;
  try {
    size_t used = 0;
    n = std::stoll(spec, &used);
    if (used != spec.size() || n < 0) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw UsageError("--gpu-layers must be a number of layers, 'auto' or 'all', not '" + spec + "'");
  }
  if (n > c.n_layers) throw UsageError("--gpu-layers " + spec + ": the model has " + std::to_string(c.n_layers) + " layers");
  return n;
}

}  // namespace llmq::cli
