// Every architecture read from a Hugging Face directory against transformers itself: tiny
// random-weight checkpoints written by transformers' own model classes (llama with Llama 3.1
// RoPE scaling, mistral with a sliding window, qwen2, qwen3, gemma3 with sliding and global
// layers, phi3 with fused projections, a window and LongRoPE's short and long factors) and their
// float32 logits (tests/fixtures/transformers, made by scripts/make_arch_fixtures.py; the weights
// come from a fixed generator, scripts/arch_fixture_files.py, run here). Each is
// converted by llmq-convert to F32, once with config.json as transformers 5 writes it
// (rope_parameters) and once in the older form most Hub checkpoints use (rope_theta,
// rope_scaling); llmq's logits must equal transformers' to 1e-4 relative (max |diff| / max |ref|).
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/threadpool.h"
#include "engine/model.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path fixtures() { return fs::path(__FILE__).parent_path() / "fixtures" / "transformers"; }

json read_json(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE(in.good());
  return json::parse(in);
}

// Writes the fixture's weights (not committed: scripts/arch_fixture_files.py makes them from a
// fixed generator) into dir: model.safetensors, and <name>.gguf where the fixture has one.
void write_weights(const std::string& name, const std::string& dir) {
  const fs::path script = fs::path(__FILE__).parent_path().parent_path() / "scripts" / "arch_fixture_files.py";
  const int rc = llmq::test::run("python3 " + script.string() + " " + (fixtures() / name).string() + " " + dir + " " +
                                 llmq::test::shared("models/stories260K/tok512.bin"));
  REQUIRE(rc == 0);
}

// The fixture `name` converted to F32 with the given config file as config.json; the .llmq path.
std::string convert(const std::string& name, const std::string& config_file) {
  const std::string dir = llmq::test::scratch("hf_arch_" + name + "_" + config_file);
  fs::create_directories(dir);
  write_weights(name, dir);
  fs::copy_file(fixtures() / name / config_file, dir + "/config.json", fs::copy_options::overwrite_existing);
  const std::string out = dir + "/m.llmq", log = dir + "/convert.log";
  const int rc = llmq::test::run(llmq::test::bin("llmq-convert") + " " + dir + " -o " + out + " --type f32 --no-progress -f --tokenizer " +
                                 llmq::test::shared("models/stories260K/tok512.bin") + " >" + log + " 2>&1");
  if (rc != 0) {
    std::ifstream in(log);
    FAIL("llmq-convert failed for " << name << "/" << config_file << ":\n" << std::string(std::istreambuf_iterator<char>(in), {}));
  }
  return out;
}

struct Diff {
  double max_abs = 0, max_ref = 0;
  double rel() const { return max_abs / max_ref; }
};

// llmq's logits of every case of the fixture (one prefill each, run with the case's context) vs
// transformers'.
Diff compare(const std::string& llmq_path, const json& expected, const std::string& arch) {
  Diff d;
  for (const json& k : expected["cases"]) {
    const auto ids = k["ids"].get<std::vector<int32_t>>();
    const int64_t ctx = k["ctx"].get<int64_t>();
    auto m = llmq::Model::load(llmq_path, true, true, 0, 1, ctx);
    CHECK(m->config.arch == arch);
    llmq::ThreadPool pool(2);
    llmq::Session s(*m, pool, ctx);
    const float* l = s.forward(ids.data(), int64_t(ids.size()), /*all_logits=*/true);
    const int64_t V = m->config.vocab_size;
    const auto rows = k["rows"].get<std::vector<int64_t>>();
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t v = 0; v < V; ++v) {
        const double ref = k["logits"][r][size_t(v)].get<double>();
        d.max_abs = std::max(d.max_abs, std::fabs(double(l[rows[r] * V + v]) - ref));
        d.max_ref = std::max(d.max_ref, std::fabs(ref));
      }
  }
  return d;
}

}  // namespace

TEST_CASE("transformers: every architecture's F32 logits equal transformers' to 1e-4 relative", "[hf][arch]") {
  const std::vector<std::pair<std::string, std::string>> archs = {
      {"llama", "llama"}, {"mistral", "mistral"}, {"qwen2", "qwen2"}, {"qwen3", "qwen3"}, {"gemma3", "gemma3"}, {"phi3", "phi3"}};
  for (const auto& [name, arch] : archs) {
    const json expected = read_json(fixtures() / name / "expected.json");
    for (const char* config : {"config.json", "config_legacy.json"}) {
      INFO(name << " " << config << " (transformers " << expected["transformers"].get<std::string>() << ")");
      const Diff d = compare(convert(name, config), expected, arch);
      WARN(name << " " << config << ": max |diff| " << d.max_abs << " of max |logit| " << d.max_ref << " = " << d.rel());
      CHECK(d.rel() < 1e-4);
    }
  }
}

TEST_CASE("transformers: GGUFs written as llama.cpp's converter writes them (llama 3.1 rope_freqs and permuted q/k, qwen3, phi3 fused with LongRoPE tensors) give the same logits", "[gguf][arch]") {
  for (const std::string name : {"llama", "qwen3", "phi3"}) {
    const std::string dir = llmq::test::scratch("gguf_arch_" + name), out = dir + "/m.llmq";
    fs::create_directories(dir);
    write_weights(name, dir);
    const int rc = llmq::test::run(llmq::test::bin("llmq-convert") + " " + dir + "/" + name + ".gguf -o " + out +
                                   " --no-progress -f >" + dir + "/convert.log 2>&1");
    REQUIRE(rc == 0);
    const Diff d = compare(out, read_json(fixtures() / name / "expected.json"), name);
    WARN(name << " GGUF: max |diff| " << d.max_abs << " of max |logit| " << d.max_ref << " = " << d.rel());
    CHECK(d.rel() < 1e-4);
  }
}

TEST_CASE("transformers: LongRoPE picks its long factors only beyond the original context", "[hf][arch]") {
  const std::string path = convert("phi3", "config.json");
  auto short_run = llmq::Model::load(path, true, true, 0, 1, 64);
  auto long_run = llmq::Model::load(path, true, true, 0, 1, 256);
  CHECK(short_run->config.rope_scaling == llmq::RopeScaling::LongRope);
  CHECK_FALSE(short_run->config.rope_use_long);
  CHECK(long_run->config.rope_use_long);
  CHECK(short_run->config.rope_freqs(0) != long_run->config.rope_freqs(0));
  // Any context past the original takes the long factors: the long case again at 80 positions.
  json expected = read_json(fixtures() / "phi3" / "expected.json");
  json tight = expected;
  tight["cases"] = json::array({expected["cases"][1]});
  tight["cases"][0]["ctx"] = 80;
  CHECK(compare(path, tight, "phi3").rel() < 1e-4);
}
