// llmq-bench: prefill and decode speed of a `.llmq` model, as one JSON object on stdout, with
// the machine's streaming-read bandwidth measured on the same threads: decode as a fraction of
// it (bytes each token must read / time), and prefill in GFLOP/s (engine/roofline.h). With
// --tp N > 1 the model runs split over N ranks and TP=1 is measured too at the same total
// thread count (speed-up in the output). Under `mpirun -np N ... --tp N` the ranks are N
// processes; rank 0 measures them (and TP=1 in its own process at N x -t threads) and the
// group's all-reduce latency and bandwidth per message size ("all_reduce").
//
//   llmq-bench -m model.llmq [-p 512] [-n 128] [-t N] [-r 3] [--bandwidth-mib 512] [--tp N]
//   llmq-bench --device cuda (-m model.llmq | --synthetic llama-2-7b --type q4_0) [-p 512] [-n 128]
// On a GPU: decode at batch 1 (greedy on the GPU, the step a replayed CUDA graph), prefill of
// the prompt, the achieved bandwidth against a device-to-device copy measured here, and prefill
// FLOP/s against cuBLAS's bf16 GEMM measured here. --synthetic makes random weights with a
// preset's exact shapes on the device (mem/shape.h presets), so nothing large has to travel.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "engine/cpu/cpu_ops.h"
#include "engine/runner/device.h"
#include "engine/sampler.h"
#include "engine/model.h"
#include "engine/roofline.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"
#include "base/error.h"
#include "mem/shape.h"
#include "cli/cli_common.h"

