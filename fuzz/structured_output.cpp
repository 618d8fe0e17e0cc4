// Fuzz target structured_output: the schema -> grammar -> token mask path of structured outputs
// (server/structured.*: StructuredOutputs::constraint and the TokenConstraint it returns) on
// arbitrary JSON schemas and GBNF grammars, over the stories260K vocabulary (512 tokens).
//
// Input layout: byte 0 picks the kind (bits 0-1: json_schema, grammar, json_schema wrapped in
// Hermes tool-call tags, json_object; bit 2: strict); the rest is the schema or grammar text.
// Checked: a bad spec is a UsageError, nothing else is thrown; a good one gives a constraint
// whose mask always allows a token, and the token it allows is accepted, for up to 48 steps
// (always taking the lowest allowed id); the mask's bits stay within the vocabulary.
#include <cstdint>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/generate.h"
#include "formats/readers/tokenizer_files.h"
#include "fuzz/fuzz_common.h"
#include "server/structured.h"
#include "text/tokenizer.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Vocab vocab = read_llama2c_tokenizer(fuzz::shared("models/stories260K/tok512.bin"));
  static const Tokenizer tok(vocab);
  // A small cache, so that a long run measures the compile path and not the cache filling up (the
  // server bounds its own, --grammar-cache-mib).
  static StructuredOutputs so(tok, default_stop_ids(vocab), size_t(8) << 20);
  if (size == 0 || size > 4096) return 0;  // the server takes 1 MiB bodies; compile time grows with size
  OutputFormat f;
  const int kind = data[0] & 3;
  f.kind = kind == 1 ? OutputFormat::Kind::Grammar : kind == 3 ? OutputFormat::Kind::JsonObject : OutputFormat::Kind::JsonSchema;
  f.strict = data[0] & 4;
  f.spec.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  if (kind == 2) f.prefix = "<tool_call>\n", f.suffix = "\n</tool_call>";
  std::shared_ptr<TokenConstraint> c;
  try {
    c = so.constraint(f);
  } catch (const UsageError&) {
    return 0;
  }
  if (!StructuredOutputs::available()) return 0;
  if (!c) fuzz::fail("no constraint for a non-text format");
  const int V = int(vocab.size());
  std::vector<uint32_t> mask(size_t((V + 31) / 32));
  const std::vector<int32_t> stops = default_stop_ids(vocab);
  for (int step = 0; step < 48; ++step) {
    int32_t pick = -1;
    if (!c->fill_mask(mask.data())) {
      pick = 3;  // everything allowed
    } else {
      for (int i = 0; i < V && pick < 0; ++i)
        if (mask[size_t(i) / 32] >> (i % 32) & 1u) pick = i;
      if (V % 32 && mask.back() >> (V % 32)) fuzz::fail("mask bits beyond the vocabulary");
    }
    if (pick < 0) fuzz::fail("the mask allows no token");
    if (!c->accept(pick)) fuzz::fail("the token the mask allowed was refused");
    for (int32_t s : stops)
      if (pick == s) return 0;  // complete
  }
  return 0;
}
