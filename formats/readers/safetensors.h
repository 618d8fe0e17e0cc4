// Reader for safetensors files (Hugging Face's tensor container).
//
// Layout, as the safetensors specification (github.com/huggingface/safetensors, README
// "Format") defines it:
//   8 bytes   N, unsigned little-endian 64-bit: the size of the header
//   N bytes   the header: a UTF-8 JSON object. Each key is a tensor name mapping to
//             {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]};
//             the special key "__metadata__" maps to an object of string -> string.
//             The header may be padded at its end with spaces (0x20).
//   rest      the byte buffer; a tensor's bytes are [begin, end) counted from the start of
//             the buffer, row-major (C order), little-endian, shape outermost first.
//
// Every length and offset is checked against the file before use: the header length against
// the file size (and a 100 MiB cap, as the reference implementation has), each tensor's
// offsets against the buffer, its byte size against shape x element size, and tensors against
// each other (no overlap). A bad file throws FileError naming the file and the fault.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/mapped_file.h"

namespace llmq {

/// Element size in bytes of a safetensors dtype name ("F32", "BF16", "I64", ...); 0 when the
/// name is not one of the byte-sized dtypes of the spec (BOOL, U8, I8, F8_E5M2, F8_E4M3,
/// F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64). Sub-byte dtypes (F4, F6_*)
/// count as unknown.
uint64_t safetensors_dtype_size(const std::string& dtype);

/// One tensor of a safetensors file, validated against the file.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;            ///< as spelled in the header, e.g. "BF16"
  std::vector<int64_t> shape;   ///< outermost first; empty for a scalar
  uint64_t begin = 0, end = 0;  ///< data_offsets, from the start of the byte buffer
  const uint8_t* data = nullptr;  ///< begin inside the mapping (no alignment guaranteed)
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

/// A mapped, validated safetensors file. The tensors point into the mapping, which lives as
/// long as the object (hold the shared_ptr to keep SafetensorsTensor::data valid).
class SafetensorsFile {
 public:
  /// Maps and validates `path`. Checks: the file holds the 8-byte length; the header length
  /// is at least 2, at most 100 MiB and within the file; the header is a JSON object (trailing
  /// spaces allowed) without duplicate keys; each tensor entry is an object with a known dtype,
  /// a shape of non-negative integers, and data_offsets [begin, end] with begin <= end <=
  /// buffer size and end - begin == numel x element size (computed without overflow);
  /// no two tensors overlap; "__metadata__", when present, maps strings to strings.
  /// Gaps between tensors are accepted. Throws FileError.
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return map_->path(); }
  /// In order of data offset.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  /// nullptr when absent.
  const SafetensorsTensor* find(const std::string& name) const;
  /// The "__metadata__" entries (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Bytes of the JSON header (N).
  uint64_t header_size() const { return header_size_; }
  /// The mapping the tensors point into.
  const MappedFile& mapping() const { return *map_; }
  /// Drops the resident pages of bytes [p, p + nbytes) of the mapping from this process
  /// (madvise MADV_DONTNEED on the pages the range touches; the mapping is private and never
  /// written, so the bytes stay readable: they come back from the file, usually the page cache,
  /// on the next access). Lets a converter that reads tensors one by one keep its resident set
  /// near one tensor. Ranges outside the mapping are ignored; errors are ignored.
  void release(const uint8_t* p, uint64_t nbytes) const;

 private:
  std::shared_ptr<MappedFile> map_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
  uint64_t header_size_ = 0;
};

}  // namespace llmq
