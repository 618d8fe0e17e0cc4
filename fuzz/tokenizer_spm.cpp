// Fuzz target tokenizer_spm: the SentencePiece-style tokenizer (engine/tokenizer.*, Vocab model
// "llama") on arbitrary bytes and arbitrary ids, built once from real vocabularies in
// ../shared: llama2.c's tok512.bin, Llama-2's tokenizer.model, and llama.cpp's llama-spm and
// phi-3 vocabulary GGUFs. Input layout and checks: fuzz/tokenizer_common.h.
#include "formats/readers/gguf.h"
#include "formats/readers/tokenizer_files.h"
#include "fuzz/tokenizer_common.h"

using namespace llmq;

namespace {

const std::vector<fuzz::TokenizerCase>& cases() {
  return fuzz::load_cases_once("tokenizer_spm", [] {
    std::vector<fuzz::TokenizerCase> v;
    auto add = [&](const std::string& name, Vocab voc) {
      v.push_back({name, Tokenizer(std::move(voc)), false});
      if (v.back().tok.byte_level()) fuzz::fail(name + " is not a SentencePiece vocabulary");
    };
    add("tok512.bin", read_llama2c_tokenizer(fuzz::shared("models/stories260K/tok512.bin")));
    add("llama2 tokenizer.model", read_sentencepiece_model(fuzz::shared("tokenizers/llama2/tokenizer.model")));
    for (const char* g : {"ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"})
      add(g, vocab_from_gguf(*GgufFile::open(fuzz::shared(std::string("tokenizers/llamacpp-vocab/") + g))));
    return v;
  });
}

}  // namespace

LLMQ_TOKENIZER_FUZZ_TARGET(cases)
