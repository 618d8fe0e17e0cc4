// Where the forward pass runs: `--device cpu|cuda|auto` on every tool.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "engine/model.h"

namespace llmq {

class MpiComm;  // engine/parallel/comm_mpi.h

enum class Device { Cpu, Cuda };

/// Where a model's layers run, as the tools choose it (--device, --gpu-layers, --tp): what
/// decides how the model is loaded (which matrices the CPU kernels pack, engine/model.h).
struct Placement {
  Device device = Device::Cpu;
  int64_t gpu_layers = -1;    ///< with Cuda: the last N layers and the output on the GPU, the others on the CPU; < 0: all on the GPU
  int tp = 1;                 ///< tensor-parallel ranks (CPU: rank threads or processes; CUDA: GPU ranks)
  bool whole_panels = false;  ///< CPU, tp > 1: pack the whole model's panels too (llmq-bench's TP = 1 baseline)
  int64_t ctx = 0;            ///< KV positions per sequence (0: the model's, capped): LongRoPE's factors depend on it
};

/// The tools' one loading path: Model::load(model_file_for(path), verify, ...) (a GGUF through
/// its cached conversion, engine/runner/model_file.h) with the packing `p` needs. CPU:
/// every matrix (tp > 1 without whole_panels: each rank packs its own slices of the attention
/// output and FFN down, so the model's are left unpacked); CUDA: none, but the first layers'
/// under partial offload (gpu_layers >= 0), which the CPU runs. Throws as Model::load.
std::unique_ptr<Model> load_model(const std::string& path, bool verify, const Placement& p);

/// True when this build has the CUDA backend (engine/cuda/, built whenever nvcc was found).
bool cuda_built();
/// Number of CUDA devices usable now (0 in a CPU-only build, without a driver or a GPU).
int cuda_device_count();

/// "cpu", "cuda" or "auto" (auto: CUDA when the build has it and a GPU is present, else the
/// CPU). Throws UsageError for "cuda" when the build has no CUDA backend or no GPU is present
/// (the message says which), and for any other name.
Device pick_device(const std::string& name);
const char* device_name(Device d);  ///< "cpu" | "cuda"
/// Free memory of GPU 0 in bytes after creating the CUDA context there (cudaMemGetInfo), for
/// planning (--gpu-layers auto). Throws UsageError without the CUDA backend or a GPU.
uint64_t cuda_free_bytes();

/// The model's weights uploaded to GPU 0 and one sequence there (engine/cuda/session.h), as
/// one session object that owns both. ctx, n_batch, logits_rows as Session. Prints the device
/// and its memory at load on stderr: weights, KV cache, workspace, each as allocated, and
/// the device memory the load took, measured (cudaMemGetInfo before and after), beside the
/// CUDA context's own (measured before loading). gpu_layers in [0, n_layers) (partial offload,
/// llama.cpp's -ngl): only the last gpu_layers layers and the output go to the GPU, the CPU
/// runs the others on `pool` (cuda::CudaOffloadSession; load m with pack_layers = n_layers -
/// gpu_layers); < 0 or n_layers: the whole model on the GPU. tp > 1: tensor parallelism, tp
/// ranks all on GPU 0 with a host communicator (cuda::CudaTpSession; m loaded unpacked). Throws
/// UsageError in a build without CUDA, for gpu_layers > n_layers, partial offload without a
/// pool or with tp > 1, ranks that cannot be formed, kv_q8 (a Q8_0 KV cache) with a head_dim
/// that is no multiple of 32; CudaError (a std::runtime_error) when the model does not fit.
std::unique_ptr<SessionBase> make_cuda_session(const Model& m, int64_t ctx, int64_t n_batch = 512, int64_t logits_rows = 1,
                                               bool progress = true, int64_t gpu_layers = -1, ThreadPool* pool = nullptr, int tp = 1,
                                               bool kv_q8 = false);

/// llmq-server's forward passes on GPU 0 (cuda::CudaBatchRunner): the weights uploaded and a
/// paged KV cache for `parallel` sequences of up to ctx tokens (kv_tokens as SchedulerOptions).
/// Prints the device and its memory at load as make_cuda_session does. tp > 1: tensor-parallel
/// ranks as make_cuda_session's; gpu_layers in [0, n_layers) with `pool`: partial offload
/// (cuda::CudaOffloadBatchRunner). Throws as make_cuda_session.
std::unique_ptr<BatchRunner> make_cuda_batch_runner(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel,
                                                    int64_t kv_tokens = 0, bool progress = true, int tp = 1, int64_t gpu_layers = -1,
                                                    ThreadPool* pool = nullptr, bool kv_q8 = false);

/// Rank comm.rank() of comm.size() tensor-parallel ranks in as many processes of an MPI job
/// (engine/parallel/tp_process.h), on the GPU: this rank's shard uploaded to GPU comm.local_rank()
/// mod the GPUs present (one GPU per rank on each machine), with a paged KV cache for `parallel`
/// sequences of up to ctx tokens (as make_cuda_batch_runner: its make_cache and forward are those
/// of one rank; rank 0 returns the logits). The all-reduce runs over NCCL, rank 0 making the
/// unique id and broadcasting it over comm (MPI; every rank calls this at once:
/// ncclCommInitRank waits for all), or, where rank 0's build has no NCCL or LLMQ_TP_COMM=host is
/// set there, over comm itself (MPI) through host memory. comm must outlive the runner. Rank 0
/// prints its GPU and memory. Throws as make_cuda_batch_runner, and UsageError when rank 0 chose
/// NCCL and this build has none.
std::unique_ptr<BatchRunner> make_cuda_rank_runner(const Model& m, MpiComm& comm, int64_t ctx, int64_t n_batch, int64_t parallel,
                                                   int64_t kv_tokens = 0, bool progress = false, bool kv_q8 = false);

}  // namespace llmq
