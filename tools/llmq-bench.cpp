// llmq-bench: prefill and decode speed of a `.llmq` model, as one JSON object on stdout.
//
//   llmq-bench -m model.llmq [-p 512] [-n 128] [-t N] [-r 3]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/cpu_ops.h"
#include "engine/model.h"
#include "formats/error.h"
#include "tools/cli_common.h"

using namespace llmq;

int main(int argc, char** argv) {
  CLI::App app{"llmq-bench: measure prefill and decode tok/s (JSON output)"};
  std::string model_path;
  int64_t n_prompt = 512, n_gen = 128;
  int threads = 0, reps = 3;
  bool no_verify = false;
  app.add_option("-m,--model", model_path, "model file (.llmq)")->required();
  app.add_option("-p,--prompt-tokens", n_prompt, "prompt length for the prefill measurement");
  app.add_option("-n,--gen-tokens", n_gen, "tokens decoded one at a time after the prompt");
  app.add_option("-t,--threads", threads, "threads (default: all cores)");
  app.add_option("-r,--repetitions", reps, "repetitions; the best is reported");
  app.add_flag("--no-verify", no_verify, "skip checksum verification at load");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-bench", [&] {
    if (n_prompt < 1 || n_gen < 1 || reps < 1) throw UsageError("-p, -n and -r must be positive");
    auto model = Model::load(model_path, !no_verify);
    ThreadPool pool(threads);
    Session s(*model, pool, n_prompt + n_gen, n_prompt);
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> pick(0, int32_t(model->config.vocab_size - 1));
    std::vector<int32_t> prompt(static_cast<size_t>(n_prompt));
    for (auto& t : prompt) t = pick(rng);

    using clock = std::chrono::steady_clock;
    double best_prefill = 1e30, best_decode = 1e30;
    for (int r = 0; r < reps; ++r) {
      s.reset();
      auto t0 = clock::now();
      s.forward(prompt.data(), n_prompt);
      best_prefill = std::min(best_prefill, std::chrono::duration<double>(clock::now() - t0).count());
      t0 = clock::now();
      for (int64_t i = 0; i < n_gen; ++i) {
        const int32_t tok = prompt[size_t(i % n_prompt)];
        s.forward(&tok, 1);
      }
      best_decode = std::min(best_decode, std::chrono::duration<double>(clock::now() - t0).count());
    }
    nlohmann::json j;
    j["model"] = model_path;
    j["type"] = model->weight_type();
    j["weight_bytes"] = model->weight_bytes();
    j["threads"] = pool.size();
    j["device"] = "cpu";
    j["cpu_kernels"] = cpu_kernels_name();  // scalar | avx2 | avx512 (LLMQ_CPU overrides)
    j["prompt_tokens"] = n_prompt;
    j["gen_tokens"] = n_gen;
    j["prefill_tok_s"] = double(n_prompt) / best_prefill;
    j["decode_tok_s"] = double(n_gen) / best_decode;
    j["peak_rss_bytes"] = cli::peak_rss_bytes();
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  });
}
