// Per-token kernels of the GPU forward pass (engine/cuda/ops.h).
#include <algorithm>

#include "engine/cuda/attention.h"
#include "engine/cuda/act_q8.cuh"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/raw_blocks.cuh"
#include "base/error.h"

namespace llmq::cuda {

namespace {

constexpr int kNormThreads = 1024;
constexpr int kNormVec = 4;  // float4s per thread on the register path: rows of up to 16384


// One block per row. With y: x += y first (written back), then the norm of the sum. With q: the
// output also quantized per block of 32 into q (quantize_act's rule, act_q8.cuh).
// Rows of a multiple of 4 and at most 4 · kNormThreads · kNormVec elements take the register
// path: each thread loads its float4s of x (and y) at once, keeps them for the second pass, and
// a block of 32 outputs is 8 consecutive threads' float4s. (A row per 256 threads walking it
// twice cost ~20 us at T = 1: 32 dependent round trips to memory.) Other rows: plain loops.
// out may be y (each thread reads y[i] before it writes out[i], for the same i): no __restrict__.
// rmsnorm_kernel's register path for one row (n % 4 == 0, n <= 4 · blockDim.x · kNormVec).
__device__ __forceinline__ void rmsnorm_row_in_registers(float* orow, float* xr, const float* yr, const float* __restrict__ w, int64_t n,
                                                         float eps, const DeviceActQ8& q, float* red) {
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  const int n4 = int(n / 4);
  float4 v[kNormVec];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const int i = tid + k * nt;
    if (i < n4) {
      v[k] = reinterpret_cast<const float4*>(xr)[i];
      if (yr) {
        const float4 b = reinterpret_cast<const float4*>(yr)[i];
        v[k].x += b.x, v[k].y += b.y, v[k].z += b.z, v[k].w += b.w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const int i = tid + k * nt;
    if (i < n4) {
      if (yr) reinterpret_cast<float4*>(xr)[i] = v[k];
      ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
  }
  ss = block_sum(ss, red);
  const float scale = rsqrtf(ss / float(n) + eps);
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    // 8 consecutive threads hold a block of 32: all in range or none (n4 % 8 == 0 with q); the
    // whole warp takes part in the quantization's shuffles (groups out of range store nothing).
    const int i = tid + k * nt;
    const bool in = i < n4;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (in) {
      const float4 g = reinterpret_cast<const float4*>(w)[i];
      o = make_float4(v[k].x * scale * g.x, v[k].y * scale * g.y, v[k].z * scale * g.z, v[k].w * scale * g.w);
      reinterpret_cast<float4*>(orow)[i] = o;
    }
    const float ov[4] = {o.x, o.y, o.z, o.w};
    if (q.q && k * nt < n4) quantize_act_block<4>(ov, int64_t(blockIdx.x) * (n / 32) + i / 8, i % 8, in, q);
  }
}

// rmsnorm_kernel's plain path for one row (any n): two passes over memory.
__device__ __forceinline__ void rmsnorm_row_in_loops(float* orow, float* xr, const float* yr, const float* __restrict__ w, int64_t n,
                                                     float eps, const DeviceActQ8& q, float* red) {
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  float ss = 0.0f;
  for (int64_t i = tid; i < n; i += nt) {
    float v = xr[i];
    if (yr) xr[i] = v = v + yr[i];
    ss += v * v;
  }
  ss = block_sum(ss, red);
  const float scale = rsqrtf(ss / float(n) + eps);
  if (!q.q) {
    for (int64_t i = tid; i < n; i += nt) orow[i] = xr[i] * scale * w[i];
    return;
  }
  const int lane = tid % 32, warp = tid / 32, warps = nt / 32;
  for (int64_t b = warp; b < n / 32; b += warps) {
    const int64_t i = b * 32 + lane;
    const float v = xr[i] * scale * w[i];
    orow[i] = v;
    const float vv[1] = {v};
    quantize_act_block<1>(vv, int64_t(blockIdx.x) * (n / 32) + b, lane, true, q);
  }
}

__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(float* out, float* x, const float* y, const float* __restrict__ w,
                                                               int64_t n, float eps, DeviceActQ8 q) {
  pdl_begin();
  __shared__ float red[32];
  float* xr = x + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  const float* yr = y ? y + int64_t(blockIdx.x) * n : nullptr;
  if (n % 4 == 0 && n <= int64_t(4) * int(blockDim.x) * kNormVec) rmsnorm_row_in_registers(orow, xr, yr, w, n, eps, q, red);
  else rmsnorm_row_in_loops(orow, xr, yr, w, n, eps, q, red);
}

void check_quantizable(int64_t n, const DeviceActQ8* q, const char* what) {
  if (q && n % 32 != 0) throw UsageError(std::string(what) + ": a quantized output needs a width that is a multiple of 32");
}

}  // namespace

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s, const DeviceActQ8* q) {
  if (T == 0) return;
  check_quantizable(n, q, "rmsnorm");
  LLMQ_LAUNCH(rmsnorm_kernel, unsigned(T), kNormThreads, 0, s)(out, const_cast<float*>(x), nullptr, w, n, eps, q ? *q : DeviceActQ8{});
  check_launch("rmsnorm");
}

void add_rmsnorm(float* x, const float* y, float* out, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s, const DeviceActQ8* q) {
  if (T == 0) return;
  check_quantizable(n, q, "add_rmsnorm");
  LLMQ_LAUNCH(rmsnorm_kernel, unsigned(T), kNormThreads, 0, s)(out, x, y, w, n, eps, q ? *q : DeviceActQ8{});
  check_launch("add_rmsnorm");
}

namespace {

// Items of a token: its rotation pairs of q and k ((n_heads + n_kv) · hd/2), then its pairs of v
// elements (n_kv · hd/2); grid (ceil(items / kRopeItems), T). A block first works out the
// token's hd/2 angles once (fp64, shared memory: they were computed per pair before, 48 times
// over for a 7B model's 48 q and k heads), then each thread takes kRopeItems / kRopeThreads items.
constexpr int kRopeThreads = 256, kRopeItems = 1024;

__global__ void __launch_bounds__(kRopeThreads) rope_store_kv_kernel(float* __restrict__ qkv, int64_t ld, const int32_t* __restrict__ pos,
                                                                     const int32_t* __restrict__ rows, int n_heads, int n_kv, int hd,
                                                                     const double* __restrict__ freqs, bool interleaved, __half* __restrict__ kc,
                                                                     __half* __restrict__ vc) {
  pdl_begin();
  __shared__ float cs[kMaxHeadDim / 2][2];  // cos, sin of angle i
  const int64_t t = blockIdx.y;
  const int half = hd / 2, kv_dim = n_kv * hd;
  const int rot_pairs = (n_heads + n_kv) * half, v_pairs = n_kv * half;
  const int64_t p = pos[t], r = rows ? rows[t] : p;  // position (angles), cache row (store)
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double angle = double(p) * freqs[i];  // as the CPU's rope_angles
    cs[i][0] = float(cos(angle)), cs[i][1] = float(sin(angle));
  }
  __syncthreads();
  float* row = qkv + t * ld;
  const int end = min(rot_pairs + v_pairs, int(blockIdx.x + 1) * kRopeItems);
  for (int idx = int(blockIdx.x) * kRopeItems + threadIdx.x; idx < end; idx += blockDim.x) {
    if (idx < rot_pairs) {
      const int head = idx / half, i = idx % half;
      const float c = cs[i][0], sn = cs[i][1];
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
}

}  // namespace

void rope_store_kv(float* qkv, int64_t ld, const int32_t* pos, const int32_t* rows, int64_t T, int64_t n_heads, int64_t n_kv,
                   int64_t hd, const double* freqs, RopeLayout layout, uint16_t* kc, uint16_t* vc, cudaStream_t s) {
  if (T == 0) return;
  if (hd > kMaxHeadDim || hd % 2 != 0) throw UsageError("rope_store_kv: head_dim must be even and at most 256");
  const int64_t items = (n_heads + 2 * n_kv) * (hd / 2);
  const dim3 grid(unsigned((items + kRopeItems - 1) / kRopeItems), unsigned(T));
  LLMQ_LAUNCH(rope_store_kv_kernel, grid, kRopeThreads, 0, s)(qkv, ld, pos, rows, int(n_heads), int(n_kv), int(hd), freqs, layout == RopeLayout::Interleaved,
                                            reinterpret_cast<__half*>(kc), reinterpret_cast<__half*>(vc));
  check_launch("rope_store_kv");
}

namespace {

// With q: each warp takes whole blocks of 32 outputs (H a multiple of 32) and quantizes them
// as quantize_act; the grid stride is a multiple of 32 (blockDim.x is), so a warp never straddles
// two blocks.
template <bool kGelu>
__global__ void gated_act_kernel(float* __restrict__ out, const float* __restrict__ h, int64_t T, int64_t H, DeviceActQ8 q) {
  pdl_begin();
  const int64_t n = T * H, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x / 32 * 32; i0 < n; i0 += stride) {  // warp-uniform
    const int64_t i = i0 + threadIdx.x % 32;
    float v = 0.0f;
    if (i < n) {
      const int64_t t = i / H, j = i % H;
      const float g = h[t * 2 * H + j], u = h[t * 2 * H + H + j];
      if constexpr (kGelu) out[i] = v = g / (1.0f + expf(-1.5957691216057308f * (g + 0.044715f * g * g * g))) * u;  // as the CPU's geglu
      else out[i] = v = g / (1.0f + expf(-g)) * u;
    }
    const float vv[1] = {v};
    if (q.q) quantize_act_block<1>(vv, i0 / 32, int(threadIdx.x % 32), true, q);
  }
}

__global__ void softcap_kernel(float* __restrict__ x, int64_t n, float cap) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) x[i] = cap * tanhf(x[i] / cap);
}

