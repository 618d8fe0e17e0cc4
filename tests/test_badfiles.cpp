// Bad input files against the real tools ([badfiles]).
//
// Every test here runs the built binaries (llmq-convert, llmq-run) as child processes and
// checks what a user sees: the exit status and stderr. What is checked:
//  * a valid model (stories260K converted to q8_0 once per run) loads and generates (exit 0);
//  * corrupt `.llmq` files make llmq-run exit with code exactly 2 (never 0/1, never a signal,
//    never a hang) and print one line holding "error" and the file's path:
//      - truncation at 30+ points spread over every section, and appended bytes;
//      - raw corruption of the magic, version, header, metadata, directory and tensor data
//        (caught by the checksums);
//      - the same kinds of corruption with the checksums re-fixed (llmq_fix_checksums), so
//        the structural validation behind them must catch them (absurd counts and lengths,
//        unknown tags and type ids, bad ndim/dims, offsets, sizes, header fields...);
//      - structurally valid files whose metadata or tensor table does not describe a usable
//        model (written with LlmqWriter: missing/mistyped keys, wrong shapes, missing tensors,
//        inconsistent tokenizer metadata);
//  * --no-verify skips only the tensor-data checksum;
//  * llmq-convert rejects truncated/absurd/random llama2.c checkpoints and tokenizer files
//    with exit 2 and leaves neither the output nor its temporary file behind;
//  * llmq-convert does not overwrite an existing output without --force, and does with it;
//  * a seeded sweep of 200 random byte mutations (half with re-fixed checksums) only ever
//    ends in exit 0 (harmless change) or exit 2, never a crash or a hang.
// The sections of the `.llmq` file are located by parsing the good file's header, metadata
// and directory here, so no offset depends on the particular model.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <future>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <bit>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/error.h"
#include "formats/llmq_file.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;
static_assert(std::endian::native == std::endian::little, "the tests edit little-endian fields in place");

// ---------------------------------------------------------------- running a tool

/// How a child process ended.
struct RunResult {
  bool exited = false;     ///< ended by exit() (not by a signal, not killed for the timeout)
  int code = -1;           ///< exit status when exited
  int signal = 0;          ///< the signal that ended it, if any
  bool timed_out = false;  ///< killed because it ran past the time limit
  double seconds = 0;
  std::string err;         ///< everything it wrote to stderr (first 64 KiB)

  std::string describe() const {
    std::string s = timed_out ? "timed out (killed)"
                    : exited  ? "exit " + std::to_string(code)
                              : "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
    char t[32];
    std::snprintf(t, sizeof t, " after %.2f s", seconds);
    return s + t + "; stderr:\n" + err;
  }
};

/// Runs argv[0] with argv (no shell), stdin and stdout on /dev/null, stderr captured.
/// Kills it (SIGKILL) if it runs longer than timeout_s. The child's address space is capped
/// at 4 GiB, so a file that makes a tool allocate absurdly fails fast instead of swapping.
RunResult run_tool(const std::vector<std::string>& argv, double timeout_s = 20.0) {
  std::vector<char*> args = llmq::test::exec_args(argv);
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    llmq::test::child_stdio(pfd[1]);
    llmq::test::cap_child_memory();
    execv(args[0], args.data());
    _exit(127);
  }
  close(pfd[1]);
  RunResult r;
  const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 && !r.timed_out) {
      kill(pid, SIGKILL);
      r.timed_out = true;
    }
    pollfd p{pfd[0], POLLIN, 0};
    const int n = poll(&p, 1, r.timed_out ? 2000 : int(left.count()) + 1);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && r.timed_out) break;
    if (n <= 0) continue;
    const ssize_t got = read(pfd[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    if (r.err.size() < (64u << 10)) r.err.append(buf, size_t(got));
  }
  close(pfd[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(status) && !r.timed_out) {
    r.exited = true;
    r.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  return r;
}

RunResult run_model(const std::string& model, bool no_verify = false, double timeout_s = 20.0) {
  std::vector<std::string> a{llmq::test::bin("llmq-run"), "-m", model, "-p", "Once", "-n", "2", "--temp", "0"};
  if (no_verify) a.push_back("--no-verify");
  return run_tool(a, timeout_s);
}

RunResult run_convert(const std::string& checkpoint, const std::string& tokenizer, const std::string& out,
                      bool force = false) {
  std::vector<std::string> a{llmq::test::bin("llmq-convert"), checkpoint, "--tokenizer", tokenizer, "--type", "q8_0",
                             "-o", out, "--no-progress"};
  if (force) a.push_back("--force");
  return run_tool(a);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// True if one line of `err` holds both "error" and `path`.
bool has_error_line(const std::string& err, const std::string& path) {
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);)
    if (contains(line, "error") && contains(line, path)) return true;
  return false;
}

/// The checks every rejected input must pass: exit status exactly 2, quickly, and one
/// stderr line with "error" and the offending file's path.
void check_rejected(const RunResult& r, const std::string& path, const std::string& label) {
  INFO("case: " << label);
  INFO("file: " << path);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exited);
  CHECK(r.code == 2);
  CHECK(r.seconds < 10.0);
  CHECK(has_error_line(r.err, path));
}

// ---------------------------------------------------------------- files and bytes

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

template <typename T>
T get(const Bytes& b, uint64_t pos) {
  if (pos + sizeof(T) > b.size()) throw std::out_of_range("get past the end");
  T v;
  std::memcpy(&v, b.data() + pos, sizeof v);
  return v;
}

template <typename T>
void put(Bytes& b, uint64_t pos, T v) {
  if (pos + sizeof(T) > b.size()) throw std::out_of_range("put past the end");
  std::memcpy(b.data() + pos, &v, sizeof v);
}

/// Recomputes both checksums. If llmq_fix_checksums refuses (offsets out of range), at least
/// the header checksum is recomputed, so the reader's header consistency checks are reached.
void seal(Bytes& img) {
  if (img.size() < llmq::kLlmqHeaderSize) return;
  if (!llmq::llmq_fix_checksums(img)) put<uint64_t>(img, 72, XXH64(img.data(), 72, 0));
}

/// A file name made of the label (letters, digits, '_' and '-').
std::string file_name(const std::string& label, const char* ext = ".llmq") {
  std::string s;
  for (char c : label) s += (std::isalnum(static_cast<unsigned char>(c)) || c == '-') ? c : '_';
  return s + ext;
}

/// Temporary files LlmqWriter leaves beside `out` (".NAME.tmp.XXXXXX").
std::vector<std::string> tmp_siblings(const std::string& out) {
  std::vector<std::string> found;
  const fs::path p(out);
  std::string prefix = ".";
  prefix += p.filename().string();
  prefix += ".tmp.";
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) found.push_back(e.path().string());
  return found;
}

// ---------------------------------------------------------------- the good file's layout

struct MetaEntry {
  std::string key;
  uint64_t at = 0;        ///< the key length field
  uint32_t tag = 0;
  uint64_t tag_at = 0;
  uint64_t value_at = 0;  ///< the value (for arrays: the u64 count)
  uint64_t end = 0;
};

struct DirEntry {
  std::string name;
  uint64_t at = 0;  ///< the name length field
  uint32_t type = 0, ndim = 0;
  uint64_t type_at = 0, ndim_at = 0, dims_at = 0, offset_at = 0, nbytes_at = 0, xxh_at = 0, end = 0;
  std::vector<int64_t> dims;
  uint64_t offset = 0, nbytes = 0;
};

struct Layout {
  uint64_t file_size = 0, meta_offset = 0, meta_size = 0, dir_offset = 0, dir_size = 0, data_offset = 0;
  std::vector<MetaEntry> meta;
  std::vector<DirEntry> dir;

  const MetaEntry& key(const std::string& k) const {
    for (const auto& m : meta)
      if (m.key == k) return m;
    throw std::runtime_error("the good file has no metadata key " + k);
  }
  const MetaEntry& first_tag(uint32_t tag) const {
    for (const auto& m : meta)
      if (m.tag == tag) return m;
    throw std::runtime_error("the good file has no metadata value with tag " + std::to_string(tag));
  }
  const DirEntry& tensor(const std::string& n) const {
    for (const auto& d : dir)
      if (d.name == n) return d;
    throw std::runtime_error("the good file has no tensor " + n);
  }
  /// The first tensor with `ndim` dimensions (and of `type`, unless type < 0).
  const DirEntry& first_tensor(uint32_t ndim, int64_t type = -1) const {
    for (const auto& d : dir)
      if (d.ndim == ndim && (type < 0 || d.type == uint32_t(type))) return d;
    throw std::runtime_error("the good file has no such tensor");
  }
  uint64_t data_pos(const DirEntry& d) const { return data_offset + d.offset; }
  uint64_t dir_end() const { return dir_offset + dir_size; }
};

