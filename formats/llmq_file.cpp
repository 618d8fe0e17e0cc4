#include "formats/llmq_file.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/error.h"
#include "base/mapped_file.h"

namespace llmq {

// ---------------------------------------------------------------- metadata getters

namespace {
[[noreturn]] void meta_fail(const std::string& key, const char* what) {
  throw MetadataError("metadata key '" + key + "' " + what);
}
template <typename T>
const T& meta_get(const Metadata& m, const std::string& key, const char* type_name) {
  auto it = m.values.find(key);
  if (it == m.values.end()) meta_fail(key, "is missing");
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  throw MetadataError("metadata key '" + key + "' is not of type " + type_name);
}
}  // namespace

int64_t Metadata::get_int(const std::string& key) const { return meta_get<int64_t>(*this, key, "int"); }
int64_t Metadata::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}
double Metadata::get_float(const std::string& key) const {
  auto it = values.find(key);
  if (it != values.end())
    if (const int64_t* i = std::get_if<int64_t>(&it->second)) return double(*i);
  return meta_get<double>(*this, key, "float");
}
double Metadata::get_float(const std::string& key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}
bool Metadata::get_bool(const std::string& key, bool fallback) const {
  return has(key) ? meta_get<bool>(*this, key, "bool") : fallback;
}
const std::string& Metadata::get_string(const std::string& key) const {
  return meta_get<std::string>(*this, key, "string");
}
std::string Metadata::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}
const std::vector<int32_t>& Metadata::get_i32_array(const std::string& key) const {
  return meta_get<std::vector<int32_t>>(*this, key, "int32 array");
}
const std::vector<float>& Metadata::get_f32_array(const std::string& key) const {
  return meta_get<std::vector<float>>(*this, key, "float32 array");
}
const std::vector<std::string>& Metadata::get_string_array(const std::string& key) const {
  return meta_get<std::vector<std::string>>(*this, key, "string array");
}

// ---------------------------------------------------------------- sizes

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t tensor_nbytes(DType type, const std::vector<int64_t>& shape) {
  if (shape.empty() || shape.size() > 4) throw UsageError("tensor must have 1 to 4 dimensions");
  constexpr uint64_t kMax = uint64_t(1) << 48;
  uint64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) {
    if (shape[i] < 1 || uint64_t(shape[i]) > kMax) throw UsageError("tensor dimension out of range");
    rows *= uint64_t(shape[i]);
    if (rows > kMax) throw UsageError("tensor is absurdly large");
  }
  const int64_t cols = shape.back();
  if (cols < 1 || uint64_t(cols) > kMax) throw UsageError("tensor dimension out of range");
  const uint64_t rb = row_bytes(type, cols);
  if (rb != 0 && rows > kMax / rb) throw UsageError("tensor is absurdly large");
  return rows * rb;
}

// ---------------------------------------------------------------- on-disk encoding

namespace {

// Metadata value tags (docs/FORMAT.md).
enum : uint32_t {
  kTagBool = 1,
  kTagInt = 2,
  kTagFloat = 3,
  kTagString = 4,
  kTagArrI32 = 5,
  kTagArrF32 = 6,
  kTagArrString = 7,
};

struct Out {
  std::vector<uint8_t> b;
  void raw(const void* p, size_t n) {
    auto* c = static_cast<const uint8_t*>(p);
    b.insert(b.end(), c, c + n);
  }
  template <typename T>
  void put(T v) { raw(&v, sizeof v); }
  void str(const std::string& s) {
    put<uint32_t>(uint32_t(s.size()));
    raw(s.data(), s.size());
  }
};

// Bounds-checked little-endian reader over [p, end). Every failure names the section.
struct In {
  const uint8_t* p;
  const uint8_t* end;
  const std::string& path;
  const char* section;

