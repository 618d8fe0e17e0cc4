// One entry point for every checkpoint format the converter reads.
#pragma once
#include <string>

#include "formats/readers/llama2c.h"  // SourceModel

namespace llmq {

/// Opens `path` for conversion, by what it is: a directory is a Hugging Face checkpoint
/// (formats/readers/hf_model.h), a file starting with "GGUF" a GGUF model (formats/readers/gguf_model.h),
/// anything else a llama2.c checkpoint (formats/readers/llama2c.h). Throws FileError.
SourceModel open_source(const std::string& path);

}  // namespace llmq
