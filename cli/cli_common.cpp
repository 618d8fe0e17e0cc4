#include "cli/cli_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/runner/device.h"
#include "base/error.h"
#include "formats/llmq_file.h"

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>

#include "base/error.h"
#include "formats/llmq_file.h"
#include "formats/readers/tokenizer_files.h"
#include "engine/parallel/comm_socket.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"

namespace llmq::cli {

int run_guarded(const char* tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const FileError& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return kBadFile;
  } catch (const MetadataError& e) {
    std::fprintf(stderr, "%s: error: bad model metadata: %s\n", tool, e.what());
    return kBadFile;
  } catch (const std::bad_alloc&) {  // an input that asks for more memory than there is: exit 2 (issue 22 item 9)
    std::fprintf(stderr, "%s: error: out of memory (the model, file or sizes asked for more than this machine gives)\n", tool);
    return kBadFile;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return kUsage;
  }
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

void add_tp_process_flags(CLI::App& app, std::string& init, int& rank, const std::string& rank0) {
  app.add_option("--tp-init", init,
                 "run the --tp ranks as separate processes (on one machine or several; CPU, or a GPU each), joined here: "
                 "tcp://HOST:PORT (rank 0 listens there) or file://PATH (rank 0 writes its address there; a file system the "
                 "machines share). LLMQ_TP_TIMEOUT: seconds to wait for the others (300)");
  app.add_option("--tp-rank", rank,
                 "this process's rank with --tp-init: 0 " + rank0 + "; each other rank (0 < R < N; llmq-run or llmq-server "
                 "started with the same model, --tp and --device; its sizes come from rank 0) runs its slice of every layer for "
                 "rank 0 and exits when rank 0 is done");
}

void check_tp_flags(const std::string& init, int rank, int tp, bool partial) {
  if (init.empty()) {
    if (rank != 0) throw UsageError("--tp-rank needs --tp-init (the rendezvous of the processes)");
    return;
  }
  if (partial) throw UsageError("--tp-init with --gpu-layers: a rank runs all its layers on one device (the CPU or a GPU)");
  if (tp < 2) throw UsageError("--tp-init joins --tp N >= 2 processes");
  if (init.rfind("tcp://", 0) != 0 && init.rfind("file://", 0) != 0)
    throw UsageError("--tp-init '" + init + "': expected tcp://HOST:PORT or file://PATH");
  if (rank < 0 || rank >= tp)
    throw UsageError("--tp-rank " + std::to_string(rank) + " is not a rank of --tp " + std::to_string(tp) + " (0 .. " + std::to_string(tp - 1) + ")");
}

std::unique_ptr<SocketComm> join_tp_group(const char* tool, const std::string& init, int rank, int tp, const Model& m,
                                          RunnerOptions& o, const std::atomic<bool>* cancel) {
  check_tp_flags(init, rank, tp);
  if (init.empty()) return nullptr;
  plan_shards(m, tp);  // a split the model cannot take fails here, before waiting for the others
  double secs = 300;
  if (const char* e = std::getenv("LLMQ_TP_TIMEOUT")) {
    char* end = nullptr;
    secs = std::strtod(e, &end);
    if (end == e || *end || !(secs > 0) || secs > 1e6) throw UsageError(std::string("LLMQ_TP_TIMEOUT must be a number of seconds, not '") + e + "'");
  }
  std::fprintf(stderr, "%s: rank %d of %d joining through %s\n", tool, rank, tp, init.c_str());
  std::unique_ptr<SocketComm> c = SocketComm::join(init, rank, tp, tp_signature(m, tp), std::chrono::milliseconds(int64_t(secs * 1000)), cancel);
  // Rank 0's runner settings, as JSON.
  const bool cuda = o.place.device == Device::Cuda;
  if (rank == 0) {
    o = resolve(m, o);
    const std::string j = nlohmann::json{{"cuda", cuda}, {"capacity", o.capacity}, {"ctx", o.ctx}, {"n_batch", o.n_batch},
                                         {"parallel", std::max<int64_t>(1, o.parallel)}, {"kv_tokens", o.kv_tokens}, {"kv_q8", o.gpu_kv_q8}}
                              .dump();
    c->broadcast(j.data(), j.size());
  } else {
    const std::vector<uint8_t> msg = c->recv_broadcast();
    RunnerOptions got = o;
    bool got_cuda = false;
    try {
      const nlohmann::json j = nlohmann::json::parse(msg.begin(), msg.end());
      got_cuda = j.at("cuda").get<bool>(), got.capacity = j.at("capacity").get<int64_t>(), got.ctx = j.at("ctx").get<int64_t>();
      got.n_batch = j.at("n_batch").get<int64_t>(), got.parallel = j.at("parallel").get<int64_t>();
      got.kv_tokens = j.at("kv_tokens").get<int64_t>(), got.gpu_kv_q8 = j.at("kv_q8").get<bool>();
    } catch (const nlohmann::json::exception& e) {
      c->abort();
      throw UsageError(std::string("tensor parallel: rank 0's settings are malformed: ") + e.what());
    }
    if (got.capacity < 1 || got.capacity > (1 << 24) || got.n_batch < 1 || got.parallel < 1 || got.ctx < 0 || got.kv_tokens < 0) {
      c->abort();
      throw UsageError("tensor parallel: rank 0's settings are out of range");
    }
    if (got_cuda != cuda) {
      c->abort();
      throw UsageError(std::string("tensor parallel: rank 0 runs on ") + (got_cuda ? "a GPU" : "the CPU") + ": start rank " +
                       std::to_string(rank) + " with --device " + (got_cuda ? "cuda" : "cpu"));
    }
    o = got;
  }
  // Every rank took the settings (one that did not aborted the group: rank 0 hears it here,
  // before it goes on to build its runner and wait in NCCL's initialisation).
  c->barrier();
  o.group = c.get();
  std::fprintf(stderr, "%s: rank %d of %d joined\n", tool, rank, tp);
  return c;
}

std::unique_ptr<Runner> make_tool_runner(const char* tool, const Model& m, const RunnerOptions& o) {
  std::unique_ptr<Runner> r = make_runner(m, o);
  if (const TensorParallel* t = r->cpu_ranks(); t && (o.group || t->size() > 1)) {
    if (o.group)
      std::fprintf(stderr, "%s: tensor parallel over %d processes; %s\n", tool, o.group->size(), describe_rank(t->shard(0), t->threads()).c_str());
    else
      std::fprintf(stderr, "%s: tensor parallel over %d ranks, %d threads in all\n", tool, t->size(), t->threads());
    for (int i = 0; !o.group && i < t->size(); ++i) std::fprintf(stderr, "  %s\n", describe_rank(t->shard(i), t->rank_threads(i)).c_str());
  }
  return r;
}

int serve_tp_rank(const char* tool, Runner& r) {
  std::fprintf(stderr, "%s: rank %d serving rank 0\n", tool, r.group_rank());
  r.serve();
  std::fprintf(stderr, "%s: rank %d done (rank 0 stopped)\n", tool, r.group_rank());
  return 0;
}

}  // namespace llmq::cli
