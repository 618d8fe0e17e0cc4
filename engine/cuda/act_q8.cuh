// The int8 activation rule every kernel that quantizes activations for the GEMV / MMQ uses
// (quantize_act in matmul.cu, the fused RMSNorm and SwiGLU in ops.cu): per block of 32,
// d = max|x| / 127, q = rint(x / d) (round half to even, as the CPU's nearbyint), s = d · Σq
// (engine/cpu/cpu_ops.h BlockQ8Act), so a fused producer writes the same bytes as quantize_act.
#pragma once
#include "engine/cuda/common.cuh"
#include "engine/cuda/matmul.h"

namespace llmq::cuda {

/// Block b of 32 activations held by 32 / N consecutive lanes, N values each (lane group part
/// `part` holds elements N·part .. N·part + N - 1). Every lane of the warp must call (the
/// shuffles); only groups with `store` write q[b], d[b], s[b]. The maximum and the integer sum
/// do not depend on the order of the shuffles.
template <int N>
__device__ __forceinline__ void quantize_act_block(const float (&v)[N], int64_t b, int part, bool store, const DeviceActQ8& q) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "32 / N lanes per block");
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 1; o < 32 / N; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
  const float dd = amax / 127.0f;
  const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
  float qv[N], sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) qv[i] = rintf(v[i] * id), sum += qv[i];
#pragma unroll
  for (int o = 1; o < 32 / N; o <<= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  if (!store) return;
#pragma unroll
  for (int i = 0; i < N; ++i) q.q[b * 32 + N * part + i] = int8_t(qv[i]);
  if (part == 0) q.d[b] = dd, q.s[b] = dd * sum;
}

}  // namespace llmq::cuda