#ifdef LLMQ_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/cuda.h"
#include "engine/cuda/session.h"
#endif

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
void measure(SessionBase& s, const std::vector<int32_t>& prompt, int64_t n_gen, Speed& best) {
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

// n token ids drawn uniformly from [0, vocab) by a generator seeded with 1234: the same prompt every run.
std::vector<int32_t> random_prompt(int64_t n, int64_t vocab) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> pick(0, int32_t(vocab - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (auto& t : prompt) t = pick(rng);
  return prompt;
}

#ifdef LLMQ_HAVE_CUDA
// A profile's time per op class, each times `scale` (1: ms; 1e3 / n: us per step of n), and their "total".
nlohmann::json op_times(const cuda::OpProfile& prof, double scale) {
  nlohmann::json j = nlohmann::json::object();
  double sum = 0;
  for (const auto& [op, ms] : prof.totals_ms()) j[op] = ms * scale, sum += ms * scale;
  j["total"] = sum;
  return j;
}

nlohmann::json profile_cuda(cuda::CudaSession& s, const std::vector<int32_t>& prompt, int64_t n_gen) {
  cuda::OpProfile prof;
  s.set_profile(&prof);
  s.reset();
  s.prefill(prompt.data(), int64_t(prompt.size()));
  nlohmann::json j;
  j["prefill_ms"] = op_times(prof, 1.0);
  prof.clear();
  int32_t tok = prompt.back();
  for (int64_t i = 0; i < n_gen; ++i) tok = s.decode_greedy(tok);
  s.set_profile(nullptr);
  j["decode_us_per_token"] = op_times(prof, 1e3 / double(n_gen));
  return j;
}

// --batch N: N sequences decoding at once through forward_batch on a paged cache (llmq-server's
// GPU path): each gets a prompt of n_prompt tokens (one pass each), then n_gen steps of N tokens.
// Aggregate decode tok/s = N n_gen / time (best of reps); the steps of more than
// kGemvMaxTokens tokens run on MMQ. With `profile`, one more round (not timed) splits a step's
// time per op class with CUDA events, ungraphed: "profile_us_per_step".
nlohmann::json bench_cuda_batch(const cuda::CudaModel& dm, int64_t batch, int64_t n_prompt, int64_t n_gen, int reps, bool profile) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& c = dm.config();
  const int64_t ctx = n_prompt + n_gen;
  const CudaPlan plan = plan_cuda_server(c, {}, ctx, std::max(batch, n_prompt), batch, batch * ctx);
  cuda::CudaSession s(dm, nullptr, plan);
  std::mt19937 rng(99);
  std::uniform_int_distribution<int32_t> pick(0, int32_t(c.vocab_size - 1));
  double best = 1e30;
  cuda::OpProfile prof;
  const int rounds = reps + 1 + (profile ? 1 : 0);
  for (int r = 0; r < rounds; ++r) {  // the first is a warm-up (graphs, MMQ's shared-memory opt-in)
    const bool profiled = profile && r == rounds - 1;
    KVCache kv = KVCache::tables_only(c, plan.kv_blocks, plan.block_tokens);
    std::vector<int32_t> seqs;
    std::vector<BatchToken> b;
    for (int64_t i = 0; i < batch; ++i) {
      seqs.push_back(kv.add_sequence());
      if (!kv.reserve(seqs.back(), ctx)) throw UsageError("--batch: the planned cache is too small");
      b.clear();
      for (int64_t j = 0; j < n_prompt; ++j) b.push_back({seqs.back(), pick(rng), j + 1 == n_prompt});
      s.forward_batch(kv, b.data(), int64_t(b.size()));
    }
    if (profiled) s.set_profile(&prof);
    const auto t0 = clock::now();
    for (int64_t step = 0; step < n_gen; ++step) {
      b.clear();
      for (int32_t q : seqs) b.push_back({q, pick(rng), true});
      s.forward_batch(kv, b.data(), int64_t(b.size()));
    }
    const double t = std::chrono::duration<double>(clock::now() - t0).count();
    if (profiled) s.set_profile(nullptr);
    else if (r > 0) best = std::min(best, t);
  }
  nlohmann::json j = {{"batch", batch}, {"prompt_tokens_each", n_prompt}, {"gen_tokens_each", n_gen},
                      {"aggregate_decode_tok_s", double(batch * n_gen) / best}, {"step_ms", best / double(n_gen) * 1e3}};
  if (profile) j["profile_us_per_step"] = op_times(prof, 1e3 / double(n_gen));
  return j;
}

// Best prefill and decode times (s) of `reps` rounds after a warm-up: prefill of `prompt`, then n_gen greedy steps.
Speed time_cuda(cuda::CudaSession& s, const std::vector<int32_t>& prompt, int64_t n_gen, int reps) {
  using clock = std::chrono::steady_clock;
  const auto n_prompt = int64_t(prompt.size());
  Speed best;
  for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up (graph capture, cuBLAS heuristics)
    s.reset();
    auto t0 = clock::now();
    s.prefill(prompt.data(), n_prompt);
    const double tp = std::chrono::duration<double>(clock::now() - t0).count();
    t0 = clock::now();
    int32_t tok = prompt.back();
    for (int64_t i = 0; i < n_gen; ++i) tok = s.decode_greedy(tok);
    const double td = std::chrono::duration<double>(clock::now() - t0).count();
    if (r > 0) best.prefill_s = std::min(best.prefill_s, tp), best.decode_s = std::min(best.decode_s, td);
  }
  return best;
}

// The mean bytes a decode step reads over n_gen steps after an n_prompt-token prompt on the GPU model dm.
double cuda_decode_bytes(const cuda::CudaModel& dm, const ModelConfig& c, int64_t n_prompt, int64_t n_gen) {
  // Bytes a decode step reads: every weight but the embedding table (one row of it, unless the
  // output is the table), and K and V of positions 0 .. p in every layer (fp16).
  const auto& e = dm.token_embd;
  const uint64_t embd = cuda::split_weight_bytes(e.type, e.rows, e.cols);
  const double weights = double(dm.weight_bytes()) - (c.tied_embeddings ? 0.0 : double(embd) - double(embd / uint64_t(e.rows)));
  double kv = 0;
  for (int64_t i = 0; i < n_gen; ++i) kv += double(c.n_layers) * 2.0 * double(n_prompt + i + 1) * double(c.kv_dim()) * 2.0;
  return weights + kv / double(n_gen);
}