  [[noreturn]] void fail(const std::string& what) const {
    throw FileError(path, std::string(section) + ": " + what);
  }
  void need(uint64_t n) const {
    if (n > uint64_t(end - p)) fail("truncated (needs " + std::to_string(n) + " more bytes, " +
                                    std::to_string(end - p) + " left)");
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p, sizeof v);
    p += sizeof v;
    return v;
  }
  std::string str(uint32_t max_len) {
    const uint32_t n = get<uint32_t>();
    if (n > max_len) fail("string length " + std::to_string(n) + " exceeds " + std::to_string(max_len));
    need(n);
    std::string s(reinterpret_cast<const char*>(p), n);
    p += n;
    return s;
  }
  uint64_t count(uint64_t elem_size) {
    const uint64_t n = get<uint64_t>();
    if (elem_size && n > uint64_t(end - p) / elem_size)
      fail("count " + std::to_string(n) + " exceeds the bytes left");
    return n;
  }
};

constexpr uint32_t kMaxKey = 1024;
constexpr uint32_t kMaxString = 64u << 20;

void encode_meta(Out& o, const Metadata& m) {
  o.put<uint64_t>(m.values.size());
  for (const auto& [key, v] : m.values) {
    o.str(key);
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, bool>) o.put<uint32_t>(kTagBool), o.put<uint8_t>(x ? 1 : 0);
          else if constexpr (std::is_same_v<T, int64_t>) o.put<uint32_t>(kTagInt), o.put<int64_t>(x);
          else if constexpr (std::is_same_v<T, double>) o.put<uint32_t>(kTagFloat), o.put<double>(x);
          else if constexpr (std::is_same_v<T, std::string>) o.put<uint32_t>(kTagString), o.str(x);
          else if constexpr (std::is_same_v<T, std::vector<int32_t>>) {
            o.put<uint32_t>(kTagArrI32), o.put<uint64_t>(x.size()), o.raw(x.data(), x.size() * 4);
          } else if constexpr (std::is_same_v<T, std::vector<float>>) {
            o.put<uint32_t>(kTagArrF32), o.put<uint64_t>(x.size()), o.raw(x.data(), x.size() * 4);
          } else {
            o.put<uint32_t>(kTagArrString), o.put<uint64_t>(x.size());
            for (const auto& s : x) o.str(s);
          }
        },
        v);
  }
}

Metadata decode_meta(In& in) {
  Metadata m;
  const uint64_t n = in.count(4 + 4);  // each entry has at least a key length and a tag
  for (uint64_t i = 0; i < n; ++i) {
    std::string key = in.str(kMaxKey);
    if (key.empty()) in.fail("empty key");
    if (m.has(key)) in.fail("duplicate key '" + key + "'");
    const uint32_t tag = in.get<uint32_t>();
    MetaValue v;
    switch (tag) {
      case kTagBool: {
        const uint8_t b = in.get<uint8_t>();
        if (b > 1) in.fail("key '" + key + "': bool value " + std::to_string(b));
        v = b == 1;
        break;
      }
      case kTagInt: v = in.get<int64_t>(); break;
      case kTagFloat: v = in.get<double>(); break;
      case kTagString: v = in.str(kMaxString); break;
      case kTagArrI32: {
        std::vector<int32_t> a(in.count(4));
        in.need(a.size() * 4);
        if (!a.empty()) std::memcpy(a.data(), in.p, a.size() * 4);  // empty: data() may be null
        in.p += a.size() * 4;
        v = std::move(a);
        break;
      }
      case kTagArrF32: {
        std::vector<float> a(in.count(4));
        in.need(a.size() * 4);
        if (!a.empty()) std::memcpy(a.data(), in.p, a.size() * 4);  // empty: data() may be null
        in.p += a.size() * 4;
        v = std::move(a);
        break;
      }
      case kTagArrString: {
        const uint64_t k = in.count(4);
        std::vector<std::string> a;
        a.reserve(k);
        for (uint64_t j = 0; j < k; ++j) a.push_back(in.str(kMaxString));
        v = std::move(a);
        break;
      }
      default: in.fail("key '" + key + "': unknown value type tag " + std::to_string(tag));
    }
    m.values.emplace(std::move(key), std::move(v));
  }
  if (in.p != in.end) in.fail(std::to_string(in.end - in.p) + " unexpected trailing bytes");
  return m;
}

