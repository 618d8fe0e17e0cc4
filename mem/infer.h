// `llmq-mem infer`: the memory of running a `.llmq` model, from the engine's own allocation plan
// (engine/mem_plan.h), and `--fit`: the largest context / parallel sequences within a budget.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "engine/mem_plan.h"
#include "mem/report.h"

namespace llmq::mem {

/// What llmq-run / llmq-server would be started with.
struct InferOptions {
  int64_t ctx = 0;        ///< tokens per sequence (0: the model's context, at most 4096)
  int64_t parallel = 1;   ///< sequences at once (> 1: llmq-server's scheduler)
  bool server = false;    ///< plan llmq-server even with parallel = 1
  int64_t kv_tokens = 0;  ///< server KV cache in tokens (0: server_kv_tokens's default)
  int64_t n_batch = 512;  ///< most tokens per forward pass
  int threads = 0;        ///< ThreadPool size (0: every core, as ThreadPool(0))
  std::string kv_type = "f32";  ///< f32 | bf16 (CPU engine, --kv-type) | f16 (planned CUDA backend)
  std::string device = "cpu";   ///< cpu | cuda
  int tp = 1;                   ///< tensor-parallel ranks (cpu: the engine's shards, engine/tp.h; cuda: Megatron estimate)
  int64_t gpu_layers = -1;      ///< cuda, llmq-run: the last N layers on the GPU, the rest on the CPU (-1: all)
  std::optional<double> budget; ///< bytes available
};

/// Heap bytes a model's host tables take (Model::open: metadata, tensor directory, vocabulary,
/// tokenizer, chat template), measured by building them in this process: glibc's mallinfo2
/// bytes in use (arena and mmapped chunks) after minus before. Throws FileError as Model::open.
uint64_t measure_tables(const std::string& path);

/// llmq-run's resident bytes that come neither from the plan nor from the tables: the touched
/// pages of the binary and its shared libraries (about 6 MiB), thread stacks, the C++ runtime,
/// the sampler's and the prompt's buffers, malloc's slack. Measured, not derived: the median over
/// SmolLM2-135M, Qwen2.5-Coder-0.5B and Gemma-3-270M at ctx 512 and 4096 (2 threads, Debian 12
/// x86-64) of llmq-run's peak RSS minus every other line of the report (bench/RESULTS.md,
/// "llmq-mem infer against measured peaks"; the spread there is the error this constant adds).
constexpr uint64_t kRuntimeBytes = uint64_t(10.6 * 1024 * 1024);
/// The same for llmq-server, which adds its HTTP threads, the grammar engine and the requests'
/// buffers: the median over the three models at ctx 1024 with 4 sequences and ctx 4096 with 2
/// (4 and 2 concurrent completions, 2 threads; residuals 21.6-32.4 MiB, bench/RESULTS.md).
constexpr uint64_t kServerRuntimeBytes = uint64_t(25.2 * 1024 * 1024);

/// The GPU memory a CUDA process of llmq holds beside its allocation plan, measured on an NVIDIA
/// H100 80GB HBM3 (driver 580.159, CUDA 13.0, lazy module loading; bench/RESULTS.md, "GPU
/// memory"): the CUDA context, which cudaMemGetInfo shows used before llmq's first allocation
/// (526.8 MiB), and what appears during the load and the first steps beyond the plan's bytes
/// (the cuBLAS handle, the kernel modules loaded on first launch, cudaMalloc's rounding:
/// 67.6-73.3 MiB over stories260K and llama-2-7b-shaped Q4_0 / Q4_K_M at ctx 512 and 4096).
/// Other GPUs and drivers are not measured; the H100's values stand in for them.
constexpr uint64_t kCudaContextBytes = uint64_t(526.8 * 1024 * 1024);
constexpr uint64_t kCudaRuntimeBytes = uint64_t(72.0 * 1024 * 1024);

/// The predicted peak resident memory of llmq-run / llmq-server (CPU, one rank): the larger of
/// the load's and the run's.
struct ResidentPeak {
  uint64_t tables = 0;  ///< measure_tables(path)
  uint64_t runtime = 0;  ///< kRuntimeBytes, or kServerRuntimeBytes for llmq-server
  uint64_t run = 0;      ///< plan.resident() + tables + runtime
  uint64_t load = 0;     ///< the checksum pass: plan.largest_tensor + tables + runtime
  uint64_t peak() const { return run > load ? run : load; }
};
/// `server`: the plan is llmq-server's (parallel > 1 or --server).
ResidentPeak resident_peak(const InferencePlan& p, uint64_t tables, bool server = false);

/// Threads a ThreadPool(threads) would have.
int resolve_threads(int threads);

/// The report for `path` (a `.llmq` file, opened without reading weights). CPU: the predicted
/// peak resident memory (ResidentPeak): the plan's resident lines (exact), the host tables
/// (measured by building them here) and the runtime (a measured constant). CUDA, one GPU: every buffer from plan_cuda (exact), the CUDA
/// context "not measured" (llmq-run measures it at load); CUDA with --tp > 1: weights and KV
/// cache per rank exact, the rest "not measured". Throws FileError / UsageError.
MemReport infer_report(const std::string& path, const InferOptions& o);

/// The model's hyper-parameters from a `.llmq` file's metadata; FileError (naming the file) when
/// they are missing or inconsistent.
ModelConfig file_config(const LlmqFile& f);

/// The plan behind infer_report for the CPU device (what llmq-run / llmq-server allocate).
InferencePlan infer_plan(const LlmqFile& f, const ModelConfig& c, const InferOptions& o);

/// --fit: the largest ctx (a multiple of kKvBlockTokens, at most the model's context) and then
/// the most parallel sequences (at most 256) whose predicted peak (ResidentPeak) fits `budget` bytes, with a KV cache of
/// parallel x ctx tokens (every sequence can reach its full context). fix_ctx / fix_parallel
/// keep o.ctx / o.parallel as given. fits = false when even the smallest plan does not fit
/// (o then holds the smallest). Monotone in both, so each is a binary search.
/// o.device == "cuda": the same search over the GPU's plan (plan_cuda for one sequence,
/// plan_cuda_server for llmq-server; the CUDA context not included), kept in `cuda`.
struct FitResult {
  InferOptions options;
  InferencePlan plan;
  std::optional<CudaPlan> cuda;
  bool fits = false;
  ResidentPeak peak;  ///< CPU: the plan's predicted peak
};
FitResult fit_inference(const LlmqFile& f, const ModelConfig& c, InferOptions o, double budget, bool fix_ctx, bool fix_parallel);

/// --fit with --device cuda (llmq-run --gpu-layers auto): the most layers N in [0, n_layers] whose
/// GPU plan (plan_cuda with gpu_layers N, the CUDA context not included) fits `gpu_budget` bytes,
/// for o's ctx and n_batch; -1 when not even the output alone fits. Monotone in N: a binary
/// search.
int64_t fit_gpu_layers(const LlmqFile& f, const ModelConfig& c, const InferOptions& o, double gpu_budget);

/// The fit as JSON: {"fits", "budget", "ctx", "parallel", "kv_tokens", "n_batch", "threads",
/// "total" (the predicted peak RSS), "mapped" (InferencePlan::total: the mapped file and every
/// allocation), "weights", "kv_cache", "workspace", "gpu_layers": "n/a (CPU plan ...)"}.
nlohmann::json fit_json(const FitResult& r, double budget);

/// "8GiB", "512 MiB", "80GB", "1.5G" (G = GiB), or plain bytes. Throws UsageError.
double parse_size(const std::string& s);

/// MemAvailable of /proc/meminfo in bytes (0 when unknown).
uint64_t available_memory();

}  // namespace llmq::mem