/// Walks header, metadata and directory (docs/FORMAT.md) independently of the library.
Layout parse_layout(const Bytes& b) {
  Layout L;
  L.file_size = get<uint64_t>(b, 16);
  L.meta_offset = get<uint64_t>(b, 24);
  L.meta_size = get<uint64_t>(b, 32);
  L.dir_offset = get<uint64_t>(b, 40);
  L.dir_size = get<uint64_t>(b, 48);
  L.data_offset = get<uint64_t>(b, 56);
  uint64_t p = L.meta_offset;
  auto str = [&] {
    const uint32_t n = get<uint32_t>(b, p);
    if (p + 4 + n > b.size()) throw std::runtime_error("layout: string past the end");
    std::string s(reinterpret_cast<const char*>(b.data() + p + 4), n);
    p += 4 + n;
    return s;
  };
  const uint64_t nmeta = get<uint64_t>(b, p);
  p += 8;
  for (uint64_t i = 0; i < nmeta; ++i) {
    MetaEntry m;
    m.at = p;
    m.key = str();
    m.tag_at = p;
    m.tag = get<uint32_t>(b, p);
    p += 4;
    m.value_at = p;
    switch (m.tag) {
      case 1: p += 1; break;
      case 2: case 3: p += 8; break;
      case 4: str(); break;
      case 5: case 6: p += 8 + 4 * get<uint64_t>(b, p); break;
      case 7: {
        const uint64_t k = get<uint64_t>(b, p);
        p += 8;
        for (uint64_t j = 0; j < k; ++j) str();
        break;
      }
      default: throw std::runtime_error("layout: unknown tag in the good file");
    }
    m.end = p;
    L.meta.push_back(m);
  }
  if (p != L.dir_offset) throw std::runtime_error("layout: metadata does not end at the directory");
  const uint64_t ndir = get<uint64_t>(b, p);
  p += 8;
  for (uint64_t i = 0; i < ndir; ++i) {
    DirEntry d;
    d.at = p;
    d.name = str();
    d.type_at = p;
    d.type = get<uint32_t>(b, p);
    d.ndim_at = p + 4;
    d.ndim = get<uint32_t>(b, p + 4);
    p += 8;
    d.dims_at = p;
    for (uint32_t k = 0; k < d.ndim; ++k, p += 8) d.dims.push_back(get<int64_t>(b, p));
    d.offset_at = p;
    d.offset = get<uint64_t>(b, p);
    d.nbytes_at = p + 8;
    d.nbytes = get<uint64_t>(b, p + 8);
    d.xxh_at = p + 16;
    p += 24;
    d.end = p;
    L.dir.push_back(d);
  }
  if (p != L.dir_end()) throw std::runtime_error("layout: directory size mismatch");
  return L;
}

// ---------------------------------------------------------------- the shared good model

struct Fixture {
  std::string dir;   ///< scratch folder holding good.llmq
  std::string good;  ///< the valid model
  Bytes bytes;       ///< its contents
  Layout lay;
};

std::string checkpoint_path() { return llmq::test::shared("models/stories260K/stories260K.bin"); }
std::string tokenizer_path() { return llmq::test::shared("models/stories260K/tok512.bin"); }

Fixture make_fixture() {
  Fixture f;
  f.dir = llmq::test::scratch("badfiles");
  f.good = f.dir + "/good.llmq";
  const RunResult r = run_convert(checkpoint_path(), tokenizer_path(), f.good);
  if (!r.exited || r.code != 0) throw std::runtime_error("llmq-convert of stories260K failed: " + r.describe());
  f.bytes = read_file(f.good);
  f.lay = parse_layout(f.bytes);
  return f;
}

/// Converted once per test run, shared by every test case.
const Fixture& fixture() {
  static const Fixture f = make_fixture();
  return f;
}

/// One byte-level mutation of good.llmq.
struct Mutation {
  std::string name;
  std::function<void(Bytes&)> edit;
  bool checksum_message_ok = false;  ///< (sealed cases) a checksum fault is the expected outcome
};

/// Writes each mutation to its own file in `dir`, runs llmq-run on it and checks it is
/// rejected. With `sealed`, the checksums are recomputed after the edit and the rejection must
/// come from a structural check (no "checksum mismatch" message). Returns the number run.
int expect_rejected(const std::string& dir, const std::vector<Mutation>& ms, bool sealed) {
  const Fixture& fx = fixture();
  for (const Mutation& m : ms) {
    Bytes img = fx.bytes;
    m.edit(img);
    if (sealed) seal(img);
    const std::string path = dir + "/" + file_name(m.name);
    {
      INFO("case: " << m.name);
      REQUIRE(img != fx.bytes);  // the edit changed something
    }
    write_file(path, img);
    const RunResult r = run_model(path);
    check_rejected(r, path, m.name);
    if (sealed && !m.checksum_message_ok) {
      INFO("case: " << m.name << " (must fail a structural check, not a checksum)\n" << r.err);
      CHECK_FALSE(contains(r.err, "checksum mismatch"));
    }
  }
  return int(ms.size());
}

// Metadata value tags and tensor type ids (docs/FORMAT.md).
constexpr uint32_t kTagBool = 1, kTagInt = 2, kTagFloat = 3, kTagString = 4, kTagArrI32 = 5, kTagArrF32 = 6,
                   kTagArrString = 7;
constexpr uint32_t kTypeF32 = 0, kTypeQ8_0 = 8;

}  // namespace

// ======================================================================== tests

TEST_CASE("badfiles: the converted stories260K model loads and generates", "[badfiles]") {
  const Fixture& fx = fixture();
  const RunResult r = run_tool({llmq::test::bin("llmq-run"), "-m", fx.good, "-p", "Once", "-n", "4", "--temp", "0"});
  INFO(r.describe());
  CHECK(r.exited);
  CHECK(r.code == 0);
  CHECK_FALSE(contains(r.err, "error"));
  // The layout walk agrees with the header.
  CHECK(fx.lay.file_size == fx.bytes.size());
  CHECK(fx.lay.meta_offset == 80);
  CHECK(fx.lay.data_offset % 64 == 0);
  CHECK(fx.lay.dir.size() >= 10);
  CHECK(fx.lay.meta.size() >= 10);
}

TEST_CASE("badfiles: truncated or extended .llmq files exit 2", "[badfiles]") {
  const Fixture& fx = fixture();
  const Layout& L = fx.lay;
  const std::string dir = llmq::test::scratch("badfiles_truncated");
  const uint64_t size = fx.bytes.size(), data = size - L.data_offset;
  const std::vector<uint64_t> cuts{0,
                                   1,
                                   7,
                                   8,
                                   12,
                                   40,
                                   71,
                                   72,
                                   79,
                                   80,
                                   81,
                                   L.meta_offset + 8,
                                   L.meta.front().tag_at,
                                   L.meta_offset + L.meta_size / 2,
                                   L.dir_offset - 1,
                                   L.dir_offset,
                                   L.dir_offset + 8,
                                   L.dir.front().xxh_at,
                                   L.dir_offset + L.dir_size / 2,
                                   L.dir_end() - 1,
                                   L.dir_end(),
                                   L.data_offset - 1,
                                   L.data_offset,
                                   L.data_offset + 1,
                                   L.data_offset + data / 4,
                                   L.data_offset + data / 2,
                                   L.data_offset + 3 * data / 4,
                                   L.data_pos(L.dir.back()),
                                   size - 64,
                                   size - 2,
                                   size - 1};
  int n = 0;
  for (uint64_t cut : cuts) {
    REQUIRE(cut < size);
    const Bytes img(fx.bytes.begin(), fx.bytes.begin() + long(cut));
    const std::string path = dir + "/cut_" + std::to_string(cut) + ".llmq";
    write_file(path, img);
    check_rejected(run_model(path), path, "truncated at " + std::to_string(cut) + " of " + std::to_string(size));
    ++n;
  }
  // Appended bytes (the header's file_size no longer matches).
  for (uint64_t extra : {1, 64, 4096}) {
    Bytes img = fx.bytes;
    img.resize(size + extra, 0);
    const std::string path = dir + "/appended_" + std::to_string(extra) + ".llmq";
    write_file(path, img);
    check_rejected(run_model(path), path, std::to_string(extra) + " bytes appended");
    ++n;
  }
  // Truncated, with file_size and the checksums patched to match: the section and tensor
  // bounds checks must catch it.
  for (uint64_t cut : {L.meta_offset + L.meta_size / 2, L.dir_offset + L.dir_size / 2, L.data_offset,
                       L.data_offset + data / 2, size - 1}) {
    Bytes img(fx.bytes.begin(), fx.bytes.begin() + long(cut));
    put<uint64_t>(img, 16, cut);
    seal(img);
    const std::string path = dir + "/cut_patched_" + std::to_string(cut) + ".llmq";
    write_file(path, img);
    check_rejected(run_model(path), path, "truncated at " + std::to_string(cut) + ", header patched");
    ++n;
  }
  CHECK(n >= 36);
}

