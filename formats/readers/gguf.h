// Reader for GGUF files (the llama.cpp/ggml model format), versions 2 and 3.
// Spec: ggml's docs/gguf.md. Every count, length, offset and size is checked against the
// file before use; a bad file throws FileError naming the file and the fault.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/mapped_file.h"
#include "formats/vocab.h"

namespace llmq {

/// GGUF metadata value types (gguf_type).
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* gguf_type_name(GgufType t);

/// One metadata value. Arrays keep their elements compactly, by element type (a value per
/// element would cost ~96 bytes each: a file of 1-byte elements could make the reader allocate
/// ~100x its size): numbers and bools as the file's little-endian bytes (`raw`), strings as
/// strings, nested arrays (up to kGgufMaxDepth levels) as values.
struct GgufValue {
  GgufType type = GgufType::U8;
  uint64_t u = 0;       ///< unsigned integers and bool
  int64_t i = 0;        ///< signed integers
  double f = 0;         ///< floats
  std::string s;        ///< strings
  GgufType elem = GgufType::U8;  ///< arrays: element type
  uint64_t count = 0;            ///< arrays: number of elements
  std::vector<uint8_t> raw;      ///< arrays of numbers or bools: the elements' bytes
  std::vector<std::string> strs; ///< arrays of strings
  std::vector<GgufValue> arr;    ///< arrays of arrays

  /// Element k of an array as a scalar value (numbers, bools, strings) or the nested array.
  GgufValue element(uint64_t k) const;

  bool is_int() const;
  /// Integer value of any integer type or bool; throws MetadataError otherwise.
  int64_t as_int(const std::string& key) const;
  /// Float value of any float or integer type; throws MetadataError otherwise.
  double as_float(const std::string& key) const;
  /// String value; throws MetadataError otherwise.
  const std::string& as_string(const std::string& key) const;
};

constexpr int kGgufMaxDepth = 8;

/// One tensor info. `shape` is outermost first (GGUF's ne[] reversed); shape.back() = ne[0]
/// is the contiguous row length.
struct GgufTensor {
  std::string name;
  uint32_t type = 0;           ///< ggml_type id
  std::vector<int64_t> shape;
  uint64_t offset = 0;         ///< from the start of the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;
};

/// Block size and bytes per block of a ggml type id; {0, 0} when unknown.
struct GgmlTypeSize {
  int64_t block;
  uint64_t bytes;
  const char* name;
};
GgmlTypeSize ggml_type_size(uint32_t type);

/// A mapped, validated GGUF file.
class GgufFile {
 public:
  /// Maps and validates `path`: magic, version (2 or 3), every key/value (types known, lengths
  /// and counts within the file, nesting depth), tensor infos (known types, 1-4 dims, row
  /// length a multiple of the block, offsets aligned and inside the file, no overlap), and
  /// general.alignment (a power of two). Throws FileError.
  static std::unique_ptr<GgufFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& kv() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  /// nullptr when absent.
  const GgufValue* find(const std::string& key) const;
  const GgufTensor* find_tensor(const std::string& name) const;
  /// The mapping the tensors' data pointers point into (keep it to outlive this object).
  std::shared_ptr<MappedFile> mapping() const { return map_; }

 private:
  std::shared_ptr<MappedFile> map_;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

/// The tokenizer of a GGUF file (keys tokenizer.ggml.*): model ("llama" = SentencePiece BPE,
/// "gpt2" = byte-level BPE), pre-tokenizer name, tokens, scores, token types, merges, special
/// ids (bos, eos, unk, pad, eot), add_bos / add_space_prefix (defaults by model as llama.cpp).
/// Works on vocabulary-only files. Throws FileError for missing or inconsistent keys.
Vocab vocab_from_gguf(const GgufFile& g);

}  // namespace llmq
