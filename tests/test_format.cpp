// The `.llmq` container: writer/reader round trip, alignment, checksums, atomic writes
// (no overwrite without --force, nothing left behind on failure, disk full included).
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <random>

#include "base/error.h"
#include "formats/llmq_file.h"
#include "test_util.h"

using namespace llmq;
namespace fs = std::filesystem;

namespace {

// Files in `dir` other than `keep` (temporary files left behind would show up here).
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("metadata of every type and tensors round-trip through a file", "[format]") {
  const std::string dir = test::scratch("format-roundtrip"), path = dir + "/a.llmq";
  std::mt19937 rng(std::random_device{}());
  std::vector<float> t0(3 * 64), t1(5);
  for (auto& v : t0) v = float(rng() % 1000) / 7.0f;
  for (auto& v : t1) v = float(rng() % 1000) / 3.0f;
  std::vector<uint8_t> q(row_bytes(DType::Q8_0, 64) * 3);
  for (int r = 0; r < 3; ++r) quantize_row(DType::Q8_0, t0.data() + r * 64, q.data() + r * 68, 64);
  {
    LlmqWriter w(path, false);
    w.meta.set("b", true);
    w.meta.set("i", int64_t(-1234567890123));
    w.meta.set("f", 3.25);
    w.meta.set("s", std::string("h\xc3\xa9llo\0x", 8));
    w.meta.set("ai", std::vector<int32_t>{1, -2, 3});
    w.meta.set("af", std::vector<float>{0.5f, -1.5f});
    w.meta.set("as", std::vector<std::string>{"", "▁a", std::string("\xff\x00", 2)});
    w.declare("x.weight", DType::Q8_0, {3, 64});
    w.declare("y", DType::F32, {5});
    w.begin();
    w.write_tensor(0, q.data(), q.size());
    w.write_tensor(1, t1.data(), t1.size() * 4);
    w.finish();
  }
  CHECK(listing(dir) == std::vector<std::string>{"a.llmq"});
  auto f = LlmqFile::open(path);
  const Metadata& m = f->meta();
  CHECK(m.get_bool("b", false));
  CHECK(m.get_int("i") == -1234567890123);
  CHECK(m.get_float("f") == 3.25);
  CHECK(m.get_float("i") == -1234567890123.0);
  CHECK(m.get_string("s") == std::string("h\xc3\xa9llo\0x", 8));
  CHECK(m.get_i32_array("ai") == std::vector<int32_t>{1, -2, 3});
  CHECK(m.get_f32_array("af") == std::vector<float>{0.5f, -1.5f});
  CHECK(m.get_string_array("as")[2] == std::string("\xff\x00", 2));
  CHECK_THROWS_AS(m.get_int("s"), MetadataError);
  CHECK_THROWS_AS(m.get_string("missing"), MetadataError);
  REQUIRE(f->tensors().size() == 2);
  const TensorInfo* x = f->find("x.weight");
  REQUIRE(x);
  CHECK(x->shape == std::vector<int64_t>{3, 64});
  CHECK(x->nbytes == q.size());
  CHECK(reinterpret_cast<uintptr_t>(f->data(*x)) % 64 == 0);
  CHECK(std::memcmp(f->data(*x), q.data(), q.size()) == 0);
  const TensorInfo* y = f->find("y");
  REQUIRE(y);
  CHECK(reinterpret_cast<uintptr_t>(f->data(*y)) % 64 == 0);
  CHECK(std::memcmp(f->data(*y), t1.data(), 20) == 0);
  CHECK(f->find("nope") == nullptr);
}

TEST_CASE("the writer refuses to overwrite, and leaves nothing behind when abandoned", "[format]") {
  const std::string dir = test::scratch("format-atomic"), path = dir + "/m.llmq";
  { std::ofstream(path) << "precious"; }
  CHECK_THROWS_AS(LlmqWriter(path, false), FileError);
  {
    LlmqWriter w(path, true);
    w.declare("t", DType::F32, {4});
    w.begin();
    // destroyed before finish(): as if the conversion failed half-way
  }
  CHECK(listing(dir) == std::vector<std::string>{"m.llmq"});
  std::ifstream in(path);
  std::string s;
  in >> s;
  CHECK(s == "precious");
  LlmqWriter w(path, true);
  w.declare("t", DType::F32, {4});
  w.begin();
  const float v[4] = {1, 2, 3, 4};
  CHECK_THROWS_AS(w.write_tensor(0, v, 12), UsageError);  // wrong size
  w.write_tensor(0, v, 16);
  w.finish();
  CHECK(LlmqFile::open(path)->tensors().size() == 1);
  CHECK(listing(dir) == std::vector<std::string>{"m.llmq"});
}

TEST_CASE("disk full during conversion: a clear error, exit 2, no output and no temporary file", "[format][tools]") {
  const std::string dir = test::scratch("format-diskfull"), out = dir + "/big.llmq";
  // RLIMIT_FSIZE (ulimit -f, 1 KiB blocks) makes writes past 200 KiB fail with EFBIG; SIGXFSZ ignored.
  const std::string cmd = "bash -c \"trap '' XFSZ; ulimit -f 200; exec " + test::bin("llmq-convert") + " " +
                          test::shared("models/stories260K/stories260K.bin") + " --tokenizer " +
                          test::shared("models/stories260K/tok512.bin") + " -o " + out + " 2> " + dir + "/err.txt\"";
  CHECK(test::run(cmd) == 2);
  std::ifstream in(dir + "/err.txt");
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK_THAT(err, Catch::Contains("write failed") && Catch::Contains("big.llmq"));
  CHECK(listing(dir) == std::vector<std::string>{"err.txt"});
}

TEST_CASE("tensor size arithmetic rejects absurd shapes", "[format]") {
  CHECK(tensor_nbytes(DType::F16, {3, 5}) == 30);
  CHECK(tensor_nbytes(DType::Q4_0, {2, 64}) == 72);
  CHECK_THROWS_AS(tensor_nbytes(DType::F32, {}), UsageError);
  CHECK_THROWS_AS(tensor_nbytes(DType::F32, {0, 4}), UsageError);
  CHECK_THROWS_AS(tensor_nbytes(DType::F32, {int64_t(1) << 40, int64_t(1) << 40}), UsageError);
  CHECK_THROWS_AS(tensor_nbytes(DType::Q8_0, {4, 31}), UsageError);
  CHECK_THROWS_AS(tensor_nbytes(DType::F32, {1, 1, 1, 1, 1}), UsageError);
}
