// Device helpers shared by the kernel files: warp reductions and type conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

// Kernel launches are written LLMQ_LAUNCH(kernel, grid, block, smem, stream)(args...): the
// <<<...>>> launch here, a call into the CPU emulator in its build (engine/cuda/emu/emu.h).
#ifndef LLMQ_LAUNCH
#define LLMQ_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

namespace llmq::cuda {

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

/// Σ of the 16 int8 products of a and b (four __dp4a; a's bytes may be unsigned below 128).
__device__ __forceinline__ int dp4a4(uint4 a, int4 b, int acc) {
  acc = __dp4a(int(a.x), b.x, acc);
  acc = __dp4a(int(a.y), b.y, acc);
  acc = __dp4a(int(a.z), b.z, acc);
  return __dp4a(int(a.w), b.w, acc);
}

}  // namespace llmq::cuda