// One warp per head of a token's row: Σx² over the head's hd elements (fp32 lane sums, then the
// warp's), then x · w / sqrt(mean + eps) in place. Heads [0, n_q) take wq, [n_q, n_q + n_k) wk.
constexpr int kHeadNormWarps = 4;
__global__ void head_rmsnorm_kernel(float* __restrict__ qkv, int64_t ld, int n_q, int n_k, int hd, const float* __restrict__ wq,
                                    const float* __restrict__ wk, float eps) {
  pdl_begin();
  const int head = int(blockIdx.x) * kHeadNormWarps + int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  if (head >= n_q + n_k) return;  // warp-uniform
  float* x = qkv + int64_t(blockIdx.y) * ld + int64_t(head) * hd;
  const float* w = head < n_q ? wq : wk;
  float ss = 0.0f;
  for (int i = lane; i < hd; i += 32) ss += x[i] * x[i];
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float scale = rsqrtf(ss / float(hd) + eps);
  for (int i = lane; i < hd; i += 32) x[i] = x[i] * scale * w[i];
}

__global__ void add_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) x[i] += y[i];
}

__global__ void add_bias_kernel(float* __restrict__ x, int64_t ld, const float* __restrict__ b, int64_t T, int64_t n) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * n; i += int64_t(gridDim.x) * blockDim.x)
    x[(i / n) * ld + i % n] += b[i % n];
}

