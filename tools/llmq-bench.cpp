// llmq-bench: prefill and decode speed of a `.llmq` model, as one JSON object on stdout, with
// the machine's streaming-read bandwidth measured on the same threads: decode as a fraction of
// it (bytes each token must read / time), and prefill in GFLOP/s (engine/roofline.h). With
// --tp N > 1 the model runs split over N ranks and TP=1 is measured too at the same total
// thread count (speed-up in the output).
//
//   llmq-bench -m model.llmq [-p 512] [-n 128] [-t N] [-r 3] [--bandwidth-mib 512] [--tp N]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "engine/cpu_ops.h"
#include "engine/model.h"
#include "engine/roofline.h"
#include "engine/tp.h"
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

struct Speed {
  double prefill_s = 1e30, decode_s = 1e30;  // best times
};

// One repetition: prefill of the prompt, then n_gen single-token decode steps.
void measure(Session& s, const std::vector<int32_t>& prompt, int64_t n_gen, Speed& best) {
  using clock = std::chrono::steady_clock;
  const auto n_prompt = int64_t(prompt.size());
  s.reset();
  auto t0 = clock::now();
  s.forward(prompt.data(), n_prompt);
  best.prefill_s = std::min(best.prefill_s, std::chrono::duration<double>(clock::now() - t0).count());
  t0 = clock::now();
  for (int64_t i = 0; i < n_gen; ++i) {
    const int32_t tok = prompt[size_t(i % n_prompt)];
    s.forward(&tok, 1);
  }
  best.decode_s = std::min(best.decode_s, std::chrono::duration<double>(clock::now() - t0).count());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-bench: measure prefill and decode tok/s (JSON output)"};
  std::string model_path, tp_output = "vocab";
  int64_t n_prompt = 512, n_gen = 128;
  int threads = 0, reps = 3, tp = 1;
  bool no_verify = false, no_baseline = false;
  int64_t bandwidth_mib = 512;
  app.add_option("-m,--model", model_path, "model file (.llmq)")->required();
  app.add_option("-p,--prompt-tokens", n_prompt, "prompt length for the prefill measurement");
  app.add_option("-n,--gen-tokens", n_gen, "tokens decoded one at a time after the prompt");
  app.add_option("-t,--threads", threads, "threads in all (default: all cores); with --tp they are shared by the ranks");
  app.add_option("-r,--repetitions", reps, "repetitions; the best is reported");
  app.add_option("--tp", tp, "tensor-parallel ranks (CPU: rank threads in this process); with N > 1, TP=1 at the same "
                             "total thread count is measured too (interleaved) and the speed-up reported");
  app.add_option("--tp-output", tp_output, "TP placement of embedding and output: vocab (vocab-parallel) or replicated");
  app.add_flag("--no-baseline", no_baseline, "with --tp N > 1: skip the TP=1 measurement");
  std::string kv_type_s = "f32";
  app.add_option("--kv-type", kv_type_s, "KV cache element type: f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_flag("--no-verify", no_verify, "skip checksum verification at load");
  app.add_option("--bandwidth-mib", bandwidth_mib,
                 "buffer for the read-bandwidth measurement, MiB (0: skip it)");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-bench", [&] {
    if (n_prompt < 1 || n_gen < 1 || reps < 1) throw UsageError("-p, -n and -r must be positive");
    if (tp_output != "vocab" && tp_output != "replicated") throw UsageError("--tp-output must be vocab or replicated");
    if (bandwidth_mib < 0 || bandwidth_mib > (int64_t(1) << 20)) throw UsageError("--bandwidth-mib out of range");
    auto model = Model::load(model_path, !no_verify);
    TpOptions opt;
    opt.vocab_parallel = tp_output == "vocab";
    TensorParallel runner(*model, tp, threads, n_prompt, opt);
    const int total_threads = runner.threads();
    std::unique_ptr<TensorParallel> base;  // TP=1 at the same total thread count
    if (tp > 1 && !no_baseline) base = std::make_unique<TensorParallel>(*model, 1, total_threads, n_prompt);
    const KvType kv_type = kv_type_from_name(kv_type_s);
    Session s(runner, n_prompt + n_gen, kv_type);
    std::unique_ptr<Session> bs;
    if (base) bs = std::make_unique<Session>(*base, n_prompt + n_gen, kv_type);
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> pick(0, int32_t(model->config.vocab_size - 1));
    std::vector<int32_t> prompt(static_cast<size_t>(n_prompt));
    for (auto& t : prompt) t = pick(rng);

    Speed best, best_base;
    for (int r = 0; r < reps; ++r) {  // interleaved, so a busy spell of a shared machine hits both
      if (bs) measure(*bs, prompt, n_gen, best_base);
      measure(s, prompt, n_gen, best);
    }
    // What the runs had to read and compute (engine/roofline.h), for the whole model.
    const ForwardCost prefill = forward_cost(*model, n_prompt, 0, kv_elem_bytes(kv_type));
    ForwardCost decode;
    for (int64_t i = 0; i < n_gen; ++i) {
      const ForwardCost c = forward_cost(*model, 1, n_prompt + i, kv_elem_bytes(kv_type));
      decode.weight_bytes += c.weight_bytes;
      decode.kv_bytes += c.kv_bytes;
      decode.flops += c.flops;
    }
    nlohmann::json j;
    j["model"] = model_path;
    j["type"] = model->weight_type();
    j["weight_bytes"] = model->weight_bytes();
    j["threads"] = total_threads;
    j["device"] = "cpu";
    j["cpu_kernels"] = cpu_kernels_name();  // scalar | avx2 | avx512 (LLMQ_CPU overrides)
    j["tp"] = runner.size();
    j["kv_type"] = kv_type_name(kv_type);
    j["prompt_tokens"] = n_prompt;
    j["gen_tokens"] = n_gen;
    j["prefill_tok_s"] = double(n_prompt) / best.prefill_s;
    j["decode_tok_s"] = double(n_gen) / best.decode_s;
    if (runner.size() > 1) {
      j["tp_output"] = tp_output;
      nlohmann::json ranks = nlohmann::json::array();
      for (int r = 0; r < runner.size(); ++r) {
        const ModelShard& sh = runner.shard(r);
        ranks.push_back({{"rank", r},
                         {"threads", runner.rank_threads(r)},
                         {"heads", sh.ranges.n_heads},
                         {"kv_heads", sh.ranges.n_kv_heads},
                         {"ffn_dim", sh.ranges.ffn_dim},
                         {"vocab_rows", sh.ranges.n_vocab},
                         {"weight_bytes", sh.weight_bytes()},
                         {"owned_weight_bytes", sh.owned_bytes},
                         {"kv_cache_bytes", s.cache().shard_bytes(r)}});
      }
      j["ranks"] = ranks;
      if (bs) {
        j["tp1_prefill_tok_s"] = double(n_prompt) / best_base.prefill_s;
        j["tp1_decode_tok_s"] = double(n_gen) / best_base.decode_s;
        j["speedup_prefill"] = best_base.prefill_s / best.prefill_s;
        j["speedup_decode"] = best_base.decode_s / best.decode_s;
      }
    }
    j["cpu_model"] = cpu_model_name();
    j["peak_rss_bytes"] = cli::peak_rss_bytes();  // before the bandwidth buffer below
    j["prefill_gflop_s"] = prefill.flops / best.prefill_s / 1e9;
    {
      // The int8 multiply-add peak with the same threads: block-quantized prefill's ceiling.
      ThreadPool pool(total_threads);
      if (const double peak = measure_int8_peak(pool); peak > 0) {
        j["int8_peak_gop_s"] = peak / 1e9;
        j["prefill_fraction_of_int8_peak"] = prefill.flops / best.prefill_s / peak;
      }
    }
    j["decode_bytes_per_token"] = decode.bytes() / double(n_gen);
    j["decode_gb_s"] = decode.bytes() / best.decode_s / 1e9;
    if (bandwidth_mib > 0) {
      // Measured after the model runs, on as many threads: the machine's streaming-read rate.
      ThreadPool pool(total_threads);
      const ReadBandwidth bw = measure_read_bandwidth(pool, uint64_t(bandwidth_mib) << 20);
      // The weights as the kernels read them: the packed copy if the CPU kernels repacked them
      // (the mapped file's pages of those matrices were released), else the mapped file.
      const auto& t = model->file->tensors();
      const uint8_t* w0 = model->file->data(t.front());
      const uint8_t* w1 = model->file->data(t.back()) + t.back().nbytes;
      if (model->packed.bytes() > 0) w0 = model->packed.data(), w1 = w0 + model->packed.bytes();
      const double weights_bw = measure_read_bandwidth(pool, w0, uint64_t(w1 - w0));
      j["read_bandwidth_gb_s"] = bw.bytes_per_s / 1e9;           // heap buffer, bandwidth_mib
      j["weights_read_bandwidth_gb_s"] = weights_bw / 1e9;       // the model's weights (packed or mapped)
      j["packed_weight_bytes"] = model->packed.bytes();
      j["decode_bandwidth_fraction"] = decode.bytes() / best.decode_s / bw.bytes_per_s;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  });
}
