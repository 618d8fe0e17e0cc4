// Fuzz target tokenizer_bpe: the byte-level BPE tokenizer (engine/tokenizer.*, Vocab model
// "gpt2") on arbitrary bytes and arbitrary ids, built once from real llama.cpp vocabulary
// GGUFs in ../shared with different pre-tokenizers (gpt-2, deepseek-llm, falcon, starcoder).
// Input layout and checks: fuzz/tokenizer_common.h.
#include "formats/readers/gguf.h"
#include "fuzz/tokenizer_common.h"

using namespace llmq;

namespace {

const std::vector<fuzz::TokenizerCase>& cases() {
  return fuzz::load_cases_once("tokenizer_bpe", [] {
    std::vector<fuzz::TokenizerCase> v;
    for (const char* g : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-deepseek-llm.gguf", "ggml-vocab-falcon.gguf",
                          "ggml-vocab-starcoder.gguf"}) {
      Tokenizer tok(vocab_from_gguf(*GgufFile::open(fuzz::shared(std::string("tokenizers/llamacpp-vocab/") + g))));
      if (!tok.byte_level()) fuzz::fail(std::string(g) + " is not a byte-level vocabulary");
      const bool all = fuzz::has_all_byte_pieces(tok);
      v.push_back({g, std::move(tok), all});
    }
    return v;
  });
}

}  // namespace

LLMQ_TOKENIZER_FUZZ_TARGET(cases)
