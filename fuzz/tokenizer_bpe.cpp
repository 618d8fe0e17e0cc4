// Fuzz target tokenizer_bpe: the byte-level BPE tokenizer (engine/tokenizer.*, Vocab model
// "gpt2") on arbitrary bytes and arbitrary ids, built once from real llama.cpp vocabulary
// GGUFs in ../shared with different pre-tokenizers (gpt-2, deepseek-llm, falcon, starcoder).
// Input layout and checks: fuzz/tokenizer_common.h.
#include <cstdio>
#include <cstdlib>

#include "formats/gguf.h"
#include "fuzz/tokenizer_common.h"

using namespace llmq;

namespace {

const std::vector<fuzz::TokenizerCase>& cases() {
  static const std::vector<fuzz::TokenizerCase> c = [] {
    std::vector<fuzz::TokenizerCase> v;
    try {
      for (const char* g : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-deepseek-llm.gguf", "ggml-vocab-falcon.gguf",
                            "ggml-vocab-starcoder.gguf"}) {
        Tokenizer tok(vocab_from_gguf(*GgufFile::open(fuzz::shared(std::string("tokenizers/llamacpp-vocab/") + g))));
        if (!tok.byte_level()) fuzz::fail(std::string(g) + " is not a byte-level vocabulary");
        const bool all = fuzz::has_all_byte_pieces(tok);
        v.push_back({g, std::move(tok), all});
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tokenizer_bpe: cannot load the vocabularies (set LLMQ_SHARED_DIR): %s\n", e.what());
      std::exit(1);
    }
    return v;
  }();
  return c;
}

}  // namespace

// Loads the vocabularies before the first input, so their loading (seconds under ASan) does
// not count against libFuzzer's per-input -timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  cases();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::run_tokenizer_input(cases(), data, size);
  return 0;
}
