#include "engine/runner/device.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>

#include "base/error.h"
#include "engine/runner/cuda_backend.h"
#include "engine/runner/model_file.h"

// Defined when the backend is linked in (engine/runner/cuda_backend.cpp); else null, and the
// plugin is opened instead.
extern "C" const llmq::CudaBackendApi* llmq_cuda_backend() __attribute__((weak));

namespace llmq {

namespace {

#ifdef LLMQ_CUDA_PLUGIN_BUILT
// The plugin's path: $LLMQ_CUDA_PLUGIN, else libllmq-cuda.so in the running program's folder.
std::string plugin_path() {
  if (const char* env = std::getenv("LLMQ_CUDA_PLUGIN"); env && *env) return env;
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return "libllmq-cuda.so";
  std::string dir(exe, size_t(n));
  dir.resize(dir.rfind('/') + 1);
  return dir + "libllmq-cuda.so";
}
#endif

struct Backend {
  const CudaBackendApi* api = nullptr;
  std::string why;  // why there is none
};

// The CUDA backend, found once: linked in, else the plugin opened (RTLD_NOW: a missing CUDA
// library or symbol is an error here, not a crash later) and checked against this build.
const Backend& backend() {
  static const Backend b = [] {
    Backend r;
    if (llmq_cuda_backend) {
      r.api = llmq_cuda_backend();
      return r;
    }
#ifndef LLMQ_CUDA_PLUGIN_BUILT
    r.why = "this build has no CUDA backend (nvcc was not found when it was configured)";
    return r;
#else
    const std::string path = plugin_path();
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      r.why = "the CUDA backend plugin could not be loaded: " + std::string(e ? e : path);
      return r;
    }
    auto get = reinterpret_cast<const CudaBackendApi* (*)()>(::dlsym(h, "llmq_cuda_backend"));
    const CudaBackendApi* api = get ? get() : nullptr;
    if (!api || api->abi != kCudaBackendAbi || api->model_bytes != sizeof(Model) || std::string(api->version) != LLMQ_VERSION) {
      r.why = path + " is not this build's CUDA backend (rebuild, or set LLMQ_CUDA_PLUGIN)";
      ::dlclose(h);
      return r;
    }
    r.api = api;  // kept open for the life of the program
    return r;
#endif
  }();
  return b;
}

const CudaBackendApi& api() {
  const Backend& b = backend();
  if (!b.api) throw UsageError(b.why);
  return *b.api;
}

}  // namespace

bool cuda_built() {
#ifdef LLMQ_CUDA_PLUGIN_BUILT
  return true;
#else
  return llmq_cuda_backend != nullptr;
#endif
}

int cuda_device_count() {
  const Backend& b = backend();
  return b.api ? b.api->device_count() : 0;
}

const char* device_name(Device d) { return d == Device::Cuda ? "cuda" : "cpu"; }

uint64_t cuda_free_bytes() { return api().free_bytes(); }

std::unique_ptr<Model> load_model(const std::string& path, bool verify, const Placement& p) {
  const bool cpu = p.device == Device::Cpu;
  const bool pack = cpu || p.gpu_layers >= 0;
  const int64_t gpu_layers = cpu ? 0 : std::max<int64_t>(0, p.gpu_layers);
  const int tp = cpu && !p.whole_panels ? p.tp : 1;
  return Model::load(model_file_for(path), verify, pack, gpu_layers, tp, p.ctx);
}

Device pick_device(const std::string& name) {
  if (name == "cpu") return Device::Cpu;
  if (name == "auto") return cuda_device_count() > 0 ? Device::Cuda : Device::Cpu;
  if (name == "cuda") {
    if (!backend().api) throw UsageError("--device cuda: " + backend().why);
    if (cuda_device_count() == 0) throw UsageError("--device cuda: no CUDA device is present (or no NVIDIA driver)");
    return Device::Cuda;
  }
  throw UsageError("--device must be cpu, cuda or auto, not '" + name + "'");
}

std::unique_ptr<SessionBase> make_cuda_session(const Model& m, int64_t ctx, int64_t n_batch, int64_t logits_rows, bool progress,
                                               int64_t gpu_layers, ThreadPool* pool, int tp, bool kv_q8) {
  return api().make_session(m, ctx, n_batch, logits_rows, progress, gpu_layers, pool, tp, kv_q8);
}

std::unique_ptr<BatchRunner> make_cuda_batch_runner(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel, int64_t kv_tokens,
                                                    bool progress, int tp, int64_t gpu_layers, ThreadPool* pool, bool kv_q8) {
  return api().make_batch_runner(m, ctx, n_batch, parallel, kv_tokens, progress, tp, gpu_layers, pool, kv_q8);
}

std::unique_ptr<BatchRunner> make_cuda_rank_runner(const Model& m, MpiComm& comm, int64_t ctx, int64_t n_batch, int64_t parallel,
                                                   int64_t kv_tokens, bool progress, bool kv_q8) {
  return api().make_rank_runner(m, comm, ctx, n_batch, parallel, kv_tokens, progress, kv_q8);
}

}  // namespace llmq