TEST_CASE("badfiles: raw corruption of any section is caught (exit 2)", "[badfiles]") {
  const Fixture& fx = fixture();
  const Layout& L = fx.lay;
  const std::string dir = llmq::test::scratch("badfiles_raw");
  auto flip = [](uint64_t pos, uint8_t mask = 0xFF) { return [pos, mask](Bytes& b) { b.at(pos) ^= mask; }; };
  std::vector<Mutation> ms{
      {"magic zeroed", [](Bytes& b) { std::memset(b.data(), 0, 8); }},
      {"magic GGUF", [](Bytes& b) { std::memcpy(b.data(), "GGUF\3\0\0\0", 8); }},
      {"magic lower case", [](Bytes& b) { std::memcpy(b.data(), "llmqfile", 8); }},
      {"magic last byte", flip(7, 0x01)},
      {"version 2", [](Bytes& b) { put<uint32_t>(b, 8, 2); }},
      {"version 0", [](Bytes& b) { put<uint32_t>(b, 8, 0); }},
      {"version 0xFFFFFFFF", [](Bytes& b) { put<uint32_t>(b, 8, 0xFFFFFFFFu); }},
  };
  // Every header field, one bit and one whole byte each.
  for (uint64_t pos : {12, 13, 16, 20, 24, 31, 32, 39, 40, 47, 48, 55, 56, 63, 64, 70, 72, 79}) {
    ms.push_back({"header byte " + std::to_string(pos) + " bit 0", flip(pos, 0x01)});
    ms.push_back({"header byte " + std::to_string(pos) + " inverted", flip(pos)});
  }
  // Metadata: the count, the first key, the middle, the last byte.
  for (uint64_t pos : {L.meta_offset, L.meta_offset + 7, L.meta.front().at, L.meta.front().at + 4, L.meta.front().tag_at,
                       L.meta_offset + L.meta_size / 3, L.meta_offset + L.meta_size / 2, L.dir_offset - 1})
    ms.push_back({"metadata byte " + std::to_string(pos), flip(pos, 0x01)});
  // Directory: count, first entry's fields, the middle, the last byte.
  const DirEntry& d0 = L.dir.front();
  for (uint64_t pos : {L.dir_offset, d0.at, d0.at + 5, d0.type_at, d0.ndim_at, d0.dims_at, d0.offset_at, d0.nbytes_at,
                       d0.xxh_at, L.dir_offset + L.dir_size / 2, L.dir_end() - 1})
    ms.push_back({"directory byte " + std::to_string(pos), flip(pos, 0x01)});
  // Tensor data: first and last byte of several tensors, and the file's last byte.
  for (size_t i : {size_t(0), L.dir.size() / 3, L.dir.size() / 2, L.dir.size() - 1}) {
    const DirEntry& d = L.dir[i];
    ms.push_back({"data of " + d.name + " first byte", flip(L.data_pos(d), 0x01)});
    ms.push_back({"data of " + d.name + " middle byte", flip(L.data_pos(d) + d.nbytes / 2, 0x80)});
    ms.push_back({"data of " + d.name + " last byte", flip(L.data_pos(d) + d.nbytes - 1, 0x01)});
  }
  ms.push_back({"data file last byte", flip(fx.bytes.size() - 1, 0x01)});
  const int n = expect_rejected(dir, ms, /*sealed=*/false);
  CHECK(n >= 60);
}