void encode_dir(Out& o, const std::vector<TensorInfo>& ts) {
  o.put<uint64_t>(ts.size());
  for (const auto& t : ts) {
    o.str(t.name);
    o.put<uint32_t>(uint32_t(t.type));
    o.put<uint32_t>(uint32_t(t.shape.size()));
    for (int64_t d : t.shape) o.put<int64_t>(d);
    o.put<uint64_t>(t.offset);
    o.put<uint64_t>(t.nbytes);
    o.put<uint64_t>(t.xxh64);
  }
}

std::vector<TensorInfo> decode_dir(In& in, uint64_t data_size) {
  const uint64_t n = in.count(4 + 4 + 4 + 8 + 24);  // smallest possible entry
  std::vector<TensorInfo> ts;
  ts.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    TensorInfo t;
    t.name = in.str(kMaxKey);
    const std::string who = "tensor '" + t.name + "'";
    if (t.name.empty()) in.fail("tensor " + std::to_string(i) + " has an empty name");
    const uint32_t type = in.get<uint32_t>();
    if (!dtype_known(type)) in.fail(who + ": unknown type id " + std::to_string(type));
    t.type = DType(type);
    const uint32_t ndim = in.get<uint32_t>();
    if (ndim < 1 || ndim > 4) in.fail(who + ": " + std::to_string(ndim) + " dimensions (1 to 4 allowed)");
    for (uint32_t d = 0; d < ndim; ++d) t.shape.push_back(in.get<int64_t>());
    t.offset = in.get<uint64_t>();
    t.nbytes = in.get<uint64_t>();
    t.xxh64 = in.get<uint64_t>();
    uint64_t expect = 0;
    try {
      expect = tensor_nbytes(t.type, t.shape);
    } catch (const UsageError& e) {
      in.fail(who + ": bad shape for type " + dtype_name(t.type) + ": " + e.what());
    }
    if (expect != t.nbytes)
      in.fail(who + ": byte size " + std::to_string(t.nbytes) + " does not match shape x type (" +
              std::to_string(expect) + ")");
    if (t.offset % kLlmqAlign != 0) in.fail(who + ": offset " + std::to_string(t.offset) + " is not 64-byte aligned");
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      in.fail(who + ": data [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
              ") lies past the end of the file");
    ts.push_back(std::move(t));
  }
  if (in.p != in.end) in.fail(std::to_string(in.end - in.p) + " unexpected trailing bytes");
  return ts;
}

struct Header {
  uint32_t version, alignment;
  uint64_t file_size, meta_offset, meta_size, dir_offset, dir_size, data_offset, index_xxh64, header_xxh64;
};

void encode_header(uint8_t* out, const Header& h) {
  Out o;
  o.raw(kLlmqMagic, 8);
  o.put(h.version), o.put(h.alignment), o.put(h.file_size), o.put(h.meta_offset), o.put(h.meta_size);
  o.put(h.dir_offset), o.put(h.dir_size), o.put(h.data_offset), o.put(h.index_xxh64);
  const uint64_t hx = XXH64(o.b.data(), o.b.size(), 0);
  o.put(hx);
  std::memcpy(out, o.b.data(), kLlmqHeaderSize);
}

uint64_t align_up(uint64_t x) { return (x + kLlmqAlign - 1) / kLlmqAlign * kLlmqAlign; }