// The FLOPs of one prefill of n_prompt tokens (matrices and attention).
double cuda_prefill_flops(const ModelConfig& c, int64_t n_prompt) {
  // Prefill arithmetic: 2 FLOP per matrix weight and token, attention 4 (p + 1) q_dim per layer and token.
  const double matrix_weights = double(c.n_layers) * double(c.dim) * double(2 * c.q_dim() + 2 * c.kv_dim() + 3 * c.hidden_dim) +
                                double(c.vocab_size) * double(c.dim) / double(n_prompt);  // output: the last token only
  return 2.0 * matrix_weights * double(n_prompt) +
         4.0 * double(c.q_dim()) * double(c.n_layers) * double(n_prompt) * double(n_prompt + 1) / 2.0;
}

// --device cuda: the model (`model`, or random weights of `type` with config c) on GPU 0.
// --profile: one prefill of `prompt` and n_gen greedy steps, timed per op class with CUDA events
// (ungraphed); milliseconds for the prefill, microseconds per decode step.
nlohmann::json bench_cuda(const Model* model, const ModelConfig& c, DType type, int64_t n_prompt, int64_t n_gen, int reps,
                          bool profile, int64_t batch) {
  cuda::check(cudaSetDevice(0), "cudaSetDevice");
  std::unique_ptr<cuda::CudaModel> dm =
      model ? std::make_unique<cuda::CudaModel>(*model, true) : std::make_unique<cuda::CudaModel>(c, type, 1234);
  cuda::CudaSession s(*dm, model, n_prompt + n_gen, n_prompt, 1);
  const std::vector<int32_t> prompt = random_prompt(n_prompt, c.vocab_size);
  const Speed best = time_cuda(s, prompt, n_gen, reps);
  const double prefill_s = best.prefill_s, decode_s = best.decode_s;
  const double decode_bytes = cuda_decode_bytes(*dm, c, n_prompt, n_gen);
  const double prefill_flops = cuda_prefill_flops(c, n_prompt);
  const double copy_bw = cuda::measure_copy_bandwidth();
  const double gemm = cuda::measure_cublas_bf16_flops(c.hidden_dim, n_prompt, c.dim);
  nlohmann::json j;
  j["device"] = "cuda";
  j["gpu"] = cuda::device_description(0);
  j["type"] = model ? model->weight_type() : std::string(dtype_name(type));
  j["weight_bytes"] = dm->weight_bytes();
  j["kv_cache_bytes"] = s.kv_bytes();
  j["workspace_bytes"] = s.workspace_bytes();
  j["device_bytes_measured"] = dm->measured_bytes() + s.measured_bytes();
  j["prompt_tokens"] = n_prompt;
  j["gen_tokens"] = n_gen;
  j["cuda_graphs"] = !(std::getenv("LLMQ_CUDA_GRAPH") && std::string(std::getenv("LLMQ_CUDA_GRAPH")) == "0");
  j["prefill_tok_s"] = double(n_prompt) / prefill_s;
  j["decode_tok_s"] = double(n_gen) / decode_s;
  j["decode_bytes_per_token"] = decode_bytes;
  j["decode_gb_s"] = decode_bytes * double(n_gen) / decode_s / 1e9;
  j["copy_bandwidth_gb_s"] = copy_bw / 1e9;
  j["decode_fraction_of_copy"] = decode_bytes * double(n_gen) / decode_s / copy_bw;
  j["prefill_tflop_s"] = prefill_flops / prefill_s / 1e12;
  j["cublas_bf16_tflop_s"] = gemm / 1e12;
  j["cublas_bf16_shape"] = {c.hidden_dim, n_prompt, c.dim};
  j["prefill_fraction_of_cublas"] = prefill_flops / prefill_s / gemm;
  if (profile) j["profile"] = profile_cuda(s, prompt, n_gen);
  if (batch > 1) {
    j["batched"] = bench_cuda_batch(*dm, batch, std::min<int64_t>(n_prompt, 128), n_gen, reps, profile);
    j["batched"]["speedup_over_batch1"] = j["batched"]["aggregate_decode_tok_s"].get<double>() / j["decode_tok_s"].get<double>();
  }
  return j;
}