TEST_CASE("badfiles: structural faults behind valid checksums exit 2", "[badfiles]") {
  const Fixture& fx = fixture();
  const Layout& L = fx.lay;
  const std::string dir = llmq::test::scratch("badfiles_structural");
  const uint64_t size = fx.bytes.size();
  const MetaEntry& m0 = L.meta.front();
  const MetaEntry& str_val = L.first_tag(kTagString);
  const MetaEntry& str_arr = L.first_tag(kTagArrString);
  const MetaEntry& f32_arr = L.first_tag(kTagArrF32);
  const MetaEntry& i32_arr = L.first_tag(kTagArrI32);
  const MetaEntry& bool_val = L.first_tag(kTagBool);
  const MetaEntry& blocks = L.key("llama.block_count");
  const MetaEntry& eps = L.key("llama.attention.layer_norm_rms_epsilon");
  const DirEntry& d0 = L.dir.front();
  const DirEntry& mat = L.first_tensor(2, kTypeQ8_0);  // a 2-D q8_0 tensor
  const DirEntry& vec = L.first_tensor(1, kTypeF32);   // a 1-D f32 tensor
  const DirEntry& last = L.dir.back();
  const uint64_t data_size = size - L.data_offset;
  const double nan = std::numeric_limits<double>::quiet_NaN();

  // Two metadata keys of the same length (to make a duplicate key).
  const MetaEntry* dup_a = nullptr;
  const MetaEntry* dup_b = nullptr;
  for (size_t i = 0; i < L.meta.size() && !dup_a; ++i)
    for (size_t j = i + 1; j < L.meta.size(); ++j)
      if (L.meta[i].key.size() == L.meta[j].key.size()) {
        dup_a = &L.meta[i], dup_b = &L.meta[j];
        break;
      }
  REQUIRE(dup_a);
  // Two tensors with names of the same length (to make a duplicate name).
  const DirEntry* tdup_a = nullptr;
  const DirEntry* tdup_b = nullptr;
  for (size_t i = 0; i < L.dir.size() && !tdup_a; ++i)
    for (size_t j = i + 1; j < L.dir.size(); ++j)
      if (L.dir[i].name.size() == L.dir[j].name.size()) {
        tdup_a = &L.dir[i], tdup_b = &L.dir[j];
        break;
      }
  REQUIRE(tdup_a);

  const std::vector<Mutation> ms{
      // ---- header fields
      {"version 2 (sealed)", [](Bytes& b) { put<uint32_t>(b, 8, 2); }},
      {"alignment 32", [](Bytes& b) { put<uint32_t>(b, 12, 32); }},
      {"alignment 0", [](Bytes& b) { put<uint32_t>(b, 12, 0); }},
      {"file_size + 1", [size](Bytes& b) { put<uint64_t>(b, 16, size + 1); }},
      {"file_size - 1", [size](Bytes& b) { put<uint64_t>(b, 16, size - 1); }},
      {"file_size 0", [](Bytes& b) { put<uint64_t>(b, 16, 0); }},
      {"file_size 2^63", [](Bytes& b) { put<uint64_t>(b, 16, uint64_t(1) << 63); }},
      {"meta_offset 0", [](Bytes& b) { put<uint64_t>(b, 24, 0); }},
      {"meta_offset 88", [](Bytes& b) { put<uint64_t>(b, 24, 88); }},
      {"meta_size past the end", [size](Bytes& b) { put<uint64_t>(b, 32, size); }},
      {"meta_size 2^63", [](Bytes& b) { put<uint64_t>(b, 32, uint64_t(1) << 63); }},
      {"meta_size + 8", [&L](Bytes& b) { put<uint64_t>(b, 32, L.meta_size + 8); }},
      {"meta_size - 1 and dir moved with it",
       [&L](Bytes& b) {
         put<uint64_t>(b, 32, L.meta_size - 1);
         put<uint64_t>(b, 40, L.dir_offset - 1);
         put<uint64_t>(b, 48, L.dir_size + 1);
       }},
      {"dir_offset + 8", [&L](Bytes& b) { put<uint64_t>(b, 40, L.dir_offset + 8); }},
      {"dir_size past the end", [size](Bytes& b) { put<uint64_t>(b, 48, size); }},
      {"dir_size 2^63", [](Bytes& b) { put<uint64_t>(b, 48, uint64_t(1) << 63); }},
      {"dir_size - 8", [&L](Bytes& b) { put<uint64_t>(b, 48, L.dir_size - 8); }},
      {"data_offset + 64", [&L](Bytes& b) { put<uint64_t>(b, 56, L.data_offset + 64); }},
      {"data_offset - 64", [&L](Bytes& b) { put<uint64_t>(b, 56, L.data_offset - 64); }},
      {"data_offset past the end", [size](Bytes& b) { put<uint64_t>(b, 56, (size + 64) / 64 * 64); }},
      // ---- metadata
      {"metadata count 2^62", [&L](Bytes& b) { put<uint64_t>(b, L.meta_offset, uint64_t(1) << 62); }},
      {"metadata count + 1", [&L](Bytes& b) { put<uint64_t>(b, L.meta_offset, L.meta.size() + 1); }},
      {"metadata count - 1", [&L](Bytes& b) { put<uint64_t>(b, L.meta_offset, L.meta.size() - 1); }},
      {"metadata count 0", [&L](Bytes& b) { put<uint64_t>(b, L.meta_offset, 0); }},
      {"first key length 0xFFFFFFFF", [&m0](Bytes& b) { put<uint32_t>(b, m0.at, 0xFFFFFFFFu); }},
      {"first key length 2^20", [&m0](Bytes& b) { put<uint32_t>(b, m0.at, 1u << 20); }},
      {"first key length 0", [&m0](Bytes& b) { put<uint32_t>(b, m0.at, 0); }},
      {"first key length + 1", [&m0](Bytes& b) { put<uint32_t>(b, m0.at, uint32_t(m0.key.size() + 1)); }},
      {"string value length 0xFFFFFFFF", [&str_val](Bytes& b) { put<uint32_t>(b, str_val.value_at, 0xFFFFFFFFu); }},
      {"string value length 60 MiB", [&str_val](Bytes& b) { put<uint32_t>(b, str_val.value_at, 60u << 20); }},
      {"string array count 2^62", [&str_arr](Bytes& b) { put<uint64_t>(b, str_arr.value_at, uint64_t(1) << 62); }},
      {"string array count 2^64-1", [&str_arr](Bytes& b) { put<uint64_t>(b, str_arr.value_at, ~uint64_t(0)); }},
      {"string array element length 0xFFFFFFFF",
       [&str_arr](Bytes& b) { put<uint32_t>(b, str_arr.value_at + 8, 0xFFFFFFFFu); }},
      {"f32 array count 2^62", [&f32_arr](Bytes& b) { put<uint64_t>(b, f32_arr.value_at, uint64_t(1) << 62); }},
      {"f32 array count 2^61+1", [&f32_arr](Bytes& b) { put<uint64_t>(b, f32_arr.value_at, (uint64_t(1) << 61) + 1); }},
      {"i32 array count 2^62", [&i32_arr](Bytes& b) { put<uint64_t>(b, i32_arr.value_at, uint64_t(1) << 62); }},
      {"i32 array count + 1",
       [&i32_arr, &fx](Bytes& b) { put<uint64_t>(b, i32_arr.value_at, get<uint64_t>(fx.bytes, i32_arr.value_at) + 1); }},
      {"first tag 0", [&m0](Bytes& b) { put<uint32_t>(b, m0.tag_at, 0); }},
      {"first tag 8", [&m0](Bytes& b) { put<uint32_t>(b, m0.tag_at, 8); }},
      {"first tag 0xFFFFFFFF", [&m0](Bytes& b) { put<uint32_t>(b, m0.tag_at, 0xFFFFFFFFu); }},
      {"int tag on a string value", [&str_val](Bytes& b) { put<uint32_t>(b, str_val.tag_at, kTagInt); }},
      {"bool value 2", [&bool_val](Bytes& b) { b.at(bool_val.value_at) = 2; }},
      {"bool value 255", [&bool_val](Bytes& b) { b.at(bool_val.value_at) = 255; }},
      {"duplicate metadata key",
       [dup_a, dup_b](Bytes& b) { std::memcpy(b.data() + dup_b->at + 4, dup_a->key.data(), dup_a->key.size()); }},
      {"llama.block_count 2^62", [&blocks](Bytes& b) { put<int64_t>(b, blocks.value_at, int64_t(1) << 62); }},
      {"llama.block_count -1", [&blocks](Bytes& b) { put<int64_t>(b, blocks.value_at, -1); }},
      {"llama.block_count 0", [&blocks](Bytes& b) { put<int64_t>(b, blocks.value_at, 0); }},
      {"llama.block_count + 1 (tensors missing)",
       [&blocks, &fx](Bytes& b) { put<int64_t>(b, blocks.value_at, get<int64_t>(fx.bytes, blocks.value_at) + 1); }},
      {"llama.block_count as float tag", [&blocks](Bytes& b) { put<uint32_t>(b, blocks.tag_at, kTagFloat); }},
      {"rms epsilon NaN", [&eps, nan](Bytes& b) { put<double>(b, eps.value_at, nan); }},
      {"rms epsilon 0", [&eps](Bytes& b) { put<double>(b, eps.value_at, 0.0); }},
      // ---- directory
      {"tensor count 2^62", [&L](Bytes& b) { put<uint64_t>(b, L.dir_offset, uint64_t(1) << 62); }},
      {"tensor count 2^64-1", [&L](Bytes& b) { put<uint64_t>(b, L.dir_offset, ~uint64_t(0)); }},
      {"tensor count + 1", [&L](Bytes& b) { put<uint64_t>(b, L.dir_offset, L.dir.size() + 1); }},
      {"tensor count - 1", [&L](Bytes& b) { put<uint64_t>(b, L.dir_offset, L.dir.size() - 1); }},
      {"tensor count 0", [&L](Bytes& b) { put<uint64_t>(b, L.dir_offset, 0); }},
      {"tensor name length 0", [&d0](Bytes& b) { put<uint32_t>(b, d0.at, 0); }},
      {"tensor name length 0xFFFFFFFF", [&d0](Bytes& b) { put<uint32_t>(b, d0.at, 0xFFFFFFFFu); }},
      {"duplicate tensor name",
       [tdup_a, tdup_b](Bytes& b) { std::memcpy(b.data() + tdup_b->at + 4, tdup_a->name.data(), tdup_a->name.size()); }},
      {"ndim 0", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 0); }},
      {"ndim 5", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 5); }},
      {"ndim 9", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 9); }},
      {"ndim 0xFFFFFFFF", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 0xFFFFFFFFu); }},
      {"ndim 1 on a matrix", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 1); }},
      {"ndim 3 on a matrix", [&mat](Bytes& b) { put<uint32_t>(b, mat.ndim_at, 3); }},
      {"dim 0 (rows)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, 0); }},
      {"dim 0 (cols)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at + 8, 0); }},
      {"dim -1 (rows)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, -1); }},
      {"dim -32 (cols)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at + 8, -32); }},
      {"dim 2^60 (rows)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, int64_t(1) << 60); }},
      {"dim 2^60 (cols)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at + 8, int64_t(1) << 60); }},
      {"dims 2^30 x 2^30", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, int64_t(1) << 30), put<int64_t>(b, mat.dims_at + 8, int64_t(1) << 30); }},
      // Issue 22 item 10: a product that wraps to 0 in 64 bits (2^32 x 2^32) is refused too.
      {"dims 2^32 x 2^32 (the product wraps to 0)", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, int64_t(1) << 32), put<int64_t>(b, mat.dims_at + 8, int64_t(1) << 32); }},
      {"dim INT64_MIN", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at, std::numeric_limits<int64_t>::min()); }},
      {"cols not a multiple of the block", [&mat](Bytes& b) { put<int64_t>(b, mat.dims_at + 8, get<int64_t>(b, mat.dims_at + 8) + 1); }},
      {"1-D dim 0", [&vec](Bytes& b) { put<int64_t>(b, vec.dims_at, 0); }},
      {"1-D dim -1", [&vec](Bytes& b) { put<int64_t>(b, vec.dims_at, -1); }},
      {"type id 99", [&mat](Bytes& b) { put<uint32_t>(b, mat.type_at, 99); }},
      {"type id 4 (unassigned)", [&mat](Bytes& b) { put<uint32_t>(b, mat.type_at, 4); }},
      {"type id 0xFFFFFFFF", [&mat](Bytes& b) { put<uint32_t>(b, mat.type_at, 0xFFFFFFFFu); }},
      {"type q8_0 -> f32 (size mismatch)", [&mat](Bytes& b) { put<uint32_t>(b, mat.type_at, kTypeF32); }},
      {"offset past the end (2^62)", [&mat](Bytes& b) { put<uint64_t>(b, mat.offset_at, uint64_t(1) << 62); }},
      {"offset = data size (aligned)", [&last, data_size](Bytes& b) { put<uint64_t>(b, last.offset_at, (data_size + 63) / 64 * 64); }},
      {"last tensor offset + 64 (runs past the end)", [&last](Bytes& b) { put<uint64_t>(b, last.offset_at, last.offset + 64); }},
      {"offset unaligned (+1)", [&mat](Bytes& b) { put<uint64_t>(b, mat.offset_at, mat.offset + 1); }},
      {"offset unaligned (+32)", [&mat](Bytes& b) { put<uint64_t>(b, mat.offset_at, mat.offset + 32); }},
      {"offset 2^64-64", [&mat](Bytes& b) { put<uint64_t>(b, mat.offset_at, ~uint64_t(63)); }},
      {"overlapping tensors",
       [&L](Bytes& b) { put<uint64_t>(b, L.dir[1].offset_at, L.dir[0].offset); }},
      {"nbytes + 1", [&mat](Bytes& b) { put<uint64_t>(b, mat.nbytes_at, mat.nbytes + 1); }},
      {"nbytes - 1", [&mat](Bytes& b) { put<uint64_t>(b, mat.nbytes_at, mat.nbytes - 1); }},
      {"nbytes 0", [&mat](Bytes& b) { put<uint64_t>(b, mat.nbytes_at, 0); }},
      {"nbytes 2^64-1", [&mat](Bytes& b) { put<uint64_t>(b, mat.nbytes_at, ~uint64_t(0)); }},
      {"tensor checksum field changed", [&mat](Bytes& b) { b.at(mat.xxh_at) ^= 1; }, /*checksum_message_ok=*/true},
  };
  const int n = expect_rejected(dir, ms, /*sealed=*/true);
  CHECK(n >= 80);
}