// Element j of row r of a split-layout matrix, as fp32.
__device__ __forceinline__ float weight_at(const DeviceWeight& w, int64_t r, int64_t j) {
  const int64_t cols = w.cols, b = r * (cols / 32) + j / 32;
  switch (w.type) {
    case DType::F32: return reinterpret_cast<const float*>(w.q)[r * cols + j];
    case DType::F16: return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(w.q)[r * cols + j]);
    case DType::BF16: return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(w.q)[r * cols + j]);
    case DType::Q8_0: return fp16_bits_to_float(w.d[b]) * float(reinterpret_cast<const int8_t*>(w.q)[r * cols + j]);
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: {
      const int k = int(j % 32);
      const uint8_t byte = w.q[b * 16 + k % 16];
      int q = k < 16 ? byte & 0x0f : byte >> 4;
      if (w.type == DType::Q6_K) {  // d sc (q - 32): the high crumb (matmul.h DeviceWeight), the half's int8 scale
        q |= int((reinterpret_cast<const uint8_t*>(w.h)[b * 8 + k % 8] >> (2 * (k / 8))) & 3) << 4;
        return fp16_bits_to_float(w.k[2 * (b / 8)]) * float(int8_t(w.d[b] >> (8 * (k / 16)))) * float(q - 32);
      }
      if (w.h) q |= int((w.h[b] >> k) & 1) << 4;  // Q5's fifth bit
      if (w.k)  // Q4_K, Q5_K: (d sc) q - dmin mn
        return fp16_bits_to_float(w.k[2 * (b / 8)]) * float(w.d[b] & 0xff) * float(q) - fp16_bits_to_float(w.k[2 * (b / 8) + 1]) * float(w.d[b] >> 8);
      const float d = fp16_bits_to_float(w.d[b]);
      return w.m ? d * float(q) + fp16_bits_to_float(w.m[b]) : d * float(q - (w.h ? 16 : 8));
    }
    default: {  // raw layout (raw_blocks.cuh): decode the element's block
      float v[32];
      raw_block(w.type, w.q + r * int64_t(raw_row_bytes(w.type, cols)), j / 32, v);
      return v[j % 32];
    }
  }
}

