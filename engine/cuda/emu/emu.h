// The CUDA emulator: runs llmq's CUDA kernels, unchanged, on the CPU, so their logic (indexing,
// shared-memory layouts, warp and block reductions, barrier placement, graph replay) is tested
// by CI, which has no GPU. Not a simulator of speed or of memory ordering between blocks.
//
// How: the same .cu source is compiled as C++ (engine/cuda/emu/*_emu.cpp include it after this
// header). Every thread of a CUDA block is a fiber (ucontext) of one OS thread; blocks run one
// after another. __syncthreads and the warp shuffles are barriers between the block's (or the
// warp's) fibers; a barrier that some live threads never reach is reported as an error (a
// divergent __syncthreads on a GPU). __shared__ variables are static thread_local: one copy per
// OS thread, which the block's fibers share. Host threads may launch at once (tensor-parallel
// ranks): each runs its own fibers, block state and shared memory. The CUDA runtime and cuBLAS functions the engine calls are defined in
// emu.cpp against the real headers' declarations (host memory stands for device memory; a
// stream runs its work at once, or records it while a graph is being captured).
#pragma once
#ifndef LLMQ_CUDA_EMU
#error "engine/cuda/emu/emu.h is for the emulated build (LLMQ_CUDA_EMU)"
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

namespace llmq::cuda::emu {

extern thread_local dim3 g_block_idx, g_block_dim, g_grid_dim;  // of the block running now (this host thread's)
const uint3& thread_idx();                          // of the fiber running now
int lane();                                         // threadIdx linearized % 32
void sync_block();                                  // __syncthreads
void sync_warp();                                   // a barrier of the current warp's 32 lanes
uint64_t* warp_slots();                             // [32] exchange slots of the current warp
uint64_t* warp_exchange();                          // [32][8] per-lane areas of the current warp (warp-wide mma)
unsigned char* dynamic_smem();                      // the launch's dynamic shared memory

/// Runs `body` once per thread of every block of grid x block (or records it into the graph
/// the stream is capturing). Invalid configurations (more than 1024 threads, more dynamic
/// shared memory than the kernel was allowed) set the error cudaGetLastError returns.
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s, std::function<void()> body);

/// kernel<<<grid, block, smem, stream>>>(args...) as LLMQ_LAUNCH(kernel, grid, block, smem, stream)(args...).
template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <class... A>
  void operator()(A&&... a) const {
    auto args = std::make_tuple(P(std::forward<A>(a))...);  // by value, as a launch copies them
    auto k = kernel;
    launch(reinterpret_cast<const void*>(k), grid, block, smem, stream, [k, args] { std::apply(k, args); });
  }
};
template <class... P>
Launch(void (*)(P...), dim3, dim3, size_t, cudaStream_t) -> Launch<P...>;

template <class T>
T shfl(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  uint64_t* slots = warp_slots();
  slots[lane()] = bits;
  sync_warp();
  const uint64_t got = slots[src & 31];
  sync_warp();  // every lane has read before the slots are written again
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

}  // namespace llmq::cuda::emu

#define LLMQ_LAUNCH(kernel, grid, block, smem, stream) \
  ::llmq::cuda::emu::Launch { kernel, dim3(grid), dim3(block), size_t(smem), stream }

#define threadIdx (::llmq::cuda::emu::thread_idx())
#define blockIdx (::llmq::cuda::emu::g_block_idx)
#define blockDim (::llmq::cuda::emu::g_block_dim)
#define gridDim (::llmq::cuda::emu::g_grid_dim)
#undef __shared__
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __syncthreads() ::llmq::cuda::emu::sync_block()

using std::max;  // CUDA's device code has min and max for integers in the global namespace
using std::min;

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return ::llmq::cuda::emu::shfl(v, ::llmq::cuda::emu::lane() ^ mask);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  return ::llmq::cuda::emu::shfl(v, src);
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += int(int8_t(uint32_t(a) >> (8 * i))) * int(int8_t(uint32_t(b) >> (8 * i)));
  return c;
}
inline int atomicAdd(int* p, int v) {  // fibers take turns: a plain add is atomic
  const int old = *p;
  *p += v;
  return old;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