TEST_CASE("badfiles: --no-verify skips only the tensor data checksum", "[badfiles]") {
  const Fixture& fx = fixture();
  const Layout& L = fx.lay;
  const std::string dir = llmq::test::scratch("badfiles_noverify");
  // Harmless data changes: one int8 weight of a q8_0 block (not its scale), one low mantissa
  // byte of an f32 weight.
  const DirEntry& q = L.first_tensor(2, kTypeQ8_0);
  const DirEntry& f = L.first_tensor(1, kTypeF32);
  const std::vector<std::pair<std::string, uint64_t>> flips{{"q8_0 weight of " + q.name, L.data_pos(q) + 2 + 5},
                                                            {"f32 weight of " + f.name, L.data_pos(f) + 4 * 3}};
  for (const auto& [what, pos] : flips) {
    Bytes img = fx.bytes;
    img.at(pos) ^= 0x01;
    const std::string path = dir + "/" + file_name(what);
    write_file(path, img);
    check_rejected(run_model(path), path, "data flipped: " + what);
    const RunResult r = run_model(path, /*no_verify=*/true);
    INFO("data flipped, --no-verify: " << what << "\n" << r.describe());
    CHECK(r.exited);
    CHECK(r.code == 0);
  }
  // --no-verify does not skip the header and index checks.
  Bytes img = fx.bytes;
  img.at(L.meta_offset + L.meta_size / 2) ^= 0x01;
  const std::string path = dir + "/index_flipped.llmq";
  write_file(path, img);
  check_rejected(run_model(path, /*no_verify=*/true), path, "index flipped, --no-verify");
  img = fx.bytes;
  put<uint64_t>(img, L.dir.front().nbytes_at, L.dir.front().nbytes + 1);
  seal(img);
  write_file(path, img);
  check_rejected(run_model(path, /*no_verify=*/true), path, "nbytes wrong (sealed), --no-verify");
}

namespace {

/// How to copy one tensor in rewrite(): drop it, or give it another shape or type (its bytes
/// are the original ones, cut or zero-padded to the new size).
struct TensorEdit {
  bool drop = false;
  std::optional<std::vector<int64_t>> shape;
  std::optional<llmq::DType> type;
};

/// Re-writes good.llmq through LlmqWriter with edited metadata and tensors: a structurally
/// valid file that may not describe a usable model.
void rewrite(const std::string& out, const std::function<void(llmq::Metadata&)>& edit_meta,
             const std::map<std::string, TensorEdit>& edits = {}) {
  auto f = llmq::LlmqFile::open(fixture().good);
  llmq::LlmqWriter w(out, true);
  w.meta = f->meta();
  if (edit_meta) edit_meta(w.meta);
  std::vector<const llmq::TensorInfo*> src;
  for (const auto& t : f->tensors()) {
    auto it = edits.find(t.name);
    const TensorEdit e = it == edits.end() ? TensorEdit{} : it->second;
    if (e.drop) continue;
    w.declare(t.name, e.type.value_or(t.type), e.shape.value_or(t.shape));
    src.push_back(&t);
  }
  w.begin();
  Bytes buf;
  for (size_t i = 0; i < src.size(); ++i) {
    const uint64_t n = w.tensors()[i].nbytes;
    buf.assign(n, 0);
    std::memcpy(buf.data(), f->data(*src[i]), std::min<uint64_t>(n, src[i]->nbytes));
    w.write_tensor(i, buf.data(), n);
  }
  w.finish();
}

struct ModelCase {
  std::string name;
  std::function<void(llmq::Metadata&)> meta = nullptr;
  std::map<std::string, TensorEdit> tensors = {};
};

int expect_rewrites_rejected(const std::string& dir, const std::vector<ModelCase>& cases) {
  for (const ModelCase& c : cases) {
    const std::string path = dir + "/" + file_name(c.name);
    {
      INFO("case: " << c.name);
      REQUIRE_NOTHROW(rewrite(path, c.meta, c.tensors));
    }
    check_rejected(run_model(path), path, c.name);
  }
  return int(cases.size());
}

}  // namespace

