// The `.llmq` model file: reader (mmap, validated) and atomic writer. Spec: docs/FORMAT.md.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "base/mapped_file.h"
#include "formats/quant.h"

namespace llmq {

constexpr char kLlmqMagic[8] = {'L', 'L', 'M', 'Q', 'F', 'I', 'L', 'E'};
constexpr uint32_t kLlmqVersion = 1;
constexpr uint64_t kLlmqAlign = 64;      ///< every tensor starts at a multiple of this
constexpr uint64_t kLlmqHeaderSize = 80;

/// A metadata value. On disk each has a type tag (docs/FORMAT.md, "Metadata").
using MetaValue = std::variant<bool, int64_t, double, std::string, std::vector<int32_t>,
                               std::vector<float>, std::vector<std::string>>;

/// Key -> value metadata with typed getters. A missing key (getters without a fallback) or a
/// value of another type throws MetadataError naming the key. Integer getters accept int64
/// values, float getters accept double or int64 values.
class Metadata {
 public:
  std::map<std::string, MetaValue> values;

  bool has(const std::string& key) const { return values.count(key) != 0; }
  void set(const std::string& key, MetaValue v) { values[key] = std::move(v); }
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  const std::string& get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  const std::vector<int32_t>& get_i32_array(const std::string& key) const;
  const std::vector<float>& get_f32_array(const std::string& key) const;
  const std::vector<std::string>& get_string_array(const std::string& key) const;
};

/// Missing or mistyped metadata key (the file is structurally valid but not usable).
struct MetadataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One entry of the tensor directory.
struct TensorInfo {
  std::string name;            ///< see docs/FORMAT.md "Tensor names"
  DType type = DType::F32;
  std::vector<int64_t> shape;  ///< outermost first; shape.back() is the contiguous row length
  uint64_t offset = 0;         ///< bytes from the start of the data section (multiple of 64)
  uint64_t nbytes = 0;         ///< = rows * row_bytes(type, shape.back())
  uint64_t xxh64 = 0;          ///< XXH64 (seed 0) of the tensor's bytes

  int64_t numel() const;
  int64_t rows() const { return numel() / shape.back(); }
  int64_t cols() const { return shape.back(); }
};

/// Expected byte size of a tensor of `type` and `shape`; throws UsageError if the row length
/// does not fit the block size or the size is absurd (> 2^48 bytes).
uint64_t tensor_nbytes(DType type, const std::vector<int64_t>& shape);

/// A read-only, memory-mapped, validated `.llmq` file. Tensor data is used in place.
class LlmqFile {
 public:
  /// Maps and validates `path`: magic, version, header and index checksums, every offset and
  /// size against the file length, shape x type = byte size, alignment, known types and
  /// metadata tags, and (when verify) every tensor's XXH64.
  /// Throws FileError naming the file and the fault.
  static std::unique_ptr<LlmqFile> open(const std::string& path, bool verify = true);
  ~LlmqFile();
  LlmqFile(const LlmqFile&) = delete;
  LlmqFile& operator=(const LlmqFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  const Metadata& meta() const { return meta_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// nullptr if absent.
  const TensorInfo* find(const std::string& name) const;
  /// The tensor's bytes inside the mapping (64-byte aligned).
  const uint8_t* data(const TensorInfo& t) const { return base_ + data_offset_ + t.offset; }
  /// Drops the pages of bytes [p, p + n) of the mapping from the resident set
  /// (MappedFile::release); they stay readable and come back from the file when touched.
  void release(const uint8_t* p, uint64_t n) const { map_->release(p, n); }
  /// release() of [p − before, p + n), clamped to the start of the mapping.
  void release(const uint8_t* p, uint64_t n, uint64_t before) const {
    const uint64_t back = std::min<uint64_t>(before, uint64_t(p - base_));
    map_->release(p - back, n + back);
  }
  /// release() of the whole mapping: what is read later comes back page by page.
  void release_all() const { map_->release(base_, size_); }

 private:
  LlmqFile() = default;
  std::shared_ptr<MappedFile> map_;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_offset_ = 0;
  Metadata meta_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
};

/// Writes a `.llmq` file atomically: everything goes to a temporary file beside the target,
/// which is fsync'ed and moved to the target only by finish() (exclusively unless overwrite:
/// of two writers of one new path, the second to finish fails). Tensors are streamed one
/// at a time (declare all first, then write them in declaration order), so peak memory is
/// one tensor. Destroying the writer before finish() removes the temporary file.
///
/// The temporary file is `.NAME.tmp.XXXXXX` beside the target, and the writer holds an
/// exclusive flock(2) on it while it lives. A writer that was killed (SIGKILL, power loss)
/// leaves its temporary file behind, unlocked; the next writer to the same target removes
/// every such unlocked `.NAME.tmp.??????` file when it starts.
class LlmqWriter {
 public:
  /// Throws FileError if `path` exists and !overwrite, or the temporary file cannot be made.
  /// Removes temporary files that earlier, dead writers to `path` left behind.
  LlmqWriter(const std::string& path, bool overwrite);
  ~LlmqWriter();
  LlmqWriter(const LlmqWriter&) = delete;
  LlmqWriter& operator=(const LlmqWriter&) = delete;

  Metadata meta;
  /// Declares the next tensor; returns its index. Must precede begin().
  size_t declare(const std::string& name, DType type, const std::vector<int64_t>& shape);
  /// Writes header, metadata and the directory (checksums patched in later).
  void begin();
  /// Writes tensor `index` (declaration order); `bytes` must equal its declared size.
  void write_tensor(size_t index, const void* data, uint64_t bytes);
  /// Patches checksums, fsyncs, renames the temporary file onto the target.
  void finish();

  const std::vector<TensorInfo>& tensors() const { return tensors_; }

 private:
  void write_all(const void* p, size_t n);
  void write_at(uint64_t off, const void* p, size_t n);
  std::vector<uint8_t> encode_index(uint64_t* dir_offset) const;

  std::string path_, tmp_path_;
  int fd_ = -1;
  bool begun_ = false, done_ = false;
  bool overwrite_ = false;
  void put_in_place();  // the temporary file to path_ (exclusively unless overwrite_)
  size_t next_ = 0;
  uint64_t pos_ = 0, data_offset_ = 0, meta_size_ = 0, dir_size_ = 0;
  std::vector<TensorInfo> tensors_;
};

/// Recomputes the header and index checksums of an in-memory `.llmq` image (tests use it to
/// reach the structural validation behind the checksums). Returns false if the header is too
/// short or its offsets are out of range.
bool llmq_fix_checksums(std::vector<uint8_t>& image);

}  // namespace llmq