// --device cuda --tp N: the model split over N GPU ranks (one per GPU over NCCL, or all on GPU 0
// with a host all-reduce; make_cuda_session), prefill and greedy decode timed as bench_cuda
// does, and TP = 1 on GPU 0 beside it unless no_baseline.
nlohmann::json bench_cuda_tp(const Model& model, int tp, int64_t n_prompt, int64_t n_gen, int reps, bool no_baseline) {
  using clock = std::chrono::steady_clock;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> pick(0, int32_t(model.config.vocab_size - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(n_prompt));
  for (auto& t : prompt) t = pick(rng);
  SamplerParams greedy;
  greedy.temperature = 0;
  auto run = [&](int ranks) {
    RunnerOptions ro;
    ro.place = Placement{Device::Cuda, -1, ranks};
    ro.ctx = n_prompt + n_gen, ro.n_batch = n_prompt, ro.progress = false;
    std::unique_ptr<Runner> runner = make_runner(model, ro);
    SessionBase* s = &runner->session();
    Sampler sampler(greedy);
    double prefill_s = 1e30, decode_s = 1e30;
    for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up
      s->reset();
      auto t0 = clock::now();
      std::vector<int32_t> hist(prompt);
      int32_t tok = s->forward_sample(prompt.data(), n_prompt, sampler, hist);
      const double tp_s = std::chrono::duration<double>(clock::now() - t0).count();
      t0 = clock::now();
      for (int64_t i = 1; i < n_gen; ++i) hist.push_back(tok), tok = s->forward_sample(&tok, 1, sampler, hist);
      const double td = std::chrono::duration<double>(clock::now() - t0).count();
      if (r > 0) prefill_s = std::min(prefill_s, tp_s), decode_s = std::min(decode_s, td);
    }
    return nlohmann::json{{"tp", ranks}, {"prefill_tok_s", double(n_prompt) / prefill_s},
                          {"decode_tok_s", double(std::max<int64_t>(n_gen - 1, 1)) / decode_s}, {"kv_cache_bytes", s->kv_bytes()},
                          {"workspace_bytes", s->workspace_bytes()}};
  };
  nlohmann::json j;
  j["device"] = "cuda";
  j["gpu"] = cuda::device_description(0);
  j["gpus"] = cuda::device_count();
  j["type"] = model.weight_type();
  j["prompt_tokens"] = n_prompt;
  j["gen_tokens"] = n_gen;
  j["split"] = run(tp);
  if (!no_baseline) {
    j["baseline"] = run(1);
    j["decode_speedup"] = j["split"]["decode_tok_s"].get<double>() / j["baseline"]["decode_tok_s"].get<double>();
    j["prefill_speedup"] = j["split"]["prefill_tok_s"].get<double>() / j["baseline"]["prefill_tok_s"].get<double>();
  }
  return j;
}
#endif


// The command line, checked by main.
struct BenchOptions {
  std::string model_path, tp_output = "vocab", device_s = "cpu", synthetic, type_s = "q4_0", kv_type_s = "f32";
  int64_t n_prompt = 512, n_gen = 128, batch = 1, bandwidth_mib = 512;
  int threads = 0, reps = 3, tp = 1;
  bool no_verify = false, no_baseline = false, profile = false;
};

