// Fuzz target llama2c: the llama2.c readers (formats/llama2c.*: legacy, v1 and v2 checkpoint
// headers and the tensor layout, every small tensor read) and the llama2.c tokenizer.bin
// reader (formats/tokenizer_files.*), whose vocabulary then builds a Tokenizer. The same bytes
// go to both. Bad input must end in FileError (UsageError from the Tokenizer), never a crash.
#include <cstdint>
#include <vector>

#include "text/tokenizer.h"
#include "base/error.h"
#include "formats/readers/llama2c.h"
#include "formats/readers/tokenizer_files.h"
#include "fuzz/fuzz_common.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file(data, size);
  try {
    SourceModel sm = read_llama2c(path);
    std::vector<float> buf;
    for (SourceTensor& t : sm.tensors) {
      if (t.numel() > (int64_t(1) << 16)) continue;
      buf.assign(size_t(t.numel()), 0.0f);
      t.read(buf.data());
    }
  } catch (const FileError&) {
  }
  try {
    Vocab v = read_llama2c_tokenizer(path);
    try {
      Tokenizer tok(std::move(v));
      const auto ids = tok.encode("Once upon a time", true);
      tok.decode(ids);
    } catch (const UsageError&) {
    }
  } catch (const FileError&) {
  }
  return 0;
}