TEST_CASE("badfiles: metadata or tensors that do not describe the model exit 2", "[badfiles]") {
  using llmq::DType;
  using llmq::Metadata;
  const std::string dir = llmq::test::scratch("badfiles_model");
  // Control: the unedited rewrite is a valid model, so any rejection below is due to the edit.
  {
    const std::string path = dir + "/unedited.llmq";
    REQUIRE_NOTHROW(rewrite(path, nullptr));
    const RunResult r = run_model(path);
    INFO(r.describe());
    REQUIRE(r.exited);
    REQUIRE(r.code == 0);
  }
  auto drop = [](const char* key) { return [key](Metadata& m) { m.values.erase(key); }; };
  auto set = [](const char* key, llmq::MetaValue v) { return [key, v](Metadata& m) { m.set(key, v); }; };
  const std::vector<ModelCase> cases{
      {"missing general.architecture", drop("general.architecture")},
      {"missing llama.block_count", drop("llama.block_count")},
      {"missing llama.embedding_length", drop("llama.embedding_length")},
      {"missing llama.feed_forward_length", drop("llama.feed_forward_length")},
      {"missing llama.attention.head_count", drop("llama.attention.head_count")},
      {"missing llama.vocab_size", drop("llama.vocab_size")},
      {"missing llama.context_length", drop("llama.context_length")},
      {"missing rms epsilon", drop("llama.attention.layer_norm_rms_epsilon")},
      {"missing tokenizer.tokens", drop("tokenizer.tokens")},
      {"missing tokenizer.model", drop("tokenizer.model")},
      {"architecture gpt2", set("general.architecture", std::string("gpt2"))},
      {"architecture as int", set("general.architecture", int64_t(1))},
      {"embedding_length as string", set("llama.embedding_length", std::string("64"))},
      {"block_count as float", set("llama.block_count", 5.0)},
      {"block_count as bool", set("llama.block_count", true)},
      {"head_count as int array", set("llama.attention.head_count", std::vector<int32_t>{8})},
      {"rms epsilon as string", set("llama.attention.layer_norm_rms_epsilon", std::string("1e-5"))},
      {"rope layout as int", set("llama.rope.layout", int64_t(0))},
      {"rope layout unknown", set("llama.rope.layout", std::string("sideways"))},
      {"tied_embeddings as int", set("llama.tied_embeddings", int64_t(1))},
      {"tokenizer.tokens as string", set("tokenizer.tokens", std::string("a b c"))},
      {"tokenizer.scores as i32 array", set("tokenizer.scores", std::vector<int32_t>(512, 0))},
      {"block_count 0", set("llama.block_count", int64_t(0))},
      {"block_count -1", set("llama.block_count", int64_t(-1))},
      {"block_count 2^40", set("llama.block_count", int64_t(1) << 40)},
      {"block_count 6 (tensors missing)", set("llama.block_count", int64_t(6))},
      {"embedding_length 2^40", set("llama.embedding_length", int64_t(1) << 40)},
      {"embedding_length 128 (shapes differ)", set("llama.embedding_length", int64_t(128))},
      {"head_count 0", set("llama.attention.head_count", int64_t(0))},
      {"head_count_kv 3 (does not divide 8)", set("llama.attention.head_count_kv", int64_t(3))},
      {"head_count_kv 16 (above head_count)", set("llama.attention.head_count_kv", int64_t(16))},
      {"key_length 7 (odd)", set("llama.attention.key_length", int64_t(7))},
      {"vocab_size 513 (tokenizer has 512)", set("llama.vocab_size", int64_t(513))},
      {"vocab_size 0", set("llama.vocab_size", int64_t(0))},
      {"context_length 0", set("llama.context_length", int64_t(0))},
      {"context_length -5", set("llama.context_length", int64_t(-5))},
      {"context_length 2^40", set("llama.context_length", int64_t(1) << 40)},
      {"rms epsilon 0", set("llama.attention.layer_norm_rms_epsilon", 0.0)},
      {"rms epsilon NaN", set("llama.attention.layer_norm_rms_epsilon", std::nan(""))},
      {"rope theta -1", set("llama.rope.freq_base", -1.0)},
      {"rope theta inf (issue 22 item 14: it loaded and made NaNs)", set("llama.rope.freq_base", double(INFINITY))},
      {"tokenizer.scores shorter", [](Metadata& m) { m.set("tokenizer.scores", std::vector<float>(511, 0.0f)); }},
      {"tokenizer.token_type longer", [](Metadata& m) { m.set("tokenizer.token_type", std::vector<int32_t>(513, 1)); }},
      {"tokenizer.tokens one fewer",
       [](Metadata& m) {
         auto t = m.get_string_array("tokenizer.tokens");
         t.pop_back();
         m.set("tokenizer.tokens", t);
       }},
      {"bos id 512 (out of range)", set("tokenizer.bos_token_id", int64_t(512))},
      {"eos id -2", set("tokenizer.eos_token_id", int64_t(-2))},
      {"unknown id 2^40", set("tokenizer.unknown_token_id", int64_t(1) << 40)},
      // Tensor table.
      {"tensor blk.0.attn_q.weight missing", nullptr, {{"blk.0.attn_q.weight", {true, {}, {}}}}},
      {"tensor token_embd.weight missing", nullptr, {{"token_embd.weight", {true, {}, {}}}}},
      {"tensor output_norm.weight missing", nullptr, {{"output_norm.weight", {true, {}, {}}}}},
      {"tensor blk.4.ffn_down.weight missing", nullptr, {{"blk.4.ffn_down.weight", {true, {}, {}}}}},
      {"attn_norm shape [65]", nullptr, {{"blk.0.attn_norm.weight", {false, std::vector<int64_t>{65}, {}}}}},
      {"attn_norm shape [32, 2]", nullptr, {{"blk.0.attn_norm.weight", {false, std::vector<int64_t>{32, 2}, {}}}}},
      {"token_embd shape transposed", nullptr, {{"token_embd.weight", {false, std::vector<int64_t>{64, 512}, {}}}}},
      {"token_embd shape [1, 512, 64]", nullptr, {{"token_embd.weight", {false, std::vector<int64_t>{1, 512, 64}, {}}}}},
      {"attn_q shape [32, 64]", nullptr, {{"blk.0.attn_q.weight", {false, std::vector<int64_t>{32, 64}, {}}}}},
      {"attn_norm stored as f16", nullptr, {{"blk.0.attn_norm.weight", {false, {}, DType::F16}}}},
  };
  const int n = expect_rewrites_rejected(dir, cases);
  CHECK(n >= 50);
}

TEST_CASE("badfiles: inconsistent tokenizer metadata in a .llmq exits 2", "[badfiles]") {
  // The file loads (Model::load accepts it) but the vocabulary it stores is unusable; that is
  // still a bad model file, so exit 2 naming the file (not exit 1 without the path).
  using llmq::Metadata;
  const std::string dir = llmq::test::scratch("badfiles_vocab");
  auto edit_array = [](const char* key, size_t i, auto value) {
    return [key, i, value](Metadata& m) {
      using V = std::vector<decltype(value)>;
      V a = std::get<V>(m.values.at(key));
      a.at(i) = value;
      m.set(key, a);
    };
  };
  // A byte-fallback token ("<0x41>") and a normal token of the tok512 vocabulary.
  const auto good_file = llmq::LlmqFile::open(fixture().good);
  const llmq::Metadata& good_meta = good_file->meta();
  const auto& tokens = good_meta.get_string_array("tokenizer.tokens");
  const auto& types = good_meta.get_i32_array("tokenizer.token_type");
  size_t byte_tok = 0, normal_tok = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!byte_tok && types[i] == 6) byte_tok = i;
    if (!normal_tok && types[i] == 1) normal_tok = i;
  }
  REQUIRE(byte_tok > 0);
  REQUIRE(normal_tok > 0);
  const std::vector<ModelCase> cases{
      {"tokenizer.model gpt2", [](Metadata& m) { m.set("tokenizer.model", std::string("gpt2")); }},
      {"token_type 99", edit_array("tokenizer.token_type", normal_tok, int32_t(99))},
      {"token_type 0", edit_array("tokenizer.token_type", normal_tok, int32_t(0))},
      {"token_type -1", edit_array("tokenizer.token_type", normal_tok, int32_t(-1))},
      {"score NaN", edit_array("tokenizer.scores", normal_tok, std::numeric_limits<float>::quiet_NaN())},
      {"byte token misspelled", edit_array("tokenizer.tokens", byte_tok, std::string("<0xZZ>"))},
      {"normal token typed as byte", edit_array("tokenizer.token_type", normal_tok, int32_t(6))},
      {"empty vocabulary",
       [](Metadata& m) {
         m.set("tokenizer.tokens", std::vector<std::string>{});
         m.set("tokenizer.scores", std::vector<float>{});
         m.set("tokenizer.token_type", std::vector<int32_t>{});
         m.set("tokenizer.bos_token_id", int64_t(-1));
         m.set("tokenizer.eos_token_id", int64_t(-1));
         m.set("tokenizer.unknown_token_id", int64_t(-1));
       }},
  };
  expect_rewrites_rejected(dir, cases);
}

namespace {

/// The checks for a rejected conversion: exit 2, an error line naming `bad`, and neither the
/// output nor a temporary file beside it.
void check_convert_rejected(const RunResult& r, const std::string& bad, const std::string& out, const std::string& label) {
  check_rejected(r, bad, label);
  INFO("case: " << label);
  CHECK_FALSE(fs::exists(out));
  CHECK(tmp_siblings(out).empty());
}

Bytes random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = uint8_t(rng());
  return b;
}

}  // namespace

