// Errors shared by every reader, writer and tool.
#pragma once
#include <stdexcept>
#include <string>

namespace llmq {

/// A file (model, tokenizer, text) is missing, truncated, corrupt or otherwise unusable.
/// The message names the file and the fault. Tools map it to exit code 2.
struct FileError : std::runtime_error {
  FileError(const std::string& path, const std::string& what)
      : std::runtime_error(path + ": " + what) {}
};

/// Invalid arguments or data handed to a library function (NaN weights, bad shapes,
/// impossible options). Tools map it to exit code 1.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace llmq
