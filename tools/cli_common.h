// What every command-line tool shares: exit codes, error reporting, peak memory.
#pragma once
#include <functional>
#include <string>

#include "formats/vocab.h"

/// Parses the command line like CLI11_PARSE, but a usage error exits 1 (help still exits 0),
/// so every tool has the documented exit codes. Include <CLI/CLI.hpp> first.
#define LLMQ_CLI_PARSE(app, argc, argv)            \
  try {                                            \
    (app).parse((argc), (argv));                   \
  } catch (const CLI::ParseError& e) {             \
    return (app).exit(e) == 0 ? 0 : 1;             \
  }

namespace llmq::cli {

/// Exit codes: 0 ok, 1 usage or runtime error, 2 bad input file (FileError/MetadataError).
enum ExitCode { kOk = 0, kUsage = 1, kBadFile = 2 };

/// Runs body() and maps exceptions to one clear line on stderr and an exit code:
/// FileError and MetadataError -> 2, anything else -> 1. `tool` prefixes the message.
int run_guarded(const char* tool, const std::function<int()>& body);

/// Peak resident memory of this process in bytes (getrusage ru_maxrss).
uint64_t peak_rss_bytes();

/// "1.23 MiB" style formatting of a byte count.
std::string human_bytes(uint64_t bytes);

/// Loads a tokenizer file: a SentencePiece `tokenizer.model` (protobuf, by extension `.model`)
/// or a llama2.c `tokenizer.bin` (expected_vocab tokens, -1 = until end of file).
Vocab load_tokenizer_file(const std::string& path, int64_t expected_vocab);

}  // namespace llmq::cli
