// llmq-convert: a checkpoint (llama2.c .bin, GGUF, Hugging Face directory) -> one `.llmq` file.
//
//   llmq-convert stories260K.bin --tokenizer tok512.bin --type q8_0 -o stories260K-q8_0.llmq
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>

#include "formats/readers/convert.h"
#include "base/error.h"
#include "formats/readers/source.h"
#include "engine/runner/model_file.h"
#include "cli/cli_common.h"

using namespace llmq;

namespace {

// --type (a dtype or a K-quant mix; empty: as in the source) and the --tensor-type PATTERN=TYPE overrides as options.
ConvertOptions type_options(const std::string& type_name, const std::vector<std::string>& overrides) {
  ConvertOptions opts;
  if (!type_name.empty()) {
    opts.mix = quant_mix_from_name(type_name);
    if (!opts.mix) opts.type = dtype_from_name(type_name);
  }
  for (const std::string& o : overrides) {
    const size_t eq = o.rfind('=');
    if (eq == std::string::npos || eq == 0) throw UsageError("--tensor-type expects PATTERN=TYPE, got '" + o + "'");
    opts.overrides.emplace_back(o.substr(0, eq), dtype_from_name(o.substr(eq + 1)));
  }
  return opts;
}

// The report of convert_to_llmq on stderr (written to `output`): a table of tensors (type, bytes, relative RMS error), then a closing line.
void print_summary(const ConvertReport& rep, const std::string& output) {
  // Summary: per tensor, then per type, then totals.
  std::map<std::string, int> per_type;
  std::fprintf(stderr, "%-28s %-6s %12s %10s\n", "tensor", "type", "bytes", "rel.rms");
  for (const auto& t : rep.tensors) {
    std::fprintf(stderr, "%-28s %-6s %12llu %10.3g%s\n", t.name.c_str(), dtype_name(t.type), (unsigned long long)t.bytes,
                 t.rel_rms_error, t.fell_back ? "  (row length not a multiple of 32: stored as f16)" : "");
    ++per_type[dtype_name(t.type)];
  }
  std::string types;
  for (const auto& [name, n] : per_type) types += (types.empty() ? "" : ", ") + std::to_string(n) + " " + name;
  int fallbacks = 0;
  for (const auto& t : rep.tensors) fallbacks += t.fell_back;
  std::fprintf(stderr, "wrote %s: %zu tensors (%s), %s, %.3f bits per weight", output.c_str(), rep.tensors.size(),
               types.c_str(), cli::human_bytes(rep.file_bytes).c_str(),
               8.0 * double(rep.weight_bytes) / double(rep.weights));
  if (fallbacks) std::fprintf(stderr, "; %d tensor(s) fell back to f16", fallbacks);
  std::fprintf(stderr, "\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-convert: convert a checkpoint to the .llmq format"};
  std::string input, output, tokenizer, type_name;
  std::vector<std::string> overrides;
  bool force = false, no_progress = false;
  app.add_option("input", input, "source: llama2.c .bin (legacy, v1, v2), .gguf, or a Hugging Face directory")->required();
  app.add_option("-o,--output", output, "output .llmq file")->required();
  app.add_option("--tokenizer", tokenizer,
                 "tokenizer: llama2.c tokenizer.bin or SentencePiece tokenizer.model (needed when the source has none)");
  app.add_option("--type", type_name,
                 "type of 2-D weights: f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q2_k|q3_k|q4_k|q5_k|q6_k, or the K-quant mix "
                 "q2_k|q3_k_m|q4_k_m|q5_k_m (llama.cpp's per-tensor policy; as in llama.cpp, q2_k names the mix: "
                 "--tensor-type '*=q2_k' puts every matrix in Q2_K); 1-D tensors stay f32; default: as in the source");
  app.add_option("--tensor-type", overrides,
                 "per-tensor type, PATTERN=TYPE with a glob pattern, e.g. token_embd.weight=q8_0 (repeatable)");
  app.add_flag("-f,--force", force, "overwrite an existing output file");
  app.add_flag("--no-progress", no_progress, "no progress bar");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-convert", [&] {
    ConvertOptions opts = type_options(type_name, overrides);
    opts.overwrite = force;
    opts.progress = !no_progress && isatty(STDERR_FILENO);
    opts.source_path = input;

    SourceModel src = open_source(input);
    if (!tokenizer.empty()) {
      src.vocab = cli::load_tokenizer_file(tokenizer, src.config.vocab_size);
      src.has_vocab = true;
    }
    // The tokenizer as llmq-run will build it, before anything is written: inconsistent token
    // types, scores, merges or special ids fail here (exit 2), not in a file that cannot load.
    check_source_vocab(src, tokenizer.empty() ? input : tokenizer);
    opts.chat_template = src.chat_template;
    std::fprintf(stderr, "llmq-convert: %s (%s): dim %lld, %lld layers, %lld heads (%lld KV), vocab %lld\n", input.c_str(),
                 src.format.c_str(), (long long)src.config.dim, (long long)src.config.n_layers,
                 (long long)src.config.n_heads, (long long)src.config.n_kv_heads, (long long)src.config.vocab_size);
    const ConvertReport rep = convert_to_llmq(src, src.vocab, output, opts);
    print_summary(rep, output);
    return 0;
  });
}
