// What every command-line tool shares: exit codes, error reporting, peak memory.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "formats/vocab.h"
#include "engine/runner/runner.h"
#include "mem/infer.h"

namespace CLI {
class App;
}  // namespace CLI

namespace llmq {
class BatchRunner;
class Model;
class SocketComm;
struct ModelShard;
}  // namespace llmq

/// Parses the command line like CLI11_PARSE, but a usage error exits 1 (help still exits 0),
/// so every tool has the documented exit codes. Include <CLI/CLI.hpp> first.
#define LLMQ_CLI_PARSE(app, argc, argv)            \
  try {                                            \
    (app).parse((argc), (argv));                   \
  } catch (const CLI::ParseError& e) {             \
    return (app).exit(e) == 0 ? 0 : 1;             \
  }

namespace llmq::cli {

/// Exit codes: 0 ok, 1 usage or runtime error, 2 bad input file (FileError/MetadataError).
enum ExitCode { kOk = 0, kUsage = 1, kBadFile = 2 };

/// Runs body() and maps exceptions to one clear line on stderr and an exit code:
/// FileError and MetadataError -> 2, anything else -> 1. `tool` prefixes the message.
int run_guarded(const char* tool, const std::function<int()>& body);

/// Peak resident memory of this process in bytes (getrusage ru_maxrss).
uint64_t peak_rss_bytes();

/// "1.23 MiB" style formatting of a byte count.
std::string human_bytes(uint64_t bytes);

/// Loads a tokenizer file: a SentencePiece `tokenizer.model` (protobuf, by extension `.model`)
/// or a llama2.c `tokenizer.bin` (expected_vocab tokens, -1 = until end of file).
Vocab load_tokenizer_file(const std::string& path, int64_t expected_vocab);

/// --gpu-layers N|auto|all (partial offload, engine/cuda/session.h): -1 for "all", N, or for
/// "auto" the most layers whose GPU plan (llmq-mem's fit_gpu_layers for the options o: one
/// sequence, or llmq-server's when o.parallel > 1 or o.server) fits `budget` (a size; empty:
/// the GPU's free memory), printed on stderr as `tool`. Throws UsageError for a malformed
/// value, more layers than the model has, "auto" when nothing fits, or N without cuda.
int64_t resolve_gpu_layers(const char* tool, const std::string& spec, bool cuda, const std::string& model_path,
                           const mem::InferOptions& o, const std::string& budget);

/// One line on a tensor-parallel rank: its threads, heads, KV heads, FFN units, vocabulary rows
/// and weight bytes (copied: the row-parallel slices it owns).
std::string describe_rank(const ModelShard& s, int threads);

/// Adds --tp-init and --tp-rank (tensor-parallel ranks as processes) to `app`; `rank0` says
/// what rank 0 does in this tool ("generates", "serves HTTP").
void add_tp_process_flags(CLI::App& app, std::string& init, int& rank, const std::string& rank0);

/// Checks --tp-init / --tp-rank against --tp before anything is loaded: throws UsageError for
/// --tp-rank without --tp-init, --tp-init with --tp < 2, with partial offload (`partial`: some
/// layers on the CPU, some on a GPU) or without a tcp:// or file:// address, a rank outside
/// 0 .. tp-1.
void check_tp_flags(const std::string& init, int rank, int tp, bool partial = false);

/// --tp-init / --tp-rank: joins this process as rank `rank` of `tp` processes through the
/// rendezvous `init` (engine/parallel/comm_socket.h), after check_tp_flags; nullptr without --tp-init.
/// Every rank must use the same model (a rank with another is refused). Rank 0 then sends its
/// runner's sizes (`o` resolved: ctx, n_batch, capacity, parallel, kv_tokens, the GPU's KV
/// type); the others receive them into `o` (so an llmq-run rank serves an llmq-server's rank 0
/// as well as an llmq-run's) and must run on the same kind of device. Sets o.group. Waits
/// LLMQ_TP_TIMEOUT seconds (default 300) for the other ranks, or until *cancel is set
/// (llmq-server stopping). Prints who joined. Throws UsageError for bad flags, a refused hello,
/// a device that differs from rank 0's, the timeout or cancel.
std::unique_ptr<SocketComm> join_tp_group(const char* tool, const std::string& init, int rank, int tp, const Model& m,
                                          RunnerOptions& o, const std::atomic<bool>* cancel = nullptr);

/// make_runner, then on stderr the CPU ranks' layout (one line per rank this process holds),
/// and for a following rank of a process group that it serves rank 0.
std::unique_ptr<Runner> make_tool_runner(const char* tool, const Model& m, const RunnerOptions& o);

/// A following rank: runs rank 0's forward passes until rank 0 is done; prints the end on
/// stderr. Returns the exit code (0).
int serve_tp_rank(const char* tool, Runner& r);

}  // namespace llmq::cli
