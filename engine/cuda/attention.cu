// Causal attention over the fp16 KV cache (engine/cuda/attention.h).
#include <cmath>

#include "engine/cuda/attention.h"
#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "formats/error.h"

namespace llmq::cuda {

namespace {

constexpr int kTile = 32;                     // positions per shared-memory tile (one per lane)
constexpr int kOut = int(kMaxHeadDim) / 32;   // outputs per lane: dims lane, lane + 32, ...

// grid (T, n_kv, n_splits), block (32, G): warp g is query head kvh · G + g - head_off (a rank's
// uneven GQA slice: warps whose head lies outside [0, n_heads) load tiles and score zeros, and
// write nothing).
// Shared memory: K tile [kTile, hd + 2] fp16 (rows padded so lane j's reads of row j fall in
// distinct banks), V tile [kTile, hd] fp16, the group's queries [G, hd] fp32 (scaled).
__global__ void attention_kernel(const float* __restrict__ q, int64_t ldq, const __half* __restrict__ kc,
                                 const __half* __restrict__ vc, const int32_t* __restrict__ pos, const int32_t* __restrict__ seq,
                                 const int32_t* __restrict__ tables, int64_t table_stride, int bt, const int8_t* __restrict__ kq,
                                 const __half* __restrict__ kd, const int8_t* __restrict__ vq, const __half* __restrict__ vd,
                                 int n_heads, int n_kv, int hd, int head_off,
                                 float scale, int n_splits, int part_len, float* __restrict__ partial, float* __restrict__ out,
                                 int64_t ldo) {
  unsigned char* smem = dynamic_smem();
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int G = blockDim.y, g = threadIdx.y, lane = threadIdx.x;
  const int h = kvh * G + g - head_off;
  const bool mine = h >= 0 && h < n_heads;  // this warp's query head is held here
  const int64_t kv_dim = int64_t(n_kv) * hd;
  const int kpitch = hd + 2;
  __half* Ks = reinterpret_cast<__half*>(smem);
  __half* Vs = Ks + kTile * kpitch;
  float* qs = reinterpret_cast<float*>(Vs + kTile * hd);

  const int lo = split * part_len, hi = min(pos[t] + 1, lo + part_len);
  const int32_t* table = tables ? tables + int64_t(seq[t]) * table_stride : nullptr;  // paged: this token's block table
  for (int i = lane; i < hd; i += 32) qs[g * hd + i] = mine ? q[int64_t(t) * ldq + int64_t(h) * hd + i] * scale : 0.0f;

  float m = -INFINITY, l = 0.0f, o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.0f;
  const int half_hd = hd / 2, threads = 32 * G, tid = g * 32 + lane;
  for (int p0 = lo; p0 < hi; p0 += kTile) {  // the same trip count for every thread of the block
    const int n = min(kTile, hi - p0);
    __syncthreads();  // the previous tile is consumed (and qs written, the first time)
    for (int idx = tid; idx < n * half_hd; idx += threads) {
      const int r = idx / half_hd, c = idx % half_hd, p = p0 + r;
      const int64_t row = table ? int64_t(table[p / bt]) * bt + p % bt : p;
      const int64_t src = row * kv_dim + int64_t(kvh) * hd;
      if (kq) {  // Q8_0 cache: element e has scale e / 32 (kv_dim and hd are multiples of 32)
        const int64_t e = src + 2 * c;
        const float dk = __half2float(kd[e / 32]), dv = __half2float(vd[e / 32]);
        Ks[r * kpitch + 2 * c] = __float2half(float(kq[e]) * dk), Ks[r * kpitch + 2 * c + 1] = __float2half(float(kq[e + 1]) * dk);
        Vs[r * hd + 2 * c] = __float2half(float(vq[e]) * dv), Vs[r * hd + 2 * c + 1] = __float2half(float(vq[e + 1]) * dv);
      } else {
        reinterpret_cast<__half2*>(Ks + r * kpitch)[c] = reinterpret_cast<const __half2*>(kc + src)[c];
        reinterpret_cast<__half2*>(Vs + r * hd)[c] = reinterpret_cast<const __half2*>(vc + src)[c];
      }
    }
    __syncthreads();
    float sc = -INFINITY;
    if (lane < n) {
      const __half2* kr = reinterpret_cast<const __half2*>(Ks + lane * kpitch);
      const float* qg = qs + g * hd;
      float acc = 0.0f;
      for (int i = 0; i < half_hd; ++i) {
        const float2 kf = __half22float2(kr[i]);
        acc += qg[2 * i] * kf.x + qg[2 * i + 1] * kf.y;
      }
      sc = acc;
    }
    const float m_new = fmaxf(m, warp_max(sc));  // finite: n >= 1
    const float corr = expf(m - m_new);           // 0 on the first tile (m = -inf)
    const float p = lane < n ? expf(sc - m_new) : 0.0f;
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kOut; ++i) o[i] *= corr;
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(kFullMask, p, j);
      const __half* vr = Vs + j * hd;
#pragma unroll
      for (int i = 0; i < kOut; ++i)
        if (lane + 32 * i < hd) o[i] += pj * __half2float(vr[lane + 32 * i]);
    }
    m = m_new;
  }
  if (!mine) return;  // after the last barrier
  if (n_splits == 1) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* dst = out + int64_t(t) * ldo + int64_t(h) * hd;
#pragma unroll
    for (int i = 0; i < kOut; ++i)
      if (lane + 32 * i < hd) dst[lane + 32 * i] = o[i] * inv;
  } else {
    float* dst = partial + ((int64_t(t) * n_heads + h) * n_splits + split) * (hd + 2);
#pragma unroll
    for (int i = 0; i < kOut; ++i)
      if (lane + 32 * i < hd) dst[lane + 32 * i] = o[i];
    if (lane == 0) dst[hd] = m, dst[hd + 1] = l;
  }
}

