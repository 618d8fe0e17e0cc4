// Per-token kernels of the GPU forward pass (engine/cuda/ops.h).
#include <algorithm>

#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "formats/error.h"

namespace llmq::cuda {

namespace {

constexpr int kNormThreads = 256;

// One block per row. With y: x += y first (written back), then the norm of the sum.
// out may be y (each thread reads y[i] before it writes out[i], for the same i): no __restrict__.
__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(float* out, float* x, const float* y, const float* __restrict__ w,
                                                               int64_t n, float eps) {
  __shared__ float red[32];
  float* xr = x + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  const float* yr = y ? y + int64_t(blockIdx.x) * n : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = xr[i];
    if (yr) xr[i] = v = v + yr[i];
    ss += v * v;
  }
  ss = block_sum(ss, red);
  const float scale = rsqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * scale * w[i];
}

}  // namespace

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s) {
  if (T == 0) return;
  LLMQ_LAUNCH(rmsnorm_kernel, unsigned(T), kNormThreads, 0, s)(out, const_cast<float*>(x), nullptr, w, n, eps);
  check_launch("rmsnorm");
}

void add_rmsnorm(float* x, const float* y, float* out, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s) {
  if (T == 0) return;
  LLMQ_LAUNCH(rmsnorm_kernel, unsigned(T), kNormThreads, 0, s)(out, x, y, w, n, eps);
  check_launch("add_rmsnorm");
}

namespace {

// One thread per rotation pair of q and k ((n_heads + n_kv) · hd/2 per token), then one per
// pair of v elements (n_kv · hd/2): grid.y is the token.
__global__ void rope_store_kv_kernel(float* __restrict__ qkv, int64_t ld, const int32_t* __restrict__ pos,
                                     const int32_t* __restrict__ rows, int n_heads,
                                     int n_kv, int hd, double theta, bool interleaved, __half* __restrict__ kc,
                                     __half* __restrict__ vc) {
  const int64_t t = blockIdx.y;
  const int half = hd / 2, kv_dim = n_kv * hd;
  const int rot_pairs = (n_heads + n_kv) * half, v_pairs = n_kv * half;
  const int idx = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rot_pairs + v_pairs) return;
  float* row = qkv + t * ld;
  const int64_t p = pos[t], r = rows ? rows[t] : p;  // position (angles), cache row (store)
  if (idx < rot_pairs) {
    const int head = idx / half, i = idx % half;
    const double angle = double(p) * pow(theta, -2.0 * double(i) / double(hd));
    const float c = float(cos(angle)), sn = float(sin(angle));
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    float* v = row + int64_t(head) * hd;  // q heads first, then k heads (contiguous in qkv)
    const float x0 = v[a], x1 = v[b];
    const float r0 = x0 * c - x1 * sn, r1 = x0 * sn + x1 * c;
    v[a] = r0, v[b] = r1;
    if (head >= n_heads && kc) {  // a k head: to the cache
      __half* krow = kc + r * kv_dim + int64_t(head - n_heads) * hd;
      krow[a] = __float2half(r0), krow[b] = __float2half(r1);
    }
  } else if (vc) {
    const int j = 2 * (idx - rot_pairs);  // element pair of v
    const float* v = row + int64_t(n_heads + n_kv) * hd;
    vc[r * kv_dim + j] = __float2half(v[j]);
    vc[r * kv_dim + j + 1] = __float2half(v[j + 1]);
  }
}

}  // namespace

void rope_store_kv(float* qkv, int64_t ld, const int32_t* pos, const int32_t* rows, int64_t T, int64_t n_heads, int64_t n_kv,
                   int64_t hd, double theta, RopeLayout layout, uint16_t* kc, uint16_t* vc, cudaStream_t s) {
  if (T == 0) return;
  const int64_t items = (n_heads + 2 * n_kv) * (hd / 2);
  const dim3 grid(unsigned((items + 127) / 128), unsigned(T));
  LLMQ_LAUNCH(rope_store_kv_kernel, grid, 128, 0, s)(qkv, ld, pos, rows, int(n_heads), int(n_kv), int(hd), theta, layout == RopeLayout::Interleaved,
                                            reinterpret_cast<__half*>(kc), reinterpret_cast<__half*>(vc));
  check_launch("rope_store_kv");
}

namespace {

__global__ void swiglu_kernel(float* __restrict__ out, const float* __restrict__ h, int64_t T, int64_t H) {
  const int64_t n = T * H;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, j = i % H;
    const float g = h[t * 2 * H + j], u = h[t * 2 * H + H + j];
    out[i] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void add_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) x[i] += y[i];
}

__global__ void add_bias_kernel(float* __restrict__ x, int64_t ld, const float* __restrict__ b, int64_t T, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * n; i += int64_t(gridDim.x) * blockDim.x)
    x[(i / n) * ld + i % n] += b[i % n];
}

