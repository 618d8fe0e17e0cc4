// Greedy token choice on the GPU (engine/cuda/sampling.h).
#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "engine/cuda/sampling.h"

namespace llmq::cuda {

namespace {

constexpr int kArgmaxThreads = 1024;

// (value, index) pairs: the larger value wins, on equal values the lower index. NaN never wins.
__device__ __forceinline__ void better(float& v, int32_t& i, float v2, int32_t i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ x, int64_t n, int32_t* __restrict__ out) {
  __shared__ float sv[32];
  __shared__ int32_t si[32];
  float v = -INFINITY;
  int32_t idx = 0x7fffffff;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) better(v, idx, x[i], int32_t(i));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(kFullMask, v, o), __shfl_xor_sync(kFullMask, idx, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sv[warp] = v, si[warp] = idx;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? sv[lane] : -INFINITY;
    idx = lane < int(blockDim.x / 32) ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(kFullMask, v, o), __shfl_xor_sync(kFullMask, idx, o));
    if (lane == 0) *out = idx == 0x7fffffff ? 0 : idx;
  }
}

}  // namespace

void argmax(const float* logits, int64_t n, int32_t* out, cudaStream_t s) {
  LLMQ_LAUNCH(argmax_kernel, 1, kArgmaxThreads, 0, s)(logits, n, out);
  check_launch("argmax");
}

}  // namespace llmq::cuda
