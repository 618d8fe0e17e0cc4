// Helpers shared by the tests: where the real data and the built tools are.
#pragma once
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "formats/llmq_file.h"
#include "engine/cpu/cpu_ops.h"
#include "formats/quant.h"
#include "models/config.h"

namespace llmq::test {

/// A folder compiled in, unless the environment variable of the same name overrides it (a test
/// binary carried to another machine, e.g. the GPU machine: scripts/gpu_pack.sh).
inline std::string dir_setting(const char* env, const char* compiled) {
  const char* v = std::getenv(env);
  return v && *v ? std::string(v) : std::string(compiled);
}
/// Path inside ../shared (the real models, tokenizers, reference outputs).
inline std::string shared(const std::string& rel) { return dir_setting("LLMQ_SHARED_DIR", LLMQ_SHARED_DIR) + "/" + rel; }
/// Path of a built tool, e.g. bin("llmq-run").
inline std::string bin(const std::string& name) { return dir_setting("LLMQ_BIN_DIR", LLMQ_BIN_DIR) + "/" + name; }
/// Regular entries of `dir` whose name ends in `ext` (e.g. ".llmq").
inline long files_with_extension(const std::string& dir, const std::string& ext) {
  long n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ext;
  return n;
}
/// This process's scratch root, LLMQ_TEST_TMP/<pid> (CTest runs test cases as parallel
/// processes), removed when the process exits.
inline const std::filesystem::path& scratch_root() {
  struct Root {
    std::filesystem::path path = std::filesystem::path(dir_setting("LLMQ_TEST_TMP", LLMQ_TEST_TMP)) / std::to_string(::getpid());
    ~Root() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Root root;
  return root.path;
}

/// A fresh scratch folder for one test (removed and re-created), private to this process.
inline std::string scratch(const std::string& name) {
  std::filesystem::path p = scratch_root() / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

/// Runs a shell command; returns its exit status (-1 if it died from a signal).
inline int run(const std::string& cmd) {
  const int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// What llmq-run printed for `model` with LLMQ_CACHE=`cache` (engine/runner/model_file.h): its
/// exit code, stdout and stderr (written to `stem`.out and `stem`.err); greedy, one thread.
struct CachedRun {
  int code;
  std::string out, err;
};
inline CachedRun run_with_cache(const std::string& cache, const std::string& model, const std::string& prompt, int n,
                                const std::string& stem) {
  const int code = run("LLMQ_CACHE='" + cache + "' timeout 20 " + bin("llmq-run") + " -m '" + model + "' -p '" + prompt + "' -n " +
                       std::to_string(n) + " --temp 0 -t 1 >'" + stem + ".out' 2>'" + stem + ".err'");
  auto read = [](const std::string& f) {
    std::ifstream in(f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  return {code, read(stem + ".out"), read(stem + ".err")};
}

/// argv as the null-terminated char* array execv takes (pointing into `argv`, which must outlive it).
inline std::vector<char*> exec_args(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  return args;
}

/// In a child about to exec a tool: stdin and stdout on /dev/null, stderr to err_fd (or also
/// /dev/null when err_fd < 0).
inline void child_stdio(int err_fd) {
  const int null = open("/dev/null", O_RDWR);
  dup2(null, 0);
  dup2(null, 1);
  dup2(err_fd >= 0 ? err_fd : null, 2);
}

/// Caps the memory of a child process about to exec a tool (call between fork and exec), so a
/// file that makes a tool allocate absurdly fails fast (std::bad_alloc) instead of swapping:
/// normally an address-space limit of 4 GiB (RLIMIT_AS). AddressSanitizer reserves terabytes
/// of address space for its shadow memory and cannot start under such a limit, so in a
/// sanitizer build (LLMQ_SANITIZED) the tool's ASan allocator gets the same 4 GiB cap instead
/// (max_allocation_size_mb, allocator_may_return_null: an over-large allocation throws
/// std::bad_alloc as under the rlimit).
inline void cap_child_memory() {
#ifdef LLMQ_SANITIZED
  const char* old = std::getenv("ASAN_OPTIONS");
  std::string opts = old && *old ? std::string(old) + ":" : std::string();
  opts += "max_allocation_size_mb=4096:allocator_may_return_null=1";
  setenv("ASAN_OPTIONS", opts.c_str(), 1);
#else
  const rlimit as{rlim_t(4) << 30, rlim_t(4) << 30};
  setrlimit(RLIMIT_AS, &as);
#endif
}

/// How a tool run by run_tool ended.
struct ToolRun {
  bool exited = false;
  int code = -1;
  int sig = 0;
  bool timed_out = false;
  uint64_t max_rss_kib = 0;  ///< the child's peak resident set (getrusage via wait4)
  std::string err;           ///< its stderr
  std::string describe() const {
    return (timed_out ? std::string("timed out") : exited ? "exit " + std::to_string(code) : "signal " + std::to_string(sig)) +
           "; stderr: " + err;
  }
};

/// Runs argv (no shell) with stdin and stdout on /dev/null and stderr captured, under
/// cap_child_memory() and a time limit (then SIGKILL); reports the exit and the child's peak RSS.
inline ToolRun run_tool(const std::vector<std::string>& argv, double timeout_s = 30.0) {
  static int counter = 0;
  const std::string err_path = (scratch_root() / ("tool_stderr_" + std::to_string(getpid()) + "_" + std::to_string(++counter))).string();
  std::filesystem::create_directories(scratch_root());
  std::vector<char*> args = exec_args(argv);
  const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    child_stdio(err_fd);
    cap_child_memory();
    execv(args[0], args.data());
    _exit(127);
  }
  close(err_fd);
  ToolRun r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  rusage ru{};
  while (wait4(pid, &status, WNOHANG, &ru) != pid) {
    if (std::chrono::steady_clock::now() > deadline && !r.timed_out) {
      kill(pid, SIGKILL);
      r.timed_out = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  r.max_rss_kib = uint64_t(ru.ru_maxrss);
  if (WIFEXITED(status) && !r.timed_out) r.exited = true, r.code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.sig = WTERMSIG(status);
  std::ifstream in(err_path, std::ios::binary);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  std::filesystem::remove(err_path);
  return r;
}

/// A seed from std::random_device: fresh random inputs every run (print it with INFO so a
/// failure can be replayed).
inline uint64_t fresh_seed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) | rd();
}

/// RoPE's plain frequencies θ^(-2i/hd) [hd/2] (ModelConfig::rope_freqs of a Llama).
inline std::vector<double> rope_freqs(int64_t hd, double theta = 10000.0) {
  ModelConfig c;
  c.head_dim = hd, c.rope_theta = theta, c.n_layers = 1;
  return c.rope_freqs(0);
}

/// n samples of N(0, 1).
inline std::vector<float> gaussian(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// A random weight matrix [rows, cols] (N(0, 1) values) stored in type t, owning its bytes.
struct RandomWeight {
  std::vector<uint8_t> bytes;
  Weight w;
  RandomWeight(DType t, int64_t rows, int64_t cols, std::mt19937_64& rng) {
    const size_t rb = row_bytes(t, cols);
    bytes.resize(rb * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> x = gaussian(size_t(cols), rng);
      quantize_row(t, x.data(), bytes.data() + size_t(r) * rb, cols);
    }
    w = Weight{t, bytes.data(), rows, cols};
  }
};

/// ||a - ref|| / ||ref|| in fp64 (the relative error every kernel test states a bound for).
inline double rel_err(const float* a, const float* ref, size_t n) {
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return std::sqrt(e / r);
}

/// stories260K (../shared) converted by the real llmq-convert to `type`, once per test run.
inline std::string stories(const std::string& type) {
  static std::map<std::string, std::string> done;
  auto it = done.find(type);
  if (it != done.end()) return it->second;
  static const std::string dir = scratch("stories");
  const std::string out = dir + "/stories260K-" + type + ".llmq";
  const std::string cmd = bin("llmq-convert") + " " + shared("models/stories260K/stories260K.bin") + " --tokenizer " +
                          shared("models/stories260K/tok512.bin") + " --type " + type + " -o " + out + " -f 2>/dev/null";
  if (run(cmd) != 0) throw std::runtime_error("conversion failed: " + cmd);
  return done[type] = out;
}

// A model of config c with random weights (matrices uniform, scaled by 1/sqrt(fan-in), stored as
// `type`; norm weights near 1; biases in [-0.5, 0.5)) and the 512-token vocabulary of
// stories260K (c.vocab_size must be 512), written to the scratch directory as NAME.llmq.
inline std::string random_model(const std::string& name, const ModelConfig& c, DType type, uint32_t seed) {
  static const std::string dir = test::scratch("random_models");
  const std::string path = dir + "/" + name + ".llmq";
  auto src = LlmqFile::open(test::stories("f32"));
  LlmqWriter w(path, true);
  w.meta = src->meta();  // the tokenizer keys
  c.to_metadata(w.meta);
  const std::vector<TensorSpec> table = tensor_table(c);
  for (const TensorSpec& t : table) w.declare(t.name, t.shape.size() == 1 ? DType::F32 : type, t.shape);
  w.begin();
  std::mt19937 rng(seed);
  for (size_t i = 0; i < table.size(); ++i) {
    const auto& shape = table[i].shape;
    const int64_t rows = shape.size() == 1 ? 1 : shape[0], cols = shape.back();
    const float a = shape.size() == 1 ? 0.0f : float(std::sqrt(3.0 / double(cols)));
    std::uniform_real_distribution<float> u(-a, a);
    std::vector<float> x(size_t(rows * cols));
    const bool bias = table[i].name.find(".bias") != std::string::npos;
    for (float& v : x)
      v = shape.size() > 1 ? u(rng) : bias ? float(rng() % 1000) / 1000.0f - 0.5f : 1.0f + 0.2f * (float(rng() % 1000) / 1000.0f - 0.5f);
    std::vector<uint8_t> bytes(w.tensors()[i].nbytes);
    const DType t = shape.size() == 1 ? DType::F32 : type;
    for (int64_t r = 0; r < rows; ++r) quantize_row(t, x.data() + r * cols, bytes.data() + size_t(r) * row_bytes(t, cols), cols);
    w.write_tensor(i, bytes.data(), bytes.size());
  }
  w.finish();
  return path;
}

// A synthetic Llama model (random_model): 3 layers, untied output, context 256.
inline std::string synthetic(const std::string& name, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t hidden,
                             DType type, uint32_t seed, bool biases = false) {
  ModelConfig c;
  c.n_heads = n_heads, c.n_kv_heads = n_kv_heads, c.head_dim = head_dim, c.dim = n_heads * head_dim;
  c.hidden_dim = hidden, c.n_layers = 3, c.vocab_size = 512, c.context_length = 256;
  c.tied_embeddings = false;
  c.attn_qkv_bias = c.attn_out_bias = biases;  // with biases: Qwen2's q/k/v and Llama's o
  return random_model(name, c, type, seed);
}

}  // namespace llmq::test