// The header of a mapped file of `size` bytes at b (at least kLlmqHeaderSize), checked: magic, version,
// checksum, alignment, the file size, the sections' offsets and sizes, and the index checksum.
Header read_header(const uint8_t* b, uint64_t size, const std::string& path) {
  if (std::memcmp(b, kLlmqMagic, 8) != 0) throw FileError(path, "not a .llmq file (bad magic)");
  In hin{b + 8, b + kLlmqHeaderSize, path, "header"};
  Header h{};
  h.version = hin.get<uint32_t>();
  h.alignment = hin.get<uint32_t>();
  h.file_size = hin.get<uint64_t>();
  h.meta_offset = hin.get<uint64_t>();
  h.meta_size = hin.get<uint64_t>();
  h.dir_offset = hin.get<uint64_t>();
  h.dir_size = hin.get<uint64_t>();
  h.data_offset = hin.get<uint64_t>();
  h.index_xxh64 = hin.get<uint64_t>();
  h.header_xxh64 = hin.get<uint64_t>();
  if (h.version != kLlmqVersion)
    throw FileError(path, "unsupported format version " + std::to_string(h.version) + " (this build reads " +
                              std::to_string(kLlmqVersion) + ")");
  if (XXH64(b, kLlmqHeaderSize - 8, 0) != h.header_xxh64) throw FileError(path, "header checksum mismatch (corrupt header)");
  if (h.alignment != kLlmqAlign) throw FileError(path, "header: alignment " + std::to_string(h.alignment) + " (expected 64)");
  if (h.file_size != size)
    throw FileError(path, "file is " + std::to_string(size) + " bytes but its header says " +
                              std::to_string(h.file_size) + " (truncated or appended to)");
  if (h.meta_offset != kLlmqHeaderSize || h.meta_size > size - h.meta_offset ||
      h.dir_offset != h.meta_offset + h.meta_size || h.dir_size > size - h.dir_offset ||
      h.data_offset != align_up(h.dir_offset + h.dir_size) || h.data_offset > size)
    throw FileError(path, "header: section offsets and sizes are inconsistent with each other or the file size");
  if (XXH64(b + h.meta_offset, h.meta_size + h.dir_size, 0) != h.index_xxh64)
    throw FileError(path, "metadata/directory checksum mismatch (corrupt index)");
  return h;
}

}  // namespace

// ---------------------------------------------------------------- reader

LlmqFile::~LlmqFile() = default;

const TensorInfo* LlmqFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::unique_ptr<LlmqFile> LlmqFile::open(const std::string& path, bool verify) {
  std::unique_ptr<LlmqFile> f(new LlmqFile());
  f->map_ = MappedFile::open(path);
  f->path_ = path;
  f->base_ = f->map_->data();
  f->size_ = f->map_->size();
  if (f->size_ < kLlmqHeaderSize)
    throw FileError(path, "not a .llmq file: " + std::to_string(f->size_) + " bytes is shorter than the header");
  const uint8_t* b = f->base_;

  const Header h = read_header(b, f->size_, path);

  In min{b + h.meta_offset, b + h.meta_offset + h.meta_size, path, "metadata"};
  f->meta_ = decode_meta(min);
  In din{b + h.dir_offset, b + h.dir_offset + h.dir_size, path, "tensor directory"};
  f->data_offset_ = h.data_offset;
  f->tensors_ = decode_dir(din, f->size_ - h.data_offset);

  // Names unique, no two tensors overlap.
  std::vector<const TensorInfo*> order;
  for (size_t i = 0; i < f->tensors_.size(); ++i) {
    if (!f->by_name_.emplace(f->tensors_[i].name, i).second)
      throw FileError(path, "tensor directory: duplicate tensor name '" + f->tensors_[i].name + "'");
    order.push_back(&f->tensors_[i]);
  }
  std::sort(order.begin(), order.end(), [](auto* a, auto* c) { return a->offset < c->offset; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
      throw FileError(path, "tensor directory: tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");

  if (verify)
    for (const auto& t : f->tensors_) {
      if (XXH64(f->data(t), t.nbytes, 0) != t.xxh64)
        throw FileError(path, "tensor '" + t.name + "': checksum mismatch (corrupt data; --no-verify skips this check)");
      f->release(f->data(t), t.nbytes);  // read once here: the whole file need not be resident at once
    }
  return f;
}

bool llmq_fix_checksums(std::vector<uint8_t>& img) {
  if (img.size() < kLlmqHeaderSize) return false;
  uint64_t meta_off, meta_size, dir_size;
  std::memcpy(&meta_off, img.data() + 24, 8);
  std::memcpy(&meta_size, img.data() + 32, 8);
  std::memcpy(&dir_size, img.data() + 48, 8);
  if (meta_off > img.size() || meta_size > img.size() - meta_off || dir_size > img.size() - meta_off - meta_size)
    return false;
  const uint64_t ix = XXH64(img.data() + meta_off, meta_size + dir_size, 0);
  std::memcpy(img.data() + 64, &ix, 8);
  const uint64_t hx = XXH64(img.data(), kLlmqHeaderSize - 8, 0);
  std::memcpy(img.data() + 72, &hx, 8);
  return true;
}

// ---------------------------------------------------------------- writer

namespace {

// Removes the temporary files in `dir` named `prefix` + 6 characters (mkstemp's) that no live
// writer holds: a writer keeps an exclusive flock on its temporary file until it is renamed or
// removed, and the kernel drops the lock when the process dies, however it dies.
void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::filesystem::path> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() == prefix.size() + 6 && name.compare(0, prefix.size(), prefix) == 0) found.push_back(it->path());
  }
  for (const auto& p : found) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat sb;
    if (::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(p.c_str());
    ::close(fd);
  }
}

}  // namespace

