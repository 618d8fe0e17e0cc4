// Device helpers shared by the kernel files: warp reductions and type conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace llmq::cuda {

/// Whether kernels are launched with programmatic dependent launch: by default where the device
/// at start-up is Hopper or newer (compute capability 9.0); LLMQ_CUDA_PDL=0/1 at start-up or
/// set_programmatic_launch (engine/cuda/cuda.cpp) decide instead. An H200 decoded llama-2-7b Q4_0
/// 1.12x and Q8_0 1.09x as fast with it (dev/README.md #18).
bool programmatic_launch();

#ifndef LLMQ_CUDA_EMU
/// LLMQ_LAUNCH's launcher: kernel<<<grid, block, smem, stream>>>(args...), or with
/// programmatic_launch() the same through cudaLaunchKernelEx with programmatic stream
/// serialization allowed, so the kernel's blocks may be scheduled before the kernel ahead of it
/// in the stream has finished; they wait for it in pdl_begin().
template <typename... P>
class Launcher {
 public:
  Launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream)
      : kernel_(kernel), grid_(grid), block_(block), smem_(smem), stream_(stream) {}
  template <typename... A>
  void operator()(A&&... args) const {
    if (!programmatic_launch()) {
      kernel_<<<grid_, block_, smem_, stream_>>>(std::forward<A>(args)...);
      return;
    }
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid_, cfg.blockDim = block_, cfg.dynamicSmemBytes = smem_, cfg.stream = stream_, cfg.attrs = &attr, cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, kernel_, std::forward<A>(args)...);  // an error is left for check_launch (cudaGetLastError)
  }

 private:
  void (*kernel_)(P...);
  dim3 grid_, block_;
  size_t smem_;
  cudaStream_t stream_;
};
#endif

}  // namespace llmq::cuda

// Kernel launches are written LLMQ_LAUNCH(kernel, grid, block, smem, stream)(args...): the
// launcher above here, a call into the CPU emulator in its build (engine/cuda/emu/emu.h). Every
// kernel starts with pdl_begin().
#ifndef LLMQ_LAUNCH
#define LLMQ_LAUNCH(kernel, grid, block, smem, stream) ::llmq::cuda::Launcher(kernel, grid, block, smem, stream)
#endif

namespace llmq::cuda {

/// The first statement of every kernel: waits until the kernel ahead in the stream has finished
/// and its writes are visible (griddepcontrol.wait), then lets the next kernel's blocks be
/// scheduled (griddepcontrol.launch_dependents); they wait here in turn, so nothing a kernel reads
/// or writes overlaps its neighbours. Without programmatic launch (the default) both are no-ops
/// (PTX ISA, griddepcontrol; CUDA programming guide, programmatic dependent launch).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// The launch's dynamic shared memory (the extern __shared__ array), 16-byte aligned.
#ifdef LLMQ_CUDA_EMU
inline unsigned char* dynamic_smem() { return emu::dynamic_smem(); }
#else
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char smem_[];
  return smem_;
}
#endif

constexpr unsigned kFullMask = 0xffffffffu;

/// Sum over the 32 lanes of a warp (butterfly: every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

/// Maximum over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
/// `red` is shared scratch of 32 floats. Contains __syncthreads: call from all threads.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // red may still be read from an earlier call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < n_warps ? red[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float fp16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

/// Bits 0..3 of `bits` as bit 4 of bytes 0..3: four Q5 weights' fifth bits, to OR into their
/// nibbles.
__device__ __forceinline__ uint32_t fifth_bit_bytes(uint32_t bits) {
  return (bits & 1u) << 4 | (bits & 2u) << 11 | (bits & 4u) << 18 | (bits & 8u) << 25;
}

/// Four Q6_K weights as int8 q - 32: the low nibbles in `nib` (bytes 0..15) and the high
/// crumbs in bits 0-1 of each byte of `crumbs` (other bits ignored). The bytes of q | 0x80 less
/// 32 cannot borrow across bytes (q is 0..63).
__device__ __forceinline__ uint32_t q6_bytes(uint32_t nib, uint32_t crumbs) {
  return (((nib | (crumbs & 0x03030303u) << 4) | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

/// Σ of the 16 int8 products of a and b (four __dp4a; a's bytes may be unsigned below 128).
__device__ __forceinline__ int dp4a4(uint4 a, int4 b, int acc) {
  acc = __dp4a(int(a.x), b.x, acc);
  acc = __dp4a(int(a.y), b.y, acc);
  acc = __dp4a(int(a.z), b.z, acc);
  return __dp4a(int(a.w), b.w, acc);
}

}  // namespace llmq::cuda