TEST_CASE("badfiles: llmq-convert rejects bad llama2.c checkpoints and tokenizers", "[badfiles]") {
  const std::string dir = llmq::test::scratch("badfiles_convert");
  const Bytes ckpt = read_file(checkpoint_path());
  const Bytes tok = read_file(tokenizer_path());
  const std::string good_tok = tokenizer_path();
  REQUIRE(ckpt.size() > 1000);
  int n = 0;
  auto try_checkpoint = [&](const std::string& label, const Bytes& img) {
    const std::string in = dir + "/" + file_name(label, ".bin");
    const std::string out = dir + "/" + file_name(label, ".llmq");
    write_file(in, img);
    check_convert_rejected(run_convert(in, good_tok, out), in, out, "checkpoint: " + label);
    ++n;
  };
  auto try_tokenizer = [&](const std::string& label, const Bytes& img) {
    const std::string in = dir + "/tok_" + file_name(label, ".bin");
    const std::string out = dir + "/tok_" + file_name(label, ".llmq");
    write_file(in, img);
    check_convert_rejected(run_convert(checkpoint_path(), in, out), in, out, "tokenizer: " + label);
    ++n;
  };

  // Truncated and extended checkpoints.
  for (size_t cut : {size_t(0), size_t(1), size_t(27), size_t(28), size_t(29), size_t(1000), ckpt.size() / 2,
                     ckpt.size() - 4, ckpt.size() - 1}) {
    try_checkpoint("truncated at " + std::to_string(cut), Bytes(ckpt.begin(), ckpt.begin() + long(cut)));
  }
  {
    Bytes img = ckpt;
    img.resize(img.size() + 4, 0);
    try_checkpoint("4 bytes appended", img);
  }
  // Absurd header values (legacy header: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
  // vocab_size, seq_len as int32).
  struct HeaderEdit {
    const char* label;
    std::vector<std::pair<int, int32_t>> fields;  // field index -> value
  };
  const std::vector<HeaderEdit> headers{
      {"dim 2^30", {{0, 1 << 30}}},
      {"dim 0", {{0, 0}}},
      {"dim -64", {{0, -64}}},
      {"dim 65 (not a multiple of n_heads)", {{0, 65}}},
      {"hidden_dim 0", {{1, 0}}},
      {"hidden_dim -1", {{1, -1}}},
      {"n_layers -1", {{2, -1}}},
      {"n_layers 0", {{2, 0}}},
      {"n_layers 2^20", {{2, 1 << 20}}},
      {"n_layers 6 (size mismatch)", {{2, 6}}},
      {"n_heads 0", {{3, 0}}},
      {"n_heads -8", {{3, -8}}},
      {"n_heads 3", {{3, 3}}},
      {"n_kv_heads 3 (does not divide n_heads)", {{4, 3}}},
      {"n_kv_heads 0", {{4, 0}}},
      {"n_kv_heads 16 (above n_heads)", {{4, 16}}},
      {"vocab 0", {{5, 0}}},
      {"vocab INT32_MIN", {{5, std::numeric_limits<int32_t>::min()}}},
      {"vocab -512 (separate classifier, size mismatch)", {{5, -512}}},
      {"seq_len 0", {{6, 0}}},
      {"seq_len -1", {{6, -1}}},
      {"seq_len 2^30", {{6, 1 << 30}}},
      {"all INT32_MAX", {{0, INT32_MAX}, {1, INT32_MAX}, {2, INT32_MAX}, {3, INT32_MAX}, {4, INT32_MAX}, {5, INT32_MAX}, {6, INT32_MAX}}},
      {"huge but valid dims (absurd size)",
       {{0, 1 << 24}, {1, 1 << 24}, {2, 1024}, {3, 4096}, {4, 4096}, {5, 1 << 24}, {6, 1 << 24}}},
  };
  for (const HeaderEdit& h : headers) {
    Bytes img = ckpt;
    for (const auto& [field, value] : h.fields) put<int32_t>(img, uint64_t(field) * 4, value);
    try_checkpoint(h.label, img);
  }
  // Versioned ("ak42") headers.
  {
    Bytes img(256, 0);
    put<uint32_t>(img, 0, 0x616b3432u);
    put<int32_t>(img, 4, 7);
    try_checkpoint("ak42 version 7", img);
    img.resize(100);
    put<int32_t>(img, 4, 1);
    try_checkpoint("ak42 header truncated", img);
    img.assign(256, 0);
    put<uint32_t>(img, 0, 0x616b3432u);
    put<int32_t>(img, 4, 2);
    std::memcpy(img.data() + 8, ckpt.data(), 28);
    put<int32_t>(img, 37, 0);
    try_checkpoint("ak42 v2 group 0", img);
    put<int32_t>(img, 37, 64);
    try_checkpoint("ak42 v2 header only", img);
    img[36] = 7;
    try_checkpoint("ak42 shared flag 7", img);
  }
  try_checkpoint("empty", {});
  try_checkpoint("random 1000 bytes", random_bytes(1000, 1));
  try_checkpoint("random, same size", random_bytes(ckpt.size(), 2));

  // Tokenizer files.
  for (size_t cut : {size_t(0), size_t(2), size_t(4), size_t(10), size_t(100), tok.size() / 2, tok.size() - 1})
    try_tokenizer("truncated at " + std::to_string(cut), Bytes(tok.begin(), tok.begin() + long(cut)));
  {
    Bytes img = tok;
    img.resize(img.size() + 9, 0);
    try_tokenizer("9 bytes appended", img);
    img = tok;
    put<int32_t>(img, 0, 0);
    try_tokenizer("max_token_length 0", img);
    img = tok;
    put<int32_t>(img, 4 + 4, -1);  // first token's length
    try_tokenizer("first token length -1", img);
    img = tok;
    put<int32_t>(img, 4 + 4, 0x7FFFFFFF);
    try_tokenizer("first token length INT32_MAX", img);
    try_tokenizer("random 6000 bytes", random_bytes(6000, 3));
  }
  // A missing tokenizer and a missing checkpoint.
  {
    const std::string out = dir + "/missing.llmq";
    const std::string no_tok = dir + "/no-such-tokenizer.bin";
    check_convert_rejected(run_convert(checkpoint_path(), no_tok, out), no_tok, out, "missing tokenizer");
    const std::string no_ckpt = dir + "/no-such-checkpoint.bin";
    check_convert_rejected(run_convert(no_ckpt, good_tok, out), no_ckpt, out, "missing checkpoint");
    n += 2;
  }
  CHECK(n >= 50);
}

TEST_CASE("badfiles: llmq-convert cleans up when a conversion fails midway", "[badfiles]") {
  // A NaN weight is found only while tensors are being written, after the temporary output
  // file was created: the tool must fail cleanly and remove it.
  const std::string dir = llmq::test::scratch("badfiles_convert_nan");
  Bytes img = read_file(checkpoint_path());
  put<uint32_t>(img, 28 + 4 * 100, 0x7FC00000u);  // legacy layout: token_embd starts at 28
  const std::string in = dir + "/nan.bin", out = dir + "/nan.llmq";
  write_file(in, img);
  const RunResult r = run_convert(in, tokenizer_path(), out);
  INFO(r.describe());
  CHECK(r.exited);
  CHECK(r.code != 0);
  CHECK(contains(r.err, "error"));
  CHECK_FALSE(fs::exists(out));
  CHECK(tmp_siblings(out).empty());
}

TEST_CASE("badfiles: llmq-convert overwrites an existing output only with --force", "[badfiles]") {
  const std::string dir = llmq::test::scratch("badfiles_force");
  const std::string out = dir + "/model.llmq";
  const Bytes old{'n', 'o', 't', ' ', 'a', ' ', 'm', 'o', 'd', 'e', 'l', '\n'};
  write_file(out, old);
  {
    const RunResult r = run_convert(checkpoint_path(), tokenizer_path(), out);
    INFO(r.describe());
    CHECK(r.exited);
    CHECK(r.code != 0);
    CHECK(has_error_line(r.err, out));
    CHECK(read_file(out) == old);
    CHECK(tmp_siblings(out).empty());
  }
  {
    const RunResult r = run_convert(checkpoint_path(), tokenizer_path(), out, /*force=*/true);
    INFO(r.describe());
    CHECK(r.exited);
    CHECK(r.code == 0);
    CHECK(read_file(out) != old);
    CHECK(tmp_siblings(out).empty());
    const RunResult run = run_model(out);
    INFO(run.describe());
    CHECK(run.exited);
    CHECK(run.code == 0);
  }
  // An output folder that does not exist: exit 2 naming the output.
  const std::string nowhere = dir + "/no/such/folder/model.llmq";
  check_rejected(run_convert(checkpoint_path(), tokenizer_path(), nowhere), nowhere, "output folder missing");
}