LlmqWriter::LlmqWriter(const std::string& path, bool overwrite) : path_(path), overwrite_(overwrite) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  std::string name(".");  // ".NAME.tmp.XXXXXX" (built by appends: GCC 12 warns falsely on "." + str)
  name.append(target.filename().string()).append(".tmp.");
  remove_stale_temporaries(dir, name);  // left by writers that were killed before finish()
  if (!overwrite && fs::exists(path)) throw FileError(path, "exists already (use --force to overwrite)");
  for (int attempt = 0;; ++attempt) {
    std::string tmpl = (dir / (name + "XXXXXX")).string();
    fd_ = mkstemp(tmpl.data());
    if (fd_ < 0) throw FileError(path, std::string("cannot create a temporary file beside it: ") + std::strerror(errno));
    tmp_path_ = tmpl;
    // Lock it at once; if another writer's cleanup removed it between mkstemp and flock (it
    // looked stale for that instant), the name no longer leads to this file: make another.
    struct stat by_fd, by_name;
    if (::flock(fd_, LOCK_EX) == 0 && ::fstat(fd_, &by_fd) == 0 && ::stat(tmp_path_.c_str(), &by_name) == 0 &&
        by_fd.st_ino == by_name.st_ino && by_fd.st_dev == by_name.st_dev)
      break;
    ::close(fd_);
    fd_ = -1;
    if (attempt == 3) throw FileError(path, "cannot lock a temporary file beside it (another writer keeps removing it)");
  }
  const mode_t mask = umask(0);  // mkstemp makes 0600; give the file the usual 0666 & ~umask
  umask(mask);
  fchmod(fd_, 0666 & ~mask);
}

LlmqWriter::~LlmqWriter() {
  if (!done_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());  // before close: still locked
  if (fd_ >= 0) ::close(fd_);
}

size_t LlmqWriter::declare(const std::string& name, DType type, const std::vector<int64_t>& shape) {
  if (begun_) throw UsageError("LlmqWriter::declare after begin()");
  if (name.empty() || name.size() > kMaxKey) throw UsageError("bad tensor name '" + name + "'");
  for (const auto& t : tensors_)
    if (t.name == name) throw UsageError("duplicate tensor name '" + name + "'");
  TensorInfo t;
  t.name = name;
  t.type = type;
  t.shape = shape;
  t.nbytes = tensor_nbytes(type, shape);
  uint64_t off = 0;
  if (!tensors_.empty()) off = align_up(tensors_.back().offset + tensors_.back().nbytes);
  t.offset = off;
  tensors_.push_back(std::move(t));
  return tensors_.size() - 1;
}

void LlmqWriter::write_all(const void* p, size_t n) {
  auto* c = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd_, c, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw FileError(path_, std::string("write failed: ") + std::strerror(errno));
    }
    c += w, n -= size_t(w), pos_ += uint64_t(w);
  }
}

void LlmqWriter::write_at(uint64_t off, const void* p, size_t n) {
  auto* c = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, c, n, off_t(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw FileError(path_, std::string("write failed: ") + std::strerror(errno));
    }
    c += w, n -= size_t(w), off += uint64_t(w);
  }
}

std::vector<uint8_t> LlmqWriter::encode_index(uint64_t* dir_offset) const {
  Out mo;
  encode_meta(mo, meta);
  Out dout;
  encode_dir(dout, tensors_);
  *dir_offset = kLlmqHeaderSize + mo.b.size();
  std::vector<uint8_t> all = std::move(mo.b);
  all.insert(all.end(), dout.b.begin(), dout.b.end());
  return all;
}

