// The CUDA backend as device.cpp reaches it: one table of entry points (issue 23 item 4).
//
// The backend (engine/runner/cuda_backend.cpp over engine/cuda/) is built two ways:
//  - as the plugin `libllmq-cuda.so` beside the tools, which device.cpp opens with dlopen the
//    first time a tool asks for a GPU (`--device cuda|auto`, --gpu-layers auto): a CPU run
//    neither maps the CUDA libraries (libcudart, libcublas, libcublasLt: about 150 MiB of
//    address space, 60-140 MiB resident) nor needs them installed. The plugin's own code calls
//    into the tool for the engine (Model, ThreadPool, the CPU forward of partial offload): the
//    tools export their symbols and link all of llmq_core (CMakeLists.txt, llmq_loads_plugins).
//  - linked in, for the programs that call engine/cuda/ directly (llmq-bench, llmq-tests,
//    llmq-ops, the emulator's tests): its object file defines llmq_cuda_backend(), which
//    device.cpp then finds without opening anything.
#pragma once
#include <cstdint>
#include <memory>

namespace llmq {

class BatchRunner;
class Model;
class SessionBase;
class MpiComm;
class ThreadPool;

/// Bumped whenever this table or the types it passes change: a plugin from another build is
/// refused (with the sizes below as a second check).
inline constexpr int kCudaBackendAbi = 2;  // 2: make_rank_runner takes an MpiComm

/// The entry points; each has the contract of the device.h function of the same name.
struct CudaBackendApi {
  int abi;                  ///< kCudaBackendAbi of the build that made the backend
  const char* version;      ///< LLMQ_VERSION of that build
  uint32_t model_bytes;     ///< sizeof(Model) there
  int (*device_count)();    ///< 0 without a driver or a GPU; never throws
  uint64_t (*free_bytes)();
  std::unique_ptr<SessionBase> (*make_session)(const Model& m, int64_t ctx, int64_t n_batch, int64_t logits_rows, bool progress,
                                               int64_t gpu_layers, ThreadPool* pool, int tp, bool kv_q8);
  std::unique_ptr<BatchRunner> (*make_batch_runner)(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel, int64_t kv_tokens,
                                                    bool progress, int tp, int64_t gpu_layers, ThreadPool* pool, bool kv_q8);
  std::unique_ptr<BatchRunner> (*make_rank_runner)(const Model& m, MpiComm& comm, int64_t ctx, int64_t n_batch, int64_t parallel,
                                                   int64_t kv_tokens, bool progress, bool kv_q8);
};

}  // namespace llmq

/// The backend's table (defined by cuda_backend.cpp, in the plugin or linked in).
extern "C" const llmq::CudaBackendApi* llmq_cuda_backend();