// --device cuda: one GPU (a model file or --synthetic), or --tp N ranks on GPUs.
int run_cuda(const BenchOptions& o) {
  if (o.tp != 1 && !o.synthetic.empty()) throw UsageError("--tp with --device cuda takes a model file (-m), not --synthetic");
#ifdef LLMQ_HAVE_CUDA
  if (o.tp > 1) {
    auto m = load_model(o.model_path, !o.no_verify, Placement{Device::Cuda, -1, o.tp});
    nlohmann::json j = bench_cuda_tp(*m, o.tp, o.n_prompt, o.n_gen, o.reps, o.no_baseline);
    j["model"] = o.model_path;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::unique_ptr<Model> m;
  ModelConfig c;
  if (!o.synthetic.empty()) {
    const mem::ModelShape sh = mem::preset(o.synthetic);
    c.dim = sh.dim, c.hidden_dim = sh.hidden, c.n_layers = sh.layers, c.n_heads = sh.heads, c.n_kv_heads = sh.kv_heads;
    c.head_dim = sh.head_dim, c.vocab_size = sh.vocab, c.context_length = sh.context, c.tied_embeddings = sh.tied;
  } else {
    m = load_model(o.model_path, !o.no_verify, Placement{Device::Cuda});
    c = m->config;
  }
  nlohmann::json j = bench_cuda(m.get(), c, dtype_from_name(o.type_s), o.n_prompt, o.n_gen, o.reps, o.profile, o.batch);
  j["model"] = o.synthetic.empty() ? o.model_path : "synthetic " + o.synthetic;
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
#else
  throw UsageError("this llmq-bench was built without the CUDA backend");
#endif
}

// The CPU ranks' layout (--tp N > 1) and the TP=1 baseline, into j.
void tp_report(nlohmann::json& j, const TensorParallel& ranks, const SessionBase& s, const Speed* base, const Speed& best, const BenchOptions& o) {
  j["tp_output"] = o.tp_output;
  const auto* cpu_session = dynamic_cast<const Session*>(&s);  // the CPU ranks' session: one KV pool per rank
  nlohmann::json rank_list = nlohmann::json::array();
  for (int r = 0; r < ranks.size(); ++r) {
    const ModelShard& sh = ranks.shard(r);
    rank_list.push_back({{"rank", sh.ranges.rank},
                         {"threads", ranks.rank_threads(r)},
                         {"heads", sh.ranges.n_heads},
                         {"kv_heads", sh.ranges.n_kv_heads},
                         {"ffn_dim", sh.ranges.ffn_dim},
                         {"vocab_rows", sh.ranges.n_vocab},
                         {"weight_bytes", sh.weight_bytes()},
                         {"owned_weight_bytes", sh.owned_bytes},
                         {"kv_cache_bytes", cpu_session ? cpu_session->cache().shard_bytes(r) : 0}});
  }
  j["ranks"] = rank_list;
  if (!base) return;
  j["tp1_prefill_tok_s"] = double(o.n_prompt) / base->prefill_s;
  j["tp1_decode_tok_s"] = double(o.n_gen) / base->decode_s;
  j["speedup_prefill"] = base->prefill_s / best.prefill_s;
  j["speedup_decode"] = base->decode_s / best.decode_s;
}

// What the CPU runs had to read and compute (engine/roofline.h), against the int8 peak and the
// read bandwidth measured on as many threads after them, into j.
void roofline_report(nlohmann::json& j, const Model& model, KvType kv_type, const Speed& best, int threads, const BenchOptions& o) {
  const ForwardCost prefill = forward_cost(model, o.n_prompt, 0, kv_elem_bytes(kv_type));
  ForwardCost decode;
  for (int64_t i = 0; i < o.n_gen; ++i) {
    const ForwardCost c = forward_cost(model, 1, o.n_prompt + i, kv_elem_bytes(kv_type));
    decode.weight_bytes += c.weight_bytes;
    decode.kv_bytes += c.kv_bytes;
    decode.flops += c.flops;
  }
  j["prefill_gflop_s"] = prefill.flops / best.prefill_s / 1e9;
  ThreadPool pool(threads);
  if (const double peak = measure_int8_peak(pool); peak > 0) {  // block-quantized prefill's ceiling
    j["int8_peak_gop_s"] = peak / 1e9;
    j["prefill_fraction_of_int8_peak"] = prefill.flops / best.prefill_s / peak;
  }
  j["decode_bytes_per_token"] = decode.bytes() / double(o.n_gen);
  j["decode_gb_s"] = decode.bytes() / best.decode_s / 1e9;
  if (o.bandwidth_mib <= 0) return;
  // The machine's streaming-read rate, then the weights as the kernels read them: the packed
  // copy if the CPU kernels repacked them (the mapped file's pages of those matrices were
  // released), else the mapped file.
  const ReadBandwidth bw = measure_read_bandwidth(pool, uint64_t(o.bandwidth_mib) << 20);
  const auto& t = model.file->tensors();
  const uint8_t* w0 = model.file->data(t.front());
  const uint8_t* w1 = model.file->data(t.back()) + t.back().nbytes;
  if (model.packed.bytes() > 0) w0 = model.packed.data(), w1 = w0 + model.packed.bytes();
  const double weights_bw = measure_read_bandwidth(pool, w0, uint64_t(w1 - w0));
  j["read_bandwidth_gb_s"] = bw.bytes_per_s / 1e9;      // heap buffer, bandwidth_mib
  j["weights_read_bandwidth_gb_s"] = weights_bw / 1e9;  // the model's weights (packed or mapped)
  j["packed_weight_bytes"] = model.packed.bytes();
  j["decode_bandwidth_fraction"] = decode.bytes() / best.decode_s / bw.bytes_per_s;
}

// The group's all-reduce (MpiComm::all_reduce_sum) per message size, 4 KiB to 64 MiB by 4x,
// every rank at once: after 2 warm-up calls, `iters` calls (256 MiB of messages, 5 to 1000)
// between two barriers, timed on rank 0. latency_us: the time per call; algbw: bytes / time;
// busbw: algbw x 2 (N-1) / N (what each rank sends and receives, as nccl-tests reports it).
nlohmann::json bench_all_reduce(MpiComm& c) {
  nlohmann::json out = nlohmann::json::array();
  const int N = c.size();
  for (int64_t bytes = 4096; bytes <= (int64_t(64) << 20); bytes *= 4) {
    const int64_t n = bytes / int64_t(sizeof(float));
    const int iters = int(std::clamp<int64_t>((int64_t(256) << 20) / bytes, 5, 1000));
    std::vector<float> buf(size_t(n), 1.0f);
    for (int w = 0; w < 2; ++w) c.all_reduce_sum(buf.data(), n);
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) c.all_reduce_sum(buf.data(), n);
    c.barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    const double algbw = double(bytes) / s / 1e9;
    out.push_back({{"bytes", bytes}, {"iters", iters}, {"latency_us", s * 1e6}, {"algbw_gb_s", algbw},
                   {"busbw_gb_s", algbw * 2.0 * (N - 1) / N}});
  }
  return out;
}

