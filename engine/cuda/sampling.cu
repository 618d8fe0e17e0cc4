// Greedy token choice on the GPU (engine/cuda/sampling.h).
#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "engine/cuda/sampling.h"
#include "base/error.h"

namespace llmq::cuda {

namespace {

constexpr int kArgmaxThreads = 1024;

// (value, index) pairs: the larger value wins, on equal values the lower index. NaN never wins.
__device__ __forceinline__ void better(float& v, int32_t& i, float v2, int32_t i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ x, int64_t n, int32_t* __restrict__ out) {
  pdl_begin();
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

namespace {

constexpr int kTopKThreads = 1024;

// Unsigned keys in the order of the floats: flip all bits of negatives, the sign bit of the rest;
// -0 and +0 get one key (they compare equal, so they tie, as on the host).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block of one int per thread (Hillis-Steele in shared memory).
__device__ int block_exclusive_scan(int v, int* buf) {
  const int tid = threadIdx.x;
  buf[tid] = v;
  __syncthreads();
  for (int off = 1; off < int(blockDim.x); off <<= 1) {
    const int add = tid >= off ? buf[tid - off] : 0;
    __syncthreads();
    buf[tid] += add;
    __syncthreads();
  }
  const int inclusive = buf[tid];
  __syncthreads();  // buf is reused by the caller's next scan
  return inclusive - v;
}

// Radix select over this thread's elements x[lo, hi), most significant digit first: the order key
// of the block's k-th largest element (prefix) and how many of the elements equal to it belong to
// the top k (need). hist, s_prefix and s_need are the block's shared memory.
__device__ __forceinline__ void top_k_threshold(const float* __restrict__ x, int lo, int hi, int k, int* hist, uint32_t& s_prefix,
                                                int& s_need, uint32_t& prefix_out, int& need_out) {
  const int tid = threadIdx.x, T = blockDim.x;
  uint32_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += T) hist[i] = 0;
    __syncthreads();
    for (int i = lo; i < hi; ++i) {
      const uint32_t key = order_key(x[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int cum = 0, d = 255;
      for (; d > 0; --d) {
        if (cum + hist[d] >= need) break;
        cum += hist[d];
      }
      s_prefix = prefix | (uint32_t(d) << shift);
      s_need = need - cum;
    }
    __syncthreads();
    prefix = s_prefix, need = s_need, mask |= 255u << shift;
  }
  prefix_out = prefix, need_out = need;
}

// Gather: every element above the threshold (k - need of them), then the `need` lowest-index
// elements equal to it, each thread writing its own in index order after its prefix sums.
__device__ __forceinline__ void top_k_gather(const float* __restrict__ x, int lo, int hi, int k, uint32_t prefix, int need, int* scan_buf,
                                             int* cand_id, float* cand_val) {
  int gt = 0, eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = order_key(x[i]);
    gt += key > prefix;
    eq += key == prefix;
  }
  int at_gt = block_exclusive_scan(gt, scan_buf), at_eq = block_exclusive_scan(eq, scan_buf);
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = order_key(x[i]);
    if (key > prefix) {
      cand_id[at_gt] = i, cand_val[at_gt] = x[i];
      ++at_gt;
    } else if (key == prefix) {
      if (at_eq < need) cand_id[k - need + at_eq] = i, cand_val[k - need + at_eq] = x[i];
      ++at_eq;
    }
  }
}

// Bitonic sort of the k candidates, padded to a power of two, into (value desc, index asc).
__device__ __forceinline__ void top_k_sort(int k, int* cand_id, float* cand_val) {
  const int tid = threadIdx.x, T = blockDim.x;
  int P = 1;
  while (P < k) P <<= 1;
  __syncthreads();
  for (int i = k + tid; i < P; i += T) cand_id[i] = 0x7fffffff, cand_val[i] = -INFINITY;
  for (int size = 2; size <= P; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = tid; i < P; i += T) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const bool before = cand_val[i] > cand_val[j] || (cand_val[i] == cand_val[j] && cand_id[i] < cand_id[j]);
        if (((i & size) == 0) != before) {  // ascending segments keep "before" order, descending ones the reverse
          const int ti = cand_id[i];
          const float tv = cand_val[i];
          cand_id[i] = cand_id[j], cand_val[i] = cand_val[j];
          cand_id[j] = ti, cand_val[j] = tv;
        }
      }
    }
  __syncthreads();
}

__global__ void __launch_bounds__(kTopKThreads) top_k_kernel(const float* __restrict__ x, int n, int k, int32_t* __restrict__ out_ids,
                                                            float* __restrict__ out_vals) {
  pdl_begin();
  __shared__ int hist[256];
  __shared__ int scan_buf[kTopKThreads];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  __shared__ int cand_id[kMaxTopK];
  __shared__ float cand_val[kMaxTopK];
  const int tid = threadIdx.x, T = blockDim.x;
  const int per = (n + T - 1) / T, lo = min(n, tid * per), hi = min(n, lo + per);  // contiguous: index order across threads
  uint32_t prefix;
  int need;
  top_k_threshold(x, lo, hi, k, hist, s_prefix, s_need, prefix, need);
  top_k_gather(x, lo, hi, k, prefix, need, scan_buf, cand_id, cand_val);
  top_k_sort(k, cand_id, cand_val);
  for (int i = tid; i < k; i += T) out_ids[i] = cand_id[i], out_vals[i] = cand_val[i];
}

}  // namespace

void top_k(const float* logits, int64_t n, int k, int32_t* ids, float* vals, cudaStream_t s) {
  if (k < 1 || k > kMaxTopK || k > n) throw UsageError("top_k: k = " + std::to_string(k) + " out of range");
  LLMQ_LAUNCH(top_k_kernel, 1, kTopKThreads, 0, s)(logits, int(n), k, ids, vals);
  check_launch("top_k");
}

}  // namespace llmq::cuda
