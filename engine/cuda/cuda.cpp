#include "engine/cuda/cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <mutex>
#include <utility>

#include "base/env_setting.h"

namespace llmq::cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

namespace {
// On by default where the current device is Hopper or newer (compute capability 9.0, where
// griddepcontrol exists); LLMQ_CUDA_PDL=0 or 1 decides at start-up instead.
EnvSetting g_pdl([] {
  const char* e = std::getenv("LLMQ_CUDA_PDL");
  if (e && (std::string(e) == "0" || std::string(e) == "1")) return e[0] - '0';
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();  // clear the error, so the next check_launch does not report it
    return 0;
  }
  return major >= 9 ? 1 : 0;
});
}  // namespace

bool programmatic_launch() { return g_pdl.get() != 0; }
void set_programmatic_launch(bool on) { g_pdl.set(on ? 1 : 0); }

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;  // (kernel, device) -> bytes allowed
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lk(mu);
  size_t& have = allowed[{kernel, dev}];
  if (have >= bytes) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), "cudaFuncSetAttribute");
  have = bytes;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" / "no device" error
    return 0;
  }
  return n;
}

std::string device_description(int dev) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.256s (sm_%d%d, %d SMs, %.1f GiB)", p.name, p.major, p.minor, p.multiProcessorCount,
                double(p.totalGlobalMem) / double(1ull << 30));
  return buf;
}

MemInfo mem_info() {
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return {uint64_t(free), uint64_t(total)};
}

double best_time_ms(int reps, const std::function<void()>& op) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  float best = 1e30f;
  for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up
    check(cudaEventRecord(e0), "cudaEventRecord");
    op();
    check(cudaEventRecord(e1), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (r > 0) best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return double(best);
}

OpProfile::~OpProfile() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

cudaEvent_t OpProfile::event(size_t i) {
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    events_.push_back(e);
  }
  return events_[i];
}

void OpProfile::begin(cudaStream_t s) {
  stream_ = s;
  names_.clear();
  check(cudaEventRecord(event(0), s), "cudaEventRecord");
}

void OpProfile::mark(const char* op) {
  names_.push_back(op);
  check(cudaEventRecord(event(names_.size()), stream_), "cudaEventRecord");
}

void OpProfile::end() {
  if (names_.empty()) return;
  check(cudaEventSynchronize(events_[names_.size()]), "cudaEventSynchronize");
  for (size_t i = 0; i < names_.size(); ++i) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]), "cudaEventElapsedTime");
    auto it = std::find_if(totals_.begin(), totals_.end(), [&](const auto& t) { return t.first == names_[i]; });
    if (it == totals_.end()) totals_.emplace_back(names_[i], double(ms));
    else it->second += double(ms);
  }
  names_.clear();
  ++passes_;
}

double measure_copy_bandwidth(uint64_t bytes, int reps) {
  DeviceBuffer a(bytes), b(bytes);
  check(cudaMemset(a.get(), 1, bytes), "cudaMemset");
  const double ms = best_time_ms(reps, [&] { check(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy (D2D)"); });
  return 2.0 * double(bytes) / (ms * 1e-3);
}

template <MemoryKind kind>
CudaAllocation<kind>::CudaAllocation(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = kind == MemoryKind::Device ? cudaMalloc(&p_, bytes) : cudaMallocHost(&p_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    p_ = nullptr, n_ = 0;
    throw CudaError(std::string(kind == MemoryKind::Device ? "cudaMalloc" : "cudaMallocHost") + " of " + std::to_string(bytes) +
                    " bytes: " + cudaGetErrorString(e));
  }
}

template <MemoryKind kind>
void CudaAllocation<kind>::release() noexcept {
  if (p_ && kind == MemoryKind::Device) cudaFree(p_);
  else if (p_) cudaFreeHost(p_);
}

template class CudaAllocation<MemoryKind::Device>;
template class CudaAllocation<MemoryKind::Pinned>;

void DeviceBuffer::upload(const void* src, size_t n, size_t off) {
  if (off + n > n_) throw CudaError("DeviceBuffer::upload past the end");
  check(cudaMemcpy(static_cast<uint8_t*>(p_) + off, src, n, cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
}

void DeviceBuffer::download(void* dst, size_t n, size_t off) const {
  if (off + n > n_) throw CudaError("DeviceBuffer::download past the end");
  check(cudaMemcpy(dst, static_cast<const uint8_t*>(p_) + off, n, cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
}

}  // namespace llmq::cuda