// The CPU run's model, weight type and bytes, threads, kernels, --tp, KV type and the best prefill and decode tok/s as JSON;
// all_reduce: the group's all-reduce figures (bench_all_reduce) under mpirun, else null.
nlohmann::json cpu_speed_report(const Model& model, const BenchOptions& o, int total_threads, const nlohmann::json* all_reduce,
                                KvType kv_type, const Speed& best) {
  nlohmann::json j;
  j["model"] = o.model_path;
  j["type"] = model.weight_type();
  j["weight_bytes"] = model.weight_bytes();
  j["threads"] = total_threads;
  j["device"] = "cpu";
  j["cpu_kernels"] = cpu_kernels_name();  // scalar | avx2 | avx512 (LLMQ_CPU overrides)
  j["tp"] = o.tp;
  if (all_reduce) {
    j["tp_processes"] = true;  // the ranks below: this process's (rank 0) only
    j["all_reduce"] = *all_reduce;
    j["all_reduce_algorithm"] = "MPI, rank-order sum: MPI_Allgather up to " + std::to_string(kAllgatherBytes) +
                                " bytes, else MPI_Alltoallv + MPI_Allgatherv (engine/parallel/comm_mpi.h)";
  }
  j["kv_type"] = kv_type_name(kv_type);
  j["prompt_tokens"] = o.n_prompt;
  j["gen_tokens"] = o.n_gen;
  j["prefill_tok_s"] = double(o.n_prompt) / best.prefill_s;
  j["decode_tok_s"] = double(o.n_gen) / best.decode_s;
  return j;
}

