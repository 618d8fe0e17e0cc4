// Fuzz target llmq_file: the `.llmq` reader (formats/llmq_file.*) and Model::load on top of it
// (metadata -> config and vocabulary, tokenizer build, tensor binding), then one forward step
// when the model is tiny. Bad input must end in FileError, never a crash.
//
// Most random changes would only break the header and index checksums, so the input's
// checksums are recomputed first (llmq_fix_checksums, as tests/test_badfiles.cpp does) and the
// fuzzer reaches the structural validation behind them; the tensor-data checksum is skipped
// (verify = false) for the same reason.
#include <cstdint>
#include <vector>

#include "engine/model.h"
#include "base/threadpool.h"
#include "base/error.h"
#include "formats/llmq_file.h"
#include "fuzz/fuzz_common.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> image(data, data + size);
  llmq_fix_checksums(image);
  const std::string& path = fuzz::input_file(image.data(), image.size());
  std::unique_ptr<Model> m;
  try {
    m = Model::load(path, /*verify=*/false);
  } catch (const FileError&) {
    return 0;
  }
  // Touch both ends of every tensor: a tensor placed past the mapping faults here.
  unsigned sum = 0;
  for (const TensorInfo& t : m->file->tensors()) {
    const uint8_t* p = m->file->data(t);
    sum += p[0] + p[t.nbytes - 1];
  }
  (void)sum;
  // A forward step on a tiny model: the kernels must survive any weight bytes (NaN, Inf).
  if (m->weight_bytes() <= (uint64_t(1) << 20) && m->config.dim <= 256 && m->config.n_layers <= 4) {
    static ThreadPool pool(1);
    try {
      Session s(*m, pool, 4, 4);
      const int32_t tokens[2] = {0, int32_t(m->config.vocab_size - 1)};
      s.forward(tokens, 2);
    } catch (const UsageError&) {
    }
  }
  return 0;
}
