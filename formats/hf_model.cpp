#include "formats/hf_model.h"

#include "formats/error.h"

namespace llmq {

SourceModel read_hf_model(const std::string& dir) {
  throw FileError(dir, "Hugging Face import is being written");
}

}  // namespace llmq