// --device cpu: TP=1, N rank threads, or (under mpirun, `group`) this process's rank of an MPI
// job; with N > 1 also TP=1 at the same total thread count, interleaved.
int run_cpu(const BenchOptions& o, MpiComm* group) {
  // The TP=1 baseline wants the whole model's packed panels; without it, only what the ranks use.
  auto model = load_model(o.model_path, !o.no_verify, Placement{Device::Cpu, -1, o.tp, /*whole_panels=*/!o.no_baseline, o.n_prompt + o.n_gen});
  TpOptions opt;
  opt.vocab_parallel = o.tp_output == "vocab";
  // Under mpirun the ranks are processes (engine/parallel/tp_process.h); this one holds its rank
  // and runs at -t threads, the others as many each (assumed: the baseline uses -t x N threads).
  if (group && !opt.vocab_parallel) throw UsageError("ranks under mpirun are vocab-parallel (--tp-output vocab)");
  RunnerOptions ro;
  ro.place = Placement{Device::Cpu, -1, o.tp};
  ro.threads = o.threads, ro.ctx = o.n_prompt + o.n_gen, ro.n_batch = o.n_prompt, ro.capacity = o.n_prompt;
  ro.kv_type = kv_type_from_name(o.kv_type_s), ro.vocab_parallel = opt.vocab_parallel;
  cli::join_tp_group(group, *model, ro);
  const nlohmann::json all_reduce = group ? bench_all_reduce(*group) : nlohmann::json();  // every rank, before rank 0 leads
  std::unique_ptr<Runner> runner = group ? cli::make_tool_runner("llmq-bench", *model, ro) : make_runner(*model, ro);
  if (runner->follower()) return runner->serve();  // a following rank: rank 0's forward passes, quietly
  const TensorParallel* ranks = runner->cpu_ranks();  // what this process holds (nullptr: TP = 1 on one pool)
  const int total_threads = ranks ? (group ? ranks->threads() * o.tp : ranks->threads()) : mem::resolve_threads(o.threads);
  std::unique_ptr<Runner> base;  // TP=1 at the same total thread count
  if (o.tp > 1 && !o.no_baseline) {
    RunnerOptions bo = ro;
    bo.place.tp = 1, bo.threads = total_threads, bo.group = nullptr;
    base = make_runner(*model, bo);
  }
  const KvType kv_type = ro.kv_type;
  SessionBase& s = runner->session();
  SessionBase* bs = base ? &base->session() : nullptr;
  const std::vector<int32_t> prompt = random_prompt(o.n_prompt, model->config.vocab_size);

  Speed best, best_base;
  for (int r = 0; r < o.reps; ++r) {  // interleaved, so a busy spell of a shared machine hits both
    if (bs) measure(*bs, prompt, o.n_gen, best_base);
    measure(s, prompt, o.n_gen, best);
  }
  nlohmann::json j = cpu_speed_report(*model, o, total_threads, group ? &all_reduce : nullptr, kv_type, best);
  if (o.tp > 1 && ranks) tp_report(j, *ranks, s, bs ? &best_base : nullptr, best, o);
  j["cpu_model"] = cpu_model_name();
  j["peak_rss_bytes"] = cli::peak_rss_bytes();  // before the bandwidth buffer
  roofline_report(j, *model, kv_type, best, total_threads, o);
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-bench: measure prefill and decode tok/s (JSON output)"};
  BenchOptions o;
  app.add_option("model,-m,--model", o.model_path, "model file (.llmq, GGUF or a Hugging Face directory; positional or -m)");
  app.add_option("--device", o.device_s, "cpu or cuda (GPU 0)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--synthetic", o.synthetic, "with --device cuda, instead of -m: random weights with a preset's shapes (llama-2-7b, llama-3-8b, ...)");
  app.add_option("--type", o.type_s, "weight type of --synthetic: q4_0, q4_1, q8_0, q5_0, q5_1, iq4_nl, q2_k ... q6_k, f16 or bf16");
  app.add_option("-p,--prompt-tokens", o.n_prompt, "prompt length for the prefill measurement");
  app.add_option("-n,--gen-tokens", o.n_gen, "tokens decoded one at a time after the prompt");
  app.add_option("-t,--threads", o.threads, "threads in all (default: all cores); with --tp they are shared by the ranks");
  app.add_option("-r,--repetitions", o.reps, "repetitions; the best is reported");
  app.add_option("--tp", o.tp, "tensor-parallel ranks (CPU: rank threads in this process; --device cuda -m FILE: one rank per GPU "
                               "over NCCL, or all on GPU 0); with N > 1, TP=1 at the same total thread count (or on GPU 0) is measured "
                               "too and the speed-up reported. Under `mpirun -np N`: one CPU rank per process, --tp N, and "
                               "the all-reduce's latency and bandwidth per message size");
  app.add_option("--tp-output", o.tp_output, "TP placement of embedding and output: vocab (vocab-parallel) or replicated");
  app.add_flag("--no-baseline", o.no_baseline, "with --tp N > 1: skip the TP=1 measurement");
  app.add_option("--kv-type", o.kv_type_s, "KV cache element type: f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_flag("--no-verify", o.no_verify, "skip checksum verification at load");
  app.add_option("--batch", o.batch, "with --device cuda: also N sequences decoding at once (llmq-server's batched steps), "
                                     "aggregate tok/s as JSON \"batched\"");
  app.add_flag("--profile", o.profile, "with --device cuda: the time of one prefill and of the decode steps per op class "
                                       "(CUDA events, without graphs), as JSON \"profile\"");
  app.add_option("--bandwidth-mib", o.bandwidth_mib, "buffer for the read-bandwidth measurement, MiB (0: skip it)");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-bench", [&] {
    if (o.n_prompt < 1 || o.n_gen < 1 || o.reps < 1) throw UsageError("-p, -n and -r must be positive");
    if (o.batch < 1 || o.batch > 1024) throw UsageError("--batch must be 1..1024");
    if (o.tp_output != "vocab" && o.tp_output != "replicated") throw UsageError("--tp-output must be vocab or replicated");
    if (o.bandwidth_mib < 0 || o.bandwidth_mib > (int64_t(1) << 20)) throw UsageError("--bandwidth-mib out of range");
    if (o.model_path.empty() == o.synthetic.empty()) throw UsageError("give a model (-m) or --synthetic NAME, one of them");
    const Device device = pick_device(o.device_s);
    cli::check_tp_flags(o.tp);
    if (mpi_launch_size() > 1 && device != Device::Cpu) throw UsageError("llmq-bench under mpirun measures CPU ranks (GPU ranks as processes: llmq-run)");
    if (!o.synthetic.empty() && device != Device::Cuda) throw UsageError("--synthetic runs on --device cuda");
    if (device == Device::Cuda) return run_cuda(o);
    const std::unique_ptr<MpiComm> group = cli::start_mpi_group(o.tp);  // under mpirun; outlives the runners
    return run_cpu(o, group.get());
  });
}
