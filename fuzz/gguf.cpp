// Fuzz target gguf: the GGUF reader (formats/gguf.*: GgufFile::open, vocab_from_gguf, a
// Tokenizer built from that vocabulary) and the GGUF -> model path (formats/gguf_model.*:
// read_gguf_model, then every small tensor read, which dequantizes it). Bad input must end in
// FileError (UsageError from the Tokenizer, which validates a vocabulary), never a crash.
#include <cstdint>
#include <vector>

#include "text/tokenizer.h"
#include "base/error.h"
#include "formats/readers/gguf.h"
#include "formats/readers/gguf_model.h"
#include "fuzz/fuzz_common.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file(data, size);
  try {
    auto g = GgufFile::open(path);
    const uint8_t* base = g->mapping()->data();
    for (const GgufTensor& t : g->tensors())
      if (t.data < base || uint64_t(t.data - base) + t.nbytes > g->mapping()->size())
        fuzz::fail("tensor '" + t.name + "' outside the file");
    Vocab v = vocab_from_gguf(*g);
    try {
      Tokenizer tok(std::move(v));
      const auto ids = tok.encode("Hello world! <s> 123", true, true);
      tok.decode(ids, true);
    } catch (const UsageError&) {
    }
  } catch (const FileError&) {
  }
  try {
    SourceModel sm = read_gguf_model(path);
    std::vector<float> buf;
    for (SourceTensor& t : sm.tensors) {
      if (t.numel() <= (int64_t(1) << 16)) {
        buf.assign(size_t(t.numel()), 0.0f);
        t.read(buf.data());
      }
      if (t.release) t.release();
    }
  } catch (const FileError&) {
  }
  return 0;
}
