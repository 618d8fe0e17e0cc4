#include "formats/gguf_model.h"

#include "formats/error.h"

namespace llmq {

SourceModel read_gguf_model(const std::string& path) {
  throw FileError(path, "GGUF model import is being written");
}

}  // namespace llmq
