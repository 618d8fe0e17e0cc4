#include "cli/cli_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/runner/device.h"
#include "base/error.h"
#include "formats/llmq_file.h"

#include <sched.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "base/error.h"
#include "formats/llmq_file.h"
#include "formats/readers/tokenizer_files.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"

namespace llmq::cli {

namespace {

// The error's line: "tool: error: what", under mpirun on a rank other than 0 "tool: rank R: error: what".
void print_error(const char* tool, const char* what, const char* extra = "") {
  const int rank = mpi_launch_size() != 0 ? mpi_launch_rank() : 0;
  if (rank > 0) std::fprintf(stderr, "%s: rank %d: error: %s%s\n", tool, rank, extra, what);
  else std::fprintf(stderr, "%s: error: %s%s\n", tool, extra, what);
  std::fflush(stderr);
}

}  // namespace

int run_guarded(const char* tool, const std::function<int()>& body) {
  int code = kOk;
  try {
    return body();
  } catch (const FileError& e) {
    print_error(tool, e.what());
    code = kBadFile;
  } catch (const MetadataError& e) {
    print_error(tool, e.what(), "bad model metadata: ");
    code = kBadFile;
  } catch (const std::bad_alloc&) {  // an input that asks for more memory than there is: exit 2 (issue 22 item 9)
    print_error(tool, "out of memory (the model, file or sizes asked for more than this machine gives)");
    code = kBadFile;
  } catch (const std::exception& e) {
    print_error(tool, e.what());
    code = kUsage;
  }
  abort_mpi_job_if_running(code);  // a rank of an MPI job: the others must not wait for this one
  return code;
}

uint64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return uint64_t(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

Vocab load_tokenizer_file(const std::string& path, int64_t expected_vocab) {
  const bool spm = path.size() >= 6 && path.compare(path.size() - 6, 6, ".model") == 0;
  return spm ? read_sentencepiece_model(path) : read_llama2c_tokenizer(path, int32_t(expected_vocab));
}

int64_t resolve_gpu_layers(const char* tool, const std::string& spec, bool cuda, const std::string& model_path,
                           const mem::InferOptions& o, const std::string& budget_s) {
  if (spec == "all") return -1;
  if (!cuda) throw UsageError("--gpu-layers needs --device cuda (or auto with a GPU)");
  auto f = LlmqFile::open(model_path, false);
  const ModelConfig c = mem::file_config(*f);
  if (spec == "auto") {  // the plan of llmq-mem infer --device cuda --fit
    const double budget = budget_s.empty() ? double(cuda_free_bytes()) : mem::parse_size(budget_s);
    const int64_t n = mem::fit_gpu_layers(*f, c, o, budget);
    if (n < 0) throw UsageError("--gpu-layers auto: not even the output layer fits in " + human_bytes(uint64_t(budget)));
    std::fprintf(stderr, "%s: --gpu-layers auto: %lld of %lld layers on the GPU (%s to plan for)\n", tool, (long long)n,
                 (long long)c.n_layers, human_bytes(uint64_t(budget)).c_str());
    return n;
  }
  int64_t n = -1;
  try {
    size_t used = 0;
    n = std::stoll(spec, &used);
    if (used != spec.size() || n < 0) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw UsageError("--gpu-layers must be a number of layers, 'auto' or 'all', not '" + spec + "'");
  }
  if (n > c.n_layers) throw UsageError("--gpu-layers " + spec + ": the model has " + std::to_string(c.n_layers) + " layers");
  return n;
}

std::string describe_rank(const ModelShard& s, int threads) {
  const ShardRanges& R = s.ranges;
  char line[400];
  std::snprintf(line, sizeof line, "rank %d: %d threads, heads %lld-%lld, KV heads %lld-%lld, FFN %lld-%lld, vocab %lld-%lld, weights %s (%s copied)",
                R.rank, threads, (long long)R.head0, (long long)(R.head0 + R.n_heads - 1), (long long)R.kv_head0,
                (long long)(R.kv_head0 + R.n_kv_heads - 1), (long long)R.ffn0, (long long)(R.ffn0 + R.ffn_dim - 1), (long long)R.vocab0,
                (long long)(R.vocab0 + R.n_vocab - 1), human_bytes(s.weight_bytes()).c_str(), human_bytes(s.owned_bytes).c_str());
  return line;
}

void check_tp_flags(int tp, bool partial) {
  const int n = mpi_launch_size();
  if (n == 0 || n == 1) return;  // not a rank of an MPI job (or its only process): ranks as threads
  if (partial) throw UsageError("mpirun with --gpu-layers: a rank runs all its layers on one device (the CPU or a GPU)");
  if (n > 1 && tp != n)
    throw UsageError("mpirun started " + std::to_string(n) + " processes, one tensor-parallel rank each: give --tp " + std::to_string(n) +
                     " (not --tp " + std::to_string(tp) + "), or mpirun -np " + std::to_string(tp));
}

std::unique_ptr<MpiComm> start_mpi_group(int tp, bool partial) {
  check_tp_flags(tp, partial);
  const int n = mpi_launch_size();
  if (n == 0 || n == 1) return nullptr;
  std::unique_ptr<MpiComm> c = MpiComm::init_world();
  if (c->size() != tp)
    throw UsageError("the MPI job has " + std::to_string(c->size()) + " processes, one tensor-parallel rank each: give --tp " +
                     std::to_string(c->size()));
  return c;
}

namespace {

// Rank 0's runner settings and the model's signature, as JSON.
std::string settings_json(const Model& m, const RunnerOptions& o, int tp) {
  return nlohmann::json{{"cuda", o.place.device == Device::Cuda}, {"capacity", o.capacity}, {"ctx", o.ctx}, {"n_batch", o.n_batch},
                        {"parallel", std::max<int64_t>(1, o.parallel)}, {"kv_tokens", o.kv_tokens}, {"kv_q8", o.gpu_kv_q8},
                        {"signature", tp_signature(m, tp)}}
      .dump();
}

// -t's default for a rank of an MPI job: the CPUs mpirun bound it to or, unbound (it may run on
// every CPU), this machine's CPUs shared among the job's ranks on it.
int mpi_rank_threads(const MpiComm& c) {
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : hw;
  return mine < hw ? std::max(1, mine) : std::max(1, hw / std::max(1, c.local_size()));
}

// A following rank: rank 0's settings into o, checked against this rank's model and device; a
// mismatch ends the job with a message that says which.
void take_settings(MpiComm& c, const Model& m, RunnerOptions& o) {
  const std::vector<uint8_t> msg = c.recv_broadcast();
  RunnerOptions got = o;
  bool got_cuda = false;
  std::string sig;
  try {
    const nlohmann::json j = nlohmann::json::parse(msg.begin(), msg.end());
    got_cuda = j.at("cuda").get<bool>(), got.capacity = j.at("capacity").get<int64_t>(), got.ctx = j.at("ctx").get<int64_t>();
    got.n_batch = j.at("n_batch").get<int64_t>(), got.parallel = j.at("parallel").get<int64_t>();
    got.kv_tokens = j.at("kv_tokens").get<int64_t>(), got.gpu_kv_q8 = j.at("kv_q8").get<bool>(), sig = j.at("signature").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    c.abort_job(std::string("tensor parallel: rank 0's settings are malformed: ") + e.what());
  }
  if (got.capacity < 1 || got.capacity > (1 << 24) || got.n_batch < 1 || got.parallel < 1 || got.ctx < 0 || got.kv_tokens < 0)
    c.abort_job("tensor parallel: rank 0's settings are out of range");
  if (const std::string mine = tp_signature(m, c.size()); sig != mine)
    c.abort_job("tensor parallel: this rank's model differs from rank 0's (rank " + std::to_string(c.rank()) + ": " + mine + "; rank 0: " + sig +
                "): every host needs the same model file");
  const bool cuda = o.place.device == Device::Cuda;
  if (got_cuda != cuda)
    c.abort_job(std::string("tensor parallel: rank 0 runs on ") + (got_cuda ? "a GPU" : "the CPU") + ", this rank on " +
                (cuda ? "a GPU" : "the CPU") + ": give every rank the same --device");
  o = got;
}

}  // namespace

void join_tp_group(MpiComm* c, const Model& m, RunnerOptions& o) {
  if (!c) return;
  plan_shards(m, c->size());  // a split the model cannot take fails here, on every rank alike
  if (o.threads <= 0) o.threads = mpi_rank_threads(*c);  // each rank its own (not sent)
  if (c->rank() == 0) {
    o = resolve(m, o);
    const std::string j = settings_json(m, o, c->size());
    c->broadcast(j.data(), j.size());
  } else {
    take_settings(*c, m, o);
  }
  // Every rank took the settings (one that did not ended the job) before rank 0 goes on to
  // build its runner and, for GPU ranks, wait in NCCL's initialisation.
  c->barrier();
  o.group = c;
}

std::unique_ptr<Runner> make_tool_runner(const char* tool, const Model& m, const RunnerOptions& o) {
  std::unique_ptr<Runner> r = make_runner(m, o);
  if (o.group && o.group->rank() > 0) return r;  // only rank 0 prints
  if (const TensorParallel* t = r->cpu_ranks(); t && (o.group || t->size() > 1)) {
    if (o.group)
      std::fprintf(stderr, "%s: tensor parallel over %d MPI processes; %s\n", tool, o.group->size(), describe_rank(t->shard(0), t->threads()).c_str());
    else
      std::fprintf(stderr, "%s: tensor parallel over %d ranks, %d threads in all\n", tool, t->size(), t->threads());
    for (int i = 0; !o.group && i < t->size(); ++i) std::fprintf(stderr, "  %s\n", describe_rank(t->shard(i), t->rank_threads(i)).c_str());
  }
  return r;
}


}  // namespace llmq::cli
