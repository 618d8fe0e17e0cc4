// What every command-line tool shares: exit codes, error reporting, peak memory.
#pragma once
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
class MpiComm;
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
/// FileError and MetadataError -> 2, anything else -> 1. `tool` prefixes the message (under
/// mpirun, on ranks other than 0, with "rank R: "). Where MPI is running (this process is a rank
/// of an MPI job), an error then ends the whole job (MPI_Abort): no rank is left waiting.
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

/// Checks --tp against the MPI job that started this process, before anything is loaded: under
/// mpirun with N > 1 processes (engine/parallel/comm_mpi.h: mpi_launch_size) --tp must be N and
/// the layers all on one device (`partial`: some on the CPU, some on a GPU, is refused). Throws
/// UsageError with the mpirun line to use. Without mpirun (or with -np 1) there is nothing to
/// check: --tp N runs N rank threads in this process.
void check_tp_flags(int tp, bool partial = false);

/// Under mpirun with N > 1 processes: check_tp_flags, then MPI initialised (MpiComm::init_world;
/// call it from the main thread) and this process's rank of the job returned; nullptr without
/// mpirun. Throws UsageError when the job's size differs from --tp.
std::unique_ptr<MpiComm> start_mpi_group(int tp, bool partial = false);

/// With a group (start_mpi_group): rank 0 sends its runner's sizes (`o` resolved: ctx, n_batch,
/// capacity, parallel, kv_tokens, the GPU's KV type) and the model's signature (tp_signature);
/// the others receive them into `o` (so an llmq-run rank serves an llmq-server's rank 0 as well
/// as an llmq-run's), must have loaded the same model and run on the same kind of device
/// (otherwise the job ends, MpiComm::abort_job, with a message that says which). Sets o.group.
/// Without -t (o.threads 0) a rank takes the CPUs mpirun bound it to or, unbound, this
/// machine's CPUs divided among the job's ranks on it. Does nothing without a group. Throws
/// UsageError when the model cannot be split over the ranks (engine/tp.h plan_shards).
void join_tp_group(MpiComm* group, const Model& m, RunnerOptions& o);

/// make_runner, then on stderr the CPU ranks' layout (one line per rank this process holds; of
/// an MPI group, rank 0's line only: the other ranks print nothing).
std::unique_ptr<Runner> make_tool_runner(const char* tool, const Model& m, const RunnerOptions& o);

}  // namespace llmq::cli