void LlmqWriter::begin() {
  if (begun_) throw UsageError("LlmqWriter::begin called twice");
  begun_ = true;
  Out mo;
  encode_meta(mo, meta);
  meta_size_ = mo.b.size();
  Out dout;
  encode_dir(dout, tensors_);  // checksums are 0 for now; same size later
  dir_size_ = dout.b.size();
  data_offset_ = align_up(kLlmqHeaderSize + meta_size_ + dir_size_);
  std::vector<uint8_t> head(data_offset_, 0);  // header is written last, by finish()
  std::memcpy(head.data() + kLlmqHeaderSize, mo.b.data(), meta_size_);
  std::memcpy(head.data() + kLlmqHeaderSize + meta_size_, dout.b.data(), dir_size_);
  write_all(head.data(), head.size());
}

void LlmqWriter::write_tensor(size_t index, const void* data, uint64_t bytes) {
  if (!begun_ || index != next_ || index >= tensors_.size())
    throw UsageError("LlmqWriter::write_tensor: tensors must be written once each, in declaration order");
  TensorInfo& t = tensors_[index];
  if (bytes != t.nbytes)
    throw UsageError("tensor '" + t.name + "': got " + std::to_string(bytes) + " bytes, declared " + std::to_string(t.nbytes));
  const uint64_t want = data_offset_ + t.offset;
  static const uint8_t zeros[kLlmqAlign] = {};
  if (pos_ > want) throw UsageError("LlmqWriter: internal offset error");
  write_all(zeros, size_t(want - pos_));
  write_all(data, bytes);
  t.xxh64 = XXH64(data, bytes, 0);
  ++next_;
}

// The temporary file becomes `path_`. Without overwrite the target is created exclusively: of
// two writers of one path only the first to finish succeeds, the other gets EEXIST (a rename
// would let the last one win silently). renameat2(RENAME_NOREPLACE) where the file system
// takes it, else a hard link (which fails on an existing name too) and the temporary unlinked.
void LlmqWriter::put_in_place() {
  if (overwrite_) {
    if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
      throw FileError(path_, std::string("cannot rename the temporary file into place: ") + std::strerror(errno));
    return;
  }
  if (::renameat2(AT_FDCWD, tmp_path_.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL || err == ENOSYS || err == ENOTSUP) {  // no RENAME_NOREPLACE here: link, then unlink
    if (::link(tmp_path_.c_str(), path_.c_str()) == 0) {
      ::unlink(tmp_path_.c_str());
      return;
    }
    err = errno;
  }
  if (err == EEXIST) throw FileError(path_, "exists already: another writer finished it first (use --force to overwrite)");
  throw FileError(path_, std::string("cannot move the temporary file into place: ") + std::strerror(err));
}

void LlmqWriter::finish() {
  if (!begun_ || next_ != tensors_.size()) throw UsageError("LlmqWriter::finish before all tensors were written");
  uint64_t dir_offset = 0;
  std::vector<uint8_t> index = encode_index(&dir_offset);
  if (index.size() != meta_size_ + dir_size_) throw UsageError("LlmqWriter: metadata changed size after begin() (only same-size updates such as filling a declared array are allowed)");
  write_at(kLlmqHeaderSize, index.data(), index.size());
  Header h{};
  h.version = kLlmqVersion;
  h.alignment = kLlmqAlign;
  h.file_size = pos_;
  h.meta_offset = kLlmqHeaderSize;
  h.meta_size = meta_size_;
  h.dir_offset = dir_offset;
  h.dir_size = dir_size_;
  h.data_offset = data_offset_;
  h.index_xxh64 = XXH64(index.data(), index.size(), 0);
  uint8_t head[kLlmqHeaderSize];
  encode_header(head, h);
  write_at(0, head, sizeof head);
  if (::fsync(fd_) != 0) throw FileError(path_, std::string("fsync failed: ") + std::strerror(errno));
  // Rename while the file is still open, so its lock keeps other writers' cleanup away until it
  // has its final name; the data is on disk already (fsync), so close cannot lose any.
  put_in_place();
  done_ = true;
  const int close_rc = ::close(fd_);
  fd_ = -1;
  if (close_rc != 0) throw FileError(path_, std::string("close failed: ") + std::strerror(errno));
  // Make the rename durable.
  std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace llmq