// grid (T, n_heads), one warp: out = Σ_c e^(m_c - M) o_c / Σ_c e^(m_c - M) l_c.
__global__ void attention_merge_kernel(const float* __restrict__ partial, int n_heads, int hd, int n_splits, float* __restrict__ out,
                                       int64_t ldo) {
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const float* P = partial + (int64_t(t) * n_heads + h) * n_splits * (hd + 2);
  float M = -INFINITY;
  for (int c = 0; c < n_splits; ++c) M = fmaxf(M, P[c * (hd + 2) + hd]);
  float denom = 0.0f;
  for (int c = 0; c < n_splits; ++c) {
    const float* pc = P + c * (hd + 2);
    if (pc[hd + 1] > 0.0f) denom += expf(pc[hd] - M) * pc[hd + 1];
  }
  const float inv = 1.0f / denom;
  for (int d = lane; d < hd; d += 32) {
    float acc = 0.0f;
    for (int c = 0; c < n_splits; ++c) {
      const float* pc = P + c * (hd + 2);
      if (pc[hd + 1] > 0.0f) acc += expf(pc[hd] - M) * pc[d];
    }
    out[int64_t(t) * ldo + int64_t(h) * hd + d] = acc * inv;
  }
}

}  // namespace

void attention(const float* q, int64_t ldq, const uint16_t* kc, const uint16_t* vc, const int32_t* pos, int64_t T, int64_t n_heads,
               int64_t n_kv, int64_t hd, float scale, int64_t n_splits, int64_t part_len, float* partial, float* out, int64_t ldo,
               cudaStream_t s, const KvPages& pages, const KvQ8& q8, const GqaSlice& gqa) {
  if (hd > kMaxHeadDim || hd % 2 != 0) throw UsageError("CUDA attention: head_dim " + std::to_string(hd) + " (even, at most 256)");
  if (n_kv <= 0 || n_heads <= 0) throw UsageError("CUDA attention: no heads");
  if (gqa.group == 0 && n_heads % n_kv != 0) throw UsageError("CUDA attention: n_heads must be a multiple of n_kv_heads");
  const int64_t G = gqa.group ? gqa.group : n_heads / n_kv, off = gqa.group ? gqa.head_offset : 0;
  // Local query heads 0 .. n_heads-1 read KV heads (h + off) / G: the first and the last must be
  // 0 and n_kv - 1.
  if (off < 0 || off >= G || (n_heads - 1 + off) / G != n_kv - 1)
    throw UsageError("CUDA attention: " + std::to_string(n_heads) + " query heads from offset " + std::to_string(off) +
                     " in groups of " + std::to_string(G) + " do not read " + std::to_string(n_kv) + " KV heads");
  if (n_splits > 1 && part_len % kTile != 0) throw UsageError("CUDA attention: part_len must be a multiple of 32");
  if (pages.tables && (pages.block_tokens <= 0 || !pages.seq)) throw UsageError("CUDA attention: paged cache without block size or sequences");
  if (q8.kq && hd % 32 != 0) throw UsageError("CUDA attention: a Q8_0 KV cache needs head_dim a multiple of 32");
  if (T == 0) return;
  if (G > 32) throw UsageError("CUDA attention: more than 32 query heads per KV head");
  const size_t smem = size_t(kTile) * (hd + 2) * 2 + size_t(kTile) * hd * 2 + size_t(G * hd) * 4;
  const dim3 grid{unsigned(T), unsigned(n_kv), unsigned(n_splits)}, block{32, unsigned(G), 1};
  if (smem > 48 * 1024)  // above the default limit of dynamic shared memory: opt in
    check(cudaFuncSetAttribute(reinterpret_cast<const void*>(attention_kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute");
  LLMQ_LAUNCH(attention_kernel, grid, block, smem, s)(q, ldq, reinterpret_cast<const __half*>(kc), reinterpret_cast<const __half*>(vc), pos,
                                             pages.seq, pages.tables, pages.table_stride, int(pages.block_tokens), q8.kq,
                                             reinterpret_cast<const __half*>(q8.kd), q8.vq, reinterpret_cast<const __half*>(q8.vd), int(n_heads), int(n_kv), int(hd), int(off), scale, int(n_splits), int(part_len), partial, out, ldo);
  check_launch("attention");
  if (n_splits > 1) {
    const dim3 merge_grid{unsigned(T), unsigned(n_heads), 1};
    LLMQ_LAUNCH(attention_merge_kernel, merge_grid, 32, 0, s)(partial, int(n_heads), int(hd), int(n_splits), out, ldo);
    check_launch("attention_merge");
  }
}

}  // namespace llmq::cuda
