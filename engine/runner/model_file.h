// Which `.llmq` file the tools load for the model path they are given: a GGUF or a Hugging Face
// directory is converted once (its types kept) into a cache and loaded from there, as llama.cpp
// and vLLM users expect `-m model.gguf` and `--model DIR` to work.
#pragma once
#include <string>

#include "formats/readers/llama2c.h"  // SourceModel

namespace llmq {

/// The checks llmq-convert makes before it writes anything: the source carries a tokenizer, the
/// tokenizer builds as llmq-run will build it (token types, scores, merges, special ids), and
/// its size is the model's vocabulary. Throws FileError naming `what` (the source or tokenizer
/// file) or UsageError (no tokenizer).
void check_source_vocab(const SourceModel& src, const std::string& what);

/// The cache directory of converted GGUFs: LLMQ_CACHE, else $XDG_CACHE_HOME/llmq, else
/// $HOME/.cache/llmq (not created here). Throws UsageError when none of them is set.
std::string model_cache_dir();

/// The `.llmq` file to load for `path`. A GGUF file or a Hugging Face checkpoint directory (one
/// holding config.json) is converted once, with llmq-convert's defaults (every tensor keeps its
/// type: a byte copy of GGUF blocks; safetensors' F32, F16 and
/// BF16 as they are), into model_cache_dir() as STEM-HHHHHHHHHHHHHHHH.llmq, H the XXH64 of the
/// real path and the size and modification time of the file (of a directory: of each of its
/// files), so a replaced or edited source converts again; later calls return that file.
/// Anything else is returned as it is (Model::load says what is wrong with it). Prints one line
/// on stderr when it converts. Callers in several processes at once (MPI ranks) take turns on a
/// lock file beside the entry (flock), so one converts and the others find its file; where locks
/// fail, each converts and the first to finish publishes (LlmqWriter is exclusive). Throws
/// FileError (unreadable or bad source, a cache that cannot be written) or UsageError.
std::string model_file_for(const std::string& path);

}  // namespace llmq
