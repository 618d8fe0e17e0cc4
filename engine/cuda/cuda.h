// Host-side CUDA utilities: error checks, the device present, owning device buffers.
// Plain C++ (compiled by the host compiler); kernels live in the .cu files beside it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace llmq::cuda {

/// A failed CUDA runtime or cuBLAS call; the message names the call and the error.
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Throws CudaError("<what>: <cudaGetErrorString(e)>") unless e == cudaSuccess.
void check(cudaError_t e, const char* what);
/// After a kernel launch: throws CudaError if the launch failed (bad configuration).
void check_launch(const char* kernel);

/// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device
/// (cudaFuncSetAttribute MaxDynamicSharedMemorySize) when over the default 48 KiB: once per
/// kernel, device and size (remembered), so a launch inside a CUDA graph capture that was
/// prepared before makes no call. Throws CudaError.
void allow_dynamic_smem(const void* kernel, size_t bytes);

/// Programmatic dependent launch for every LLMQ_LAUNCH from now on (engine/cuda/common.cuh
/// Launcher, pdl_begin), or ordinary launches. The default is on where the device at start-up has
/// compute capability 9.0 or more; the environment's LLMQ_CUDA_PDL=0 or 1 decides at start-up
/// (dev/README.md #18). CUDA graphs captured before keep what they captured.
void set_programmatic_launch(bool on);

/// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();
/// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)" for device `dev`.
std::string device_description(int dev);

/// Free and total bytes of the current device (cudaMemGetInfo).
struct MemInfo {
  uint64_t free = 0, total = 0;
};
MemInfo mem_info();

/// Times `op` (work it enqueues on the legacy default stream) with CUDA events: one warm-up run,
/// then the best of `reps`, in milliseconds.
double best_time_ms(int reps, const std::function<void()>& op);

/// Device-to-device copy bandwidth of the current GPU: the best of `reps` cudaMemcpy of
/// `bytes` between two buffers, counted as bytes read + bytes written per second (as
/// NVIDIA's bandwidthTest does). The reference for "fraction of the memory bandwidth".
double measure_copy_bandwidth(uint64_t bytes = 1ull << 30, int reps = 10);

/// Time per op class of the work enqueued on one stream, from CUDA events recorded between the
/// ops (llmq-bench --profile): after begin(), each mark(op) gives the interval since the previous
/// mark (or begin) to `op`; end() waits for the stream and adds the intervals up by name. Events
/// add a few microseconds per op, so the sum is a little over an unprofiled pass, and a profiled
/// pass runs without CUDA graphs. The events are made once and reused.
class OpProfile {
 public:
  OpProfile() = default;
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;
  ~OpProfile();
  void begin(cudaStream_t s);
  void mark(const char* op);
  void end();
  /// Milliseconds per op class over every pass since the last clear(), in first-seen order.
  const std::vector<std::pair<std::string, double>>& totals_ms() const { return totals_; }
  /// Passes ended since the last clear().
  int passes() const { return passes_; }
  void clear() { totals_.clear(), passes_ = 0; }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // events_[0]: begin; events_[i]: after names_[i - 1]
  std::vector<const char*> names_;
  std::vector<std::pair<std::string, double>> totals_;
  int passes_ = 0;
  cudaEvent_t event(size_t i);
};

/// Where a CudaAllocation lives: device memory (cudaMalloc) or pinned, page-locked host memory
/// (cudaMallocHost: copies a CUDA graph replays).
enum class MemoryKind { Device, Pinned };

/// One allocation of `kind`, freed by the destructor. Move-only.
template <MemoryKind kind>
class CudaAllocation {
 public:
  CudaAllocation() = default;
  /// Allocates `bytes` (none for 0); throws CudaError when the memory is not there.
  explicit CudaAllocation(size_t bytes);
  CudaAllocation(CudaAllocation&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  CudaAllocation& operator=(CudaAllocation&& o) noexcept {
    if (this != &o) {
      release();
      p_ = o.p_, n_ = o.n_;
      o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;
  ~CudaAllocation() { release(); }

  size_t bytes() const { return n_; }
  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 protected:
  void release() noexcept;
  void* p_ = nullptr;
  size_t n_ = 0;
};

/// One device allocation (cudaMalloc).
class DeviceBuffer : public CudaAllocation<MemoryKind::Device> {
 public:
  using CudaAllocation::CudaAllocation;
  /// Copies `n` bytes from host memory to offset `off` (synchronous).
  void upload(const void* src, size_t n, size_t off = 0);
  /// Copies `n` bytes from offset `off` to host memory (synchronous).
  void download(void* dst, size_t n, size_t off = 0) const;
};

/// Pinned (page-locked) host memory (cudaMallocHost), for copies a CUDA graph replays.
using PinnedBuffer = CudaAllocation<MemoryKind::Pinned>;

}  // namespace llmq::cuda
