// llmq-bench: prefill and decode speed of a `.llmq` model, as one JSON object on stdout, with
// the machine's streaming-read bandwidth measured on the same threads: decode as a fraction of
// it (bytes each token must read / time), and prefill in GFLOP/s (engine/roofline.h).
//
//   llmq-bench -m model.llmq [-p 512] [-n 128] [-t N] [-r 3] [--bandwidth-mib 512]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <fstream>
#include <random>
#include <string>

#include "engine/cpu_ops.h"
#include "engine/model.h"
#include "engine/roofline.h"
#include "formats/error.h"
#include "tools/cli_common.h"

using namespace llmq;

namespace {

// The processor's name from /proc/cpuinfo ("" where there is none).
std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-bench: measure prefill and decode tok/s (JSON output)"};
  std::string model_path;
  int64_t n_prompt = 512, n_gen = 128;
  int threads = 0, reps = 3;
  bool no_verify = false;
  int64_t bandwidth_mib = 512;
  app.add_option("-m,--model", model_path, "model file (.llmq)")->required();
  app.add_option("-p,--prompt-tokens", n_prompt, "prompt length for the prefill measurement");
  app.add_option("-n,--gen-tokens", n_gen, "tokens decoded one at a time after the prompt");
  app.add_option("-t,--threads", threads, "threads (default: all cores)");
  app.add_option("-r,--repetitions", reps, "repetitions; the best is reported");
  app.add_flag("--no-verify", no_verify, "skip checksum verification at load");
  app.add_option("--bandwidth-mib", bandwidth_mib,
                 "buffer for the read-bandwidth measurement, MiB (0: skip it)");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-bench", [&] {
    if (n_prompt < 1 || n_gen < 1 || reps < 1) throw UsageError("-p, -n and -r must be positive");
    if (bandwidth_mib < 0 || bandwidth_mib > (int64_t(1) << 20)) throw UsageError("--bandwidth-mib out of range");
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
    // What the runs had to read and compute (engine/roofline.h).
    const ForwardCost prefill = forward_cost(*model, n_prompt, 0);
    ForwardCost decode;
    for (int64_t i = 0; i < n_gen; ++i) {
      const ForwardCost c = forward_cost(*model, 1, n_prompt + i);
      decode.weight_bytes += c.weight_bytes;
      decode.kv_bytes += c.kv_bytes;
      decode.flops += c.flops;
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
    j["cpu_model"] = cpu_model_name();
    j["peak_rss_bytes"] = cli::peak_rss_bytes();  // before the bandwidth buffer below
    j["prefill_gflop_s"] = prefill.flops / best_prefill / 1e9;
    j["decode_bytes_per_token"] = decode.bytes() / double(n_gen);
    j["decode_gb_s"] = decode.bytes() / best_decode / 1e9;
    if (bandwidth_mib > 0) {
      // Measured after the model runs, with the same pool: the machine's streaming-read rate.
      const ReadBandwidth bw = measure_read_bandwidth(pool, uint64_t(bandwidth_mib) << 20);
      const auto& t = model->file->tensors();
      const uint8_t* w0 = model->file->data(t.front());
      const uint8_t* w1 = model->file->data(t.back()) + t.back().nbytes;
      const double mapped = measure_read_bandwidth(pool, w0, uint64_t(w1 - w0));
      j["read_bandwidth_gb_s"] = bw.bytes_per_s / 1e9;           // heap buffer, bandwidth_mib
      j["weights_read_bandwidth_gb_s"] = mapped / 1e9;           // the model's mapped weights
      j["decode_bandwidth_fraction"] = decode.bytes() / best_decode / bw.bytes_per_s;
    }

    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  });
}