// Element j of row r of a split-layout matrix, as fp32.
__device__ __forceinline__ float weight_at(DType type, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t cols,
                                           int64_t r, int64_t j) {
  const int64_t b = r * (cols / 32) + j / 32;
  switch (type) {
    case DType::F32: return reinterpret_cast<const float*>(q)[r * cols + j];
    case DType::F16: return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(q)[r * cols + j]);
    case DType::BF16: return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(q)[r * cols + j]);
    case DType::Q8_0: return fp16_bits_to_float(d[b]) * float(reinterpret_cast<const int8_t*>(q)[r * cols + j]);
    case DType::Q4_0:
    case DType::Q4_1: {
      const int k = int(j % 32);
      const uint8_t byte = q[b * 16 + k % 16];
      const int nib = k < 16 ? byte & 0x0f : byte >> 4;
      return type == DType::Q4_0 ? fp16_bits_to_float(d[b]) * float(nib - 8)
                                 : fp16_bits_to_float(d[b]) * float(nib) + fp16_bits_to_float(m[b]);
    }
  }
  return 0.0f;
}

__global__ void embedding_kernel(float* __restrict__ x, DType type, const uint8_t* __restrict__ q, const uint16_t* __restrict__ d,
                                 const uint16_t* __restrict__ m, int64_t cols, const int32_t* __restrict__ tokens) {
  const int64_t t = blockIdx.y, r = tokens[t];
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < cols; j += int64_t(gridDim.x) * blockDim.x)
    x[t * cols + j] = weight_at(type, q, d, m, cols, r, j);
}

unsigned grid_for(int64_t n, int threads) { return unsigned(std::min<int64_t>((n + threads - 1) / threads, 8192)); }

}  // namespace

void swiglu(float* out, const float* h, int64_t T, int64_t H, cudaStream_t s) {
  if (T * H == 0) return;
  LLMQ_LAUNCH(swiglu_kernel, grid_for(T * H, 256), 256, 0, s)(out, h, T, H);
  check_launch("swiglu");
}

void add(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  LLMQ_LAUNCH(add_kernel, grid_for(n, 256), 256, 0, s)(x, y, n);
  check_launch("add");
}

void add_bias(float* x, int64_t ld, const float* b, int64_t T, int64_t n, cudaStream_t s) {
  if (T * n == 0) return;
  LLMQ_LAUNCH(add_bias_kernel, grid_for(T * n, 256), 256, 0, s)(x, ld, b, T, n);
  check_launch("add_bias");
}

void embedding(float* x, const DeviceWeight& table, const int32_t* tokens, int64_t T, cudaStream_t s) {
  if (T == 0) return;
  const dim3 grid(unsigned((table.cols + 255) / 256), unsigned(T));
  LLMQ_LAUNCH(embedding_kernel, grid, 256, 0, s)(x, table.type, table.q, table.d, table.m, table.cols, tokens);
  check_launch("embedding");
}

namespace {

__global__ void gather_rows_kernel(float* __restrict__ out, const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t n) {
  const float* src = x + int64_t(idx[blockIdx.y]) * n;
  float* dst = out + int64_t(blockIdx.y) * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) dst[i] = src[i];
}

}  // namespace

void gather_rows(float* out, const float* x, const int32_t* idx, int64_t rows, int64_t n, cudaStream_t s) {
  if (rows == 0) return;
  const dim3 grid{unsigned(std::min<int64_t>((n + 255) / 256, 64)), unsigned(rows), 1};
  LLMQ_LAUNCH(gather_rows_kernel, grid, 256, 0, s)(out, x, idx, n);
  check_launch("gather_rows");
}

namespace {

// grid (T, 2 · kv_dim / 32), one warp: block b of the token's k (b < nb) or v (b >= nb) row;
// lane i holds element i: d = max|x| / 127, q = round(x / d) (Q8_0's rule, formats/quant.h).
__global__ void store_kv_q8_kernel(const float* __restrict__ qkv, int64_t ld, int64_t q_dim, const int32_t* __restrict__ pos,
                                   const int32_t* __restrict__ rows, int kv_dim, int8_t* __restrict__ kq, __half* __restrict__ kd,
                                   int8_t* __restrict__ vq, __half* __restrict__ vd) {
  const int t = blockIdx.x, nb = kv_dim / 32, lane = threadIdx.x;
  const bool is_v = int(blockIdx.y) >= nb;
  const int b = is_v ? int(blockIdx.y) - nb : int(blockIdx.y);
  const float x = qkv[int64_t(t) * ld + q_dim + (is_v ? kv_dim : 0) + b * 32 + lane];  // k after q, v after k
  const float d = warp_max(fabsf(x)) / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  const int64_t r = rows ? rows[t] : pos[t];
  (is_v ? vq : kq)[r * kv_dim + b * 32 + lane] = int8_t(rintf(x * id));
  if (lane == 0) (is_v ? vd : kd)[r * nb + b] = __float2half(d);
}

}  // namespace

void store_kv_q8(const float* qkv, int64_t ld, const int32_t* pos, const int32_t* rows, int64_t T, int64_t n_heads, int64_t n_kv,
                 int64_t hd, int8_t* kq, uint16_t* kd, int8_t* vq, uint16_t* vd, cudaStream_t s) {
  if (T == 0) return;
  const int64_t kv_dim = n_kv * hd;
  if (kv_dim % 32 != 0) throw UsageError("store_kv_q8: the KV width must be a multiple of 32");
  const dim3 grid{unsigned(T), unsigned(2 * kv_dim / 32), 1};
  LLMQ_LAUNCH(store_kv_q8_kernel, grid, 32, 0, s)(qkv, ld, n_heads * hd, pos, rows, int(kv_dim), kq, reinterpret_cast<__half*>(kd), vq,
                                                reinterpret_cast<__half*>(vd));
  check_launch("store_kv_q8");
}

}  // namespace llmq::cuda