TEST_CASE("badfiles: random byte mutations end in exit 0 or 2, never a crash or hang", "[badfiles]") {
  const Fixture& fx = fixture();
  const Layout& L = fx.lay;
  const std::string dir = llmq::test::scratch("badfiles_sweep");
  const uint64_t size = fx.bytes.size();
  // Bytes covered by a checksum: the header, the index, every tensor's data. A raw change
  // anywhere else (alignment padding) is harmless.
  std::vector<bool> covered(size, false);
  for (uint64_t i = 0; i < L.dir_end(); ++i) covered[i] = true;
  for (const auto& d : L.dir)
    for (uint64_t i = 0; i < d.nbytes; ++i) covered[L.data_pos(d) + i] = true;

  std::mt19937_64 rng(20240611);
  auto uniform = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi - 1)(rng); };
  int exit0 = 0, exit2 = 0;
  const std::string path = dir + "/mutant.llmq";
  for (int i = 0; i < 200; ++i) {
    // Where to aim: the header, the metadata, the directory, or anywhere (mostly data).
    uint64_t lo = 0, hi = size;
    switch (i % 4) {
      case 0: lo = 0, hi = 80; break;
      case 1: lo = L.meta_offset, hi = L.dir_offset; break;
      case 2: lo = L.dir_offset, hi = L.dir_end(); break;
      default: break;
    }
    const bool sealed = (i / 4) % 2 == 1;
    Bytes img = fx.bytes;
    const int changes = int(uniform(1, 9));
    for (int k = 0; k < changes; ++k) {
      const uint64_t pos = uniform(lo, hi);
      img[pos] ^= uint8_t(uniform(1, 256));  // never 0: the byte changes
    }
    std::string what;
    bool touched_covered = false;
    for (uint64_t pos = lo; pos < hi; ++pos)
      if (img[pos] != fx.bytes[pos]) {
        touched_covered |= covered[pos];
        what += ' ';
        what += std::to_string(pos);
      }
    if (what.empty()) continue;  // the changes cancelled out
    if (sealed) seal(img);
    write_file(path, img);
    const RunResult r = run_model(path, false, 20.0);
    INFO("mutant " << i << (sealed ? " (checksums fixed)" : " (raw)") << ", bytes changed at" << what);
    INFO(r.describe());
    CHECK_FALSE(r.timed_out);
    CHECK(r.exited);  // not a signal
    if (!sealed && touched_covered) {
      CHECK(r.code == 2);
    } else {
      CHECK((r.code == 0 || r.code == 2));
    }
    if (r.code == 2) CHECK(has_error_line(r.err, path));
    if (r.code == 0) ++exit0;
    if (r.code == 2) ++exit2;
    if (r.code != 0 && r.code != 2) {
      // Keep the failing mutant for inspection.
      fs::copy_file(path, dir + "/failed_mutant_" + std::to_string(i) + ".llmq", fs::copy_options::overwrite_existing);
    }
  }
  CHECK(exit2 > 100);
}

// Issue 22 item 6: a FIFO (or other non-regular file) handed to any tool as a model, tokenizer,
// text or source is refused at once (exit 2, naming it) instead of blocking in open() until a
// writer comes — which left every tool, and the server, hanging (and deaf to SIGTERM). Nothing
// ever writes to these FIFOs: a tool that opened one for reading would wait forever.
TEST_CASE("badfiles: a FIFO given as any input is refused at once, never waited on", "[badfiles]") {
  const std::string dir = llmq::test::scratch("badfiles_fifo");
  const std::string fifo = dir + "/model.fifo", out = dir + "/out.llmq", model = llmq::test::stories("f32");
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  auto bin = [](const char* t) { return llmq::test::bin(t); };
  const std::vector<std::pair<const char*, std::vector<std::string>>> runs = {
      {"llmq-run model", {bin("llmq-run"), "-m", fifo, "-p", "x", "-n", "1"}},
      {"llmq-run perplexity text", {bin("llmq-run"), "-m", model, "--perplexity", fifo, "--ctx", "64"}},
      {"llmq-info", {bin("llmq-info"), fifo}},
      {"llmq-convert source", {bin("llmq-convert"), fifo, "-o", out}},
      {"llmq-convert tokenizer", {bin("llmq-convert"), checkpoint_path(), "--tokenizer", fifo, "-o", out}},
      {"llmq-tokenize", {bin("llmq-tokenize"), fifo, "hello"}},
      {"llmq-tokenize text", {bin("llmq-tokenize"), model, "-f", fifo}},
      {"llmq-mem", {bin("llmq-mem"), "infer", "-m", fifo}},
      {"llmq-server", {bin("llmq-server"), "-m", fifo, "--port", "0"}},
  };
  for (const auto& [what, argv] : runs) {
    const RunResult r = run_tool(argv, 10.0);
    INFO(what << ": " << r.describe());
    CHECK_FALSE(r.timed_out);
    CHECK(r.exited);
    CHECK(r.code != 0);
    CHECK(r.err.find(fifo) != std::string::npos);
    CHECK(r.err.find("not a regular file") != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists(out));
}

// Issue 22 item 11: two converters writing the same new target at once: exactly one succeeds,
// the other exits 2 saying the target exists (the file is created exclusively; a rename let the
// last writer win silently), and no temporary file is left. Five rounds.
TEST_CASE("badfiles: two converters racing for one target: one wins, the other is told", "[badfiles]") {
  const std::string dir = llmq::test::scratch("badfiles_race");
  for (int round = 0; round < 5; ++round) {
    const std::string out = dir + "/model" + std::to_string(round) + ".llmq";
    auto a = std::async(std::launch::async, [&] { return run_convert(checkpoint_path(), tokenizer_path(), out); });
    auto b = std::async(std::launch::async, [&] { return run_convert(checkpoint_path(), tokenizer_path(), out); });
    const RunResult ra = a.get(), rb = b.get();
    INFO("round " << round << "\nfirst: " << ra.describe() << "\nsecond: " << rb.describe());
    CHECK((ra.code == 0) != (rb.code == 0));  // exactly one wins
    const RunResult& lost = ra.code == 0 ? rb : ra;
    CHECK(lost.exited);
    CHECK(lost.code == 2);
    CHECK(lost.err.find("exists") != std::string::npos);
    CHECK(tmp_siblings(out).empty());
    const RunResult run = run_model(out);
    INFO(run.describe());
    CHECK(run.code == 0);
  }
}

// Issue 22 item 5: a model file truncated by another program while a tool has it mapped: the
// next read past its new end ends the tool with exit 2 and a message naming the file (before:
// killed by SIGBUS). llmq-run loads, the file is cut to 0 bytes, then a prompt arrives: the
// embedding rows it reads are gone.
TEST_CASE("badfiles: a model file that shrinks while in use ends the tool with exit 2, not SIGBUS", "[badfiles]") {
  const std::string dir = llmq::test::scratch("badfiles_shrink");
  const std::string model = dir + "/model.llmq";
  std::filesystem::copy_file(llmq::test::stories("f32"), model);
  const std::string cmd = "(sleep 1.5; truncate -s 0 " + model + "; echo 'Once upon a time'; sleep 2) | " + llmq::test::bin("llmq-run") +
                          " -m " + model + " -n 16 --no-verify >/dev/null 2>" + dir + "/err.txt";
  const int rc = llmq::test::run(cmd);
  const Bytes eb = read_file(dir + "/err.txt");
  const std::string err(eb.begin(), eb.end());
  INFO("exit " << rc << ", stderr: " << err);
  CHECK(rc == 2);
  CHECK(err.find(model) != std::string::npos);
  CHECK(err.find("shrank") != std::string::npos);
}

// Issue 22 item 9 (its last part): running out of memory is exit 2 with a message, like every
// other input the machine cannot take (a KV cache of 16 M positions under a 4 GiB cap).
TEST_CASE("badfiles: out of memory exits 2 with a message", "[badfiles]") {
  const RunResult r = run_tool({llmq::test::bin("llmq-run"), "-m", llmq::test::stories("f32"), "--ctx", "16000000", "-p", "x", "-n", "1"});
  INFO(r.describe());
  CHECK(r.exited);
  CHECK(r.code == 2);
  CHECK(r.err.find("out of memory") != std::string::npos);
}
