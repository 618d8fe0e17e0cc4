#include "formats/readers/source.h"
#include "base/mapped_file.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "formats/readers/gguf_model.h"
#include "formats/readers/hf_model.h"

namespace llmq {

SourceModel open_source(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return read_hf_model(path);
  std::ifstream in = open_regular_file(path);
  char magic[4] = {};
  in.read(magic, 4);
  if (in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0) return read_gguf_model(path);
  return read_llama2c(path);
}

}  // namespace llmq