__global__ void embedding_kernel(float* __restrict__ x, DeviceWeight table, const int32_t* __restrict__ tokens, float scale) {
  pdl_begin();
  const int64_t t = blockIdx.y, r = tokens[t];
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < table.cols; j += int64_t(gridDim.x) * blockDim.x)
    x[t * table.cols + j] = weight_at(table, r, j) * scale;
}

unsigned grid_for(int64_t n, int threads) { return unsigned(std::min<int64_t>((n + threads - 1) / threads, 8192)); }

}  // namespace

void gated_act(Activation act, float* out, const float* h, int64_t T, int64_t H, cudaStream_t s, const DeviceActQ8* q) {
  if (T * H == 0) return;
  check_quantizable(H, q, "gated_act");
  if (act == Activation::GeGLU) LLMQ_LAUNCH(gated_act_kernel<true>, grid_for(T * H, 256), 256, 0, s)(out, h, T, H, q ? *q : DeviceActQ8{});
  else LLMQ_LAUNCH(gated_act_kernel<false>, grid_for(T * H, 256), 256, 0, s)(out, h, T, H, q ? *q : DeviceActQ8{});
  check_launch("gated_act");
}

void softcap(float* x, int64_t n, float cap, cudaStream_t s) {
  if (n == 0) return;
  LLMQ_LAUNCH(softcap_kernel, grid_for(n, 256), 256, 0, s)(x, n, cap);
  check_launch("softcap");
}

void head_rmsnorm(float* qkv, int64_t ld, int64_t T, int64_t n_q, int64_t n_k, int64_t hd, const float* wq, const float* wk, float eps,
                  cudaStream_t s) {
  if (T * (n_q + n_k) == 0) return;
  const dim3 grid(unsigned((n_q + n_k + kHeadNormWarps - 1) / kHeadNormWarps), unsigned(T));
  LLMQ_LAUNCH(head_rmsnorm_kernel, grid, 32 * kHeadNormWarps, 0, s)(qkv, ld, int(n_q), int(n_k), int(hd), wq, wk, eps);
  check_launch("head_rmsnorm");
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

void embedding(float* x, const DeviceWeight& table, const int32_t* tokens, int64_t T, cudaStream_t s, float scale) {
  if (T == 0) return;
  const dim3 grid(unsigned((table.cols + 255) / 256), unsigned(T));
  LLMQ_LAUNCH(embedding_kernel, grid, 256, 0, s)(x, table, tokens, scale);
  check_launch("embedding");
}

namespace {

__global__ void gather_rows_kernel(float* __restrict__ out, const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t n) {
  pdl_begin();
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
  pdl_begin();
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
