// Causal attention over the fp16 KV cache (engine/cuda/attention.h).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "engine/cuda/attention.h"
#include "engine/cuda/act_q8.cuh"
#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "engine/cuda/mma.cuh"
#include "base/env_setting.h"
#include "base/error.h"

namespace llmq::cuda {

namespace {

constexpr int kTile = 32;                     // positions per shared-memory tile (one per lane)
constexpr int kOut = int(kMaxHeadDim) / 32;   // outputs per lane: dims lane, lane + 32, ...
constexpr int kPad = 8;                       // halves after each K/V row in shared memory

// grid (ceil(T / TQ), n_kv, n_splits), block (32, G, TQ): warp (g, z) is query head
// kvh · G + g - head_off of token blockIdx.x · TQ + z. The TQ tokens of a block (one sequence:
// the caller passes TQ > 1 only without block tables) share every K/V tile; each warp masks
// the positions past its own token's. A rank's uneven GQA slice: warps whose head lies outside
// [0, n_heads) load tiles and write nothing.
// Tiles of kTile positions are double-buffered in shared memory: the next tile's copies (cp.async,
// 16 bytes each) are in flight while the current one is scored, so a tile costs one memory round
// trip, not one per element. A Q8_0 cache, or head_dim not a multiple of 8, loads element by
// element instead (dequantized to fp16 on the way).
// Shared memory: 2 stages of K tile [kTile, hd + 8] and V tile [kTile, hd + 8] fp16 (a lane reads
// its K row in 16-byte pieces: 8 lanes per phase fall in distinct banks with the 8-half pad), then
// the block's queries [TQ, G, hd] fp32 (scaled).
struct AttnArgs {
  const float* q;
  int64_t ldq;
  const __half *kc, *vc;
  const int32_t *pos, *seq, *tables;
  int64_t table_stride;
  int bt;
  const int8_t* kq;
  const __half* kd;
  const int8_t* vq;
  const __half* vd;
  int T, n_heads, n_kv, hd, head_off, group;  // group: query heads per KV head (GqaSlice)
  float scale;
  int n_splits, part_len;
  float* partial;
  float* out;
  int64_t ldo;
  int window;  // a sliding-window layer's window (positions seen, the token's own included); 0: none
};

// The first position token position `pos` sees: pos + 1 - window under a window, else 0 (the
// CPU's ModelConfig::window_start).
__device__ __forceinline__ int attn_first(const AttnArgs& a, int pos) { return a.window > 0 ? max(0, pos + 1 - a.window) : 0; }

// Issues (or, element-wise, performs) the copies of positions p0 .. p0 + n - 1 into one stage,
// by threads tid = 0 .. threads-1 (the block, or one group of its warps).
__device__ __forceinline__ void attn_load_tile(const AttnArgs& a, __half* Ks, __half* Vs, const int32_t* table, int kvh, int p0, int n,
                                               bool vec, int tid, int threads) {
  const int hd = a.hd, pitch = hd + kPad;
  const int64_t kv_dim = int64_t(a.n_kv) * hd;
  auto at = [&](int r, int e) {  // the cache offset of element e of tile row r (paged: through the table)
    const int p = p0 + r;
    const int64_t row = table ? int64_t(table[p / a.bt]) * a.bt + p % a.bt : p;
    return row * kv_dim + int64_t(kvh) * hd + e;
  };
  if (vec) {
    const int C = hd / 8;  // 16-byte pieces per row
    auto piece = [&](int r, int c) {
      const int64_t o = at(r, 8 * c);
      cp_async16(Ks + r * pitch + 8 * c, a.kc + o);
      cp_async16(Vs + r * pitch + 8 * c, a.vc + o);
    };
    if (threads % C == 0)  // each thread keeps one piece column and walks rows: no division per piece
      for (int r = tid / C; r < n; r += threads / C) piece(r, tid % C);
    else
      for (int idx = tid; idx < n * C; idx += threads) piece(idx / C, idx % C);
    return;
  }
  for (int idx = tid; idx < n * hd; idx += threads) {
    const int r = idx / hd, e = idx % hd;
    const int64_t o = at(r, e);
    if (a.kq) {  // Q8_0 cache: element o has scale o / 32 (kv_dim and hd are multiples of 32)
      Ks[r * pitch + e] = __float2half(float(a.kq[o]) * __half2float(a.kd[o / 32]));
      Vs[r * pitch + e] = __float2half(float(a.vq[o]) * __half2float(a.vd[o / 32]));
    } else {
      Ks[r * pitch + e] = a.kc[o], Vs[r * pitch + e] = a.vc[o];
    }
  }
}

// One warp's online-softmax step over a tile of n positions from p0 (K and V rows in shared
// memory, pitch hd + kPad): lane j scores position p0 + j against the warp's query qw (positions
// outside [first, lim) are masked: the causal limit and a sliding window's start), then (m, l, o)
// absorb the tile (Milakov & Gimelshein 2018). o holds dims lane, lane + 32, ... of the
// unnormalized output.
__device__ __forceinline__ void attn_tile_update(const __half* Ks, const __half* Vs, const float* qw, int p0, int n, int first, int lim,
                                                 int hd, bool vec, float& m, float& l, float (&o)[kOut]) {
  const int lane = int(threadIdx.x) % 32, pitch = hd + kPad;
  const int p = p0 + lane;
  float sc = -INFINITY;
  if (lane < n && p >= first && p < lim) {
    float acc = 0.0f;
    if (vec) {
      // Four independent sums (one per 32-bit word of a piece): a single chain of hd dependent
      // FMAs was the tile's critical path.
      const uint4* kr = reinterpret_cast<const uint4*>(Ks + lane * pitch);
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int c = 0; c < hd / 8; ++c) {
        const uint4 kk = kr[c];
        const float* qc = qw + 8 * c;
        const uint32_t w4[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // the bits as halves (no type punning: the emulator's compiler would not see the store)
          const float k0 = __half2float(__ushort_as_half(uint16_t(w4[e] & 0xffffu)));
          const float k1 = __half2float(__ushort_as_half(uint16_t(w4[e] >> 16)));
          part[e] += qc[2 * e] * k0 + qc[2 * e + 1] * k1;
        }
      }
      acc = (part[0] + part[1]) + (part[2] + part[3]);
    } else {
      for (int i = 0; i < hd; ++i) acc += qw[i] * __half2float(Ks[lane * pitch + i]);
    }
    sc = acc;
  }
  const float tmax = warp_max(sc);
  if (tmax != -INFINITY) {  // warp-uniform: some position of this tile is this warp's
    const float m_new = fmaxf(m, tmax);
    const float corr = expf(m - m_new);  // 0 on the warp's first tile (m = -inf)
    const float pr = sc != -INFINITY ? expf(sc - m_new) : 0.0f;
    l = l * corr + warp_sum(pr);
#pragma unroll
    for (int i = 0; i < kOut; ++i) o[i] *= corr;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(kFullMask, pr, j);
      const __half* vr = Vs + j * pitch;
#pragma unroll
      for (int i = 0; i < kOut; ++i)
        if (lane + 32 * i < hd) o[i] += pj * __half2float(vr[lane + 32 * i]);
    }
    m = m_new;
  }
}

// A warp's result for token t, query head h: O / l into a.out when the positions are not split,
// else O, m and l into split's slot of a.partial for the merge.
__device__ __forceinline__ void attn_store_part(const AttnArgs& a, const float (&o)[kOut], float m, float l, int t, int h, int split, int lane,
                                                int hd) {
  if (a.n_splits == 1) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* dst = a.out + int64_t(t) * a.ldo + int64_t(h) * hd;
#pragma unroll
    for (int i = 0; i < kOut; ++i)
      if (lane + 32 * i < hd) dst[lane + 32 * i] = o[i] * inv;
  } else {
    float* dst = a.partial + ((int64_t(t) * a.n_heads + h) * a.n_splits + split) * (hd + 2);
#pragma unroll
    for (int i = 0; i < kOut; ++i)
      if (lane + 32 * i < hd) dst[lane + 32 * i] = o[i];
    if (lane == 0) dst[hd] = m, dst[hd + 1] = l;
  }
}

template <int TQ>
__global__ void attention_kernel(AttnArgs a) {
  pdl_begin();
  unsigned char* smem = dynamic_smem();
  const int kvh = int(blockIdx.y), split = int(blockIdx.z);
  const int G = int(blockDim.y), g = int(threadIdx.y), z = int(threadIdx.z), lane = int(threadIdx.x);
  const int t0 = int(blockIdx.x) * TQ, t = t0 + z;
  const int h = kvh * G + g - a.head_off, hd = a.hd, pitch = hd + kPad;
  const bool mine = h >= 0 && h < a.n_heads && t < a.T;  // this warp's query head is held here, its token exists
  const bool vec = !a.kq && hd % 8 == 0;
  // Stage s: K tile at Kst(s), V tile right after it (pointers computed, not held in an array:
  // a run-time index would put the array in local memory).
  __half* const base = reinterpret_cast<__half*>(smem);
  auto Kst = [&](int st) { return base + st * 2 * kTile * pitch; };
  float* qs = reinterpret_cast<float*>(smem + size_t(4) * kTile * pitch * sizeof(__half));
  float* qw = qs + (z * G + g) * hd;  // this warp's query

  // Positions this block covers: the part's, up to the furthest of its tokens' and from the
  // earliest of their windows' starts (the part's positions before every window: not loaded).
  int top = 0, bot = 1 << 30;
  for (int k = 0; k < TQ && t0 + k < a.T; ++k) top = max(top, a.pos[t0 + k] + 1), bot = min(bot, attn_first(a, a.pos[t0 + k]));
  const int lo = max(split * a.part_len, bot), hi = min(top, split * a.part_len + a.part_len);
  const int lim = mine ? min(a.pos[t] + 1, hi) : 0;  // this warp's positions: [first, lim)
  const int first = mine ? attn_first(a, a.pos[t]) : 0;
  const int32_t* table = a.tables ? a.tables + int64_t(a.seq[t0]) * a.table_stride : nullptr;  // paged: TQ == 1
  for (int i = lane; i < hd; i += 32) qw[i] = mine ? a.q[int64_t(t) * a.ldq + int64_t(h) * hd + i] * a.scale : 0.0f;

  float m = -INFINITY, l = 0.0f, o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.0f;
  const int n_tiles = hi > lo ? (hi - lo + kTile - 1) / kTile : 0;
  const int tid = int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  const int threads = int(blockDim.x * blockDim.y * blockDim.z);
  if (n_tiles > 0) attn_load_tile(a, Kst(0), Kst(0) + kTile * pitch, table, kvh, lo, min(kTile, hi - lo), vec, tid, threads);
  cp_async_commit();
  for (int it = 0; it < n_tiles; ++it) {  // the same trip count for every thread of the block
    const int p0 = lo + it * kTile, n = min(kTile, hi - p0);
    if (it + 1 < n_tiles) {  // the stage read two iterations ago: free since the barrier closing the last one
      const int p1 = p0 + kTile;
      attn_load_tile(a, Kst((it + 1) & 1), Kst((it + 1) & 1) + kTile * pitch, table, kvh, p1, min(kTile, hi - p1), vec, tid, threads);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's copies (this thread's) have landed ...
    __syncthreads();     // ... and everyone's (and qs is written, the first time)
    const __half* Ks = Kst(it & 1);
    const __half* Vs = Ks + kTile * pitch;
    attn_tile_update(Ks, Vs, qw, p0, n, first, lim, hd, vec, m, l, o);
    __syncthreads();  // everyone is done with this stage before it is filled again
  }
  cp_async_wait<0>();
  if (!mine) return;  // after the last barrier
  attn_store_part(a, o, m, l, t, h, split, lane, hd);
}

// ---------------------------------------------------------------- decode: pieces of version 3
//
// The flash-decoding parts of a decode step (n_splits > 1) over an fp16 cache, head_dim 64, 128
// or 256, GQA groups up to 8, split over a block's warps: each warp takes a contiguous slice of
// the part's positions, scores them with 8 lanes per position (each lane's HD/8 dims read as
// 16-byte loads straight from the cache), keeps the softmax online, and accumulates V with a
// lane per HD/32 dims (a position's row read by the whole warp, coalesced). Shared memory holds
// only the warps' (o, m, l) per head [G][warps][HD + 2], which warp w combines for heads w,
// w + warps, ... into the part's (o, m, l) (or the output when n_splits == 1). Version 1
// (attention_kernel) gives a part one warp per query head and stages 32-position tiles in shared
// memory (35 KiB per block at head_dim 128), so few warps share an SM and each walks a long
// dependent chain; it stays for the shapes version 3 does not take. (A version 2 between them,
// one round trip per V row and a GQA group's rows re-read per head, lost to version 3 on an H200
// and was removed: dev/README.md #15.)
constexpr int kDecMaxGroup = 8;

// u = the VL halves at src as VL/2 words (VL = 2, 4 or 8: one 4-, 8- or 16-byte load).
template <int VL>
__device__ __forceinline__ void load_halves(uint32_t (&u)[VL / 2], const __half* src) {
  if constexpr (VL == 8) {
    const uint4 x = *reinterpret_cast<const uint4*>(src);
    u[0] = x.x, u[1] = x.y, u[2] = x.z, u[3] = x.w;
  } else if constexpr (VL == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(src);
    u[0] = x.x, u[1] = x.y;
  } else {
    u[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

// dst[i] += w · the VL halves packed in u.
template <int VL>
__device__ __forceinline__ void axpy_words(float (&dst)[VL], float w, const uint32_t (&u)[VL / 2]) {
#pragma unroll
  for (int i = 0; i < VL / 2; ++i) {
    dst[2 * i] += w * fp16_bits_to_float(uint16_t(u[i] & 0xffffu));
    dst[2 * i + 1] += w * fp16_bits_to_float(uint16_t(u[i] >> 16));
  }
}

// Σ_i q[i] · the 8 halves packed in k (one 16-byte load of a K row).
__device__ __forceinline__ float dot8(const float* q, const uint4& k) {
  const uint32_t w4[4] = {k.x, k.y, k.z, k.w};
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    s += q[2 * e] * fp16_bits_to_float(uint16_t(w4[e] & 0xffffu)) + q[2 * e + 1] * fp16_bits_to_float(uint16_t(w4[e] >> 16));
  return s;
}

// The cache offset (halves) of position p's row of KV head kvh: row p, or paged through the
// token's block table.
__device__ __forceinline__ int64_t kv_at(const AttnArgs& a, const int32_t* table, int kvh, int p, int hd) {
  const int64_t r = table ? int64_t(table[p / a.bt]) * a.bt + p % a.bt : p;
  return r * int64_t(a.n_kv) * hd + int64_t(kvh) * hd;
}

// Marks the heads of an empty part (past the token's position: a graph replays every part) with
// l = 0, which the merge skips; warp w takes heads w, w + warps, ... of the group.
__device__ __forceinline__ void mark_empty_part(const AttnArgs& a, int t, int kvh, int split, int w, int warps, int lane, int hd) {
  for (int g = w; g < a.group; g += warps) {
    const int h = kvh * a.group + g - a.head_off;
    if (lane == 0 && h >= 0 && h < a.n_heads) {
      float* part = a.partial + ((int64_t(t) * a.n_heads + h) * a.n_splits + split) * (hd + 2);
      part[hd] = -INFINITY, part[hd + 1] = 0.0f;
    }
  }
}

// The warps' (o, m, l) of each head in shared memory [G][warps][HD + 2] combined into the part's
// (o, m, l), or the output when n_splits == 1: warp w takes heads w, w + warps, ...; slices with
// l = 0 (empty) weigh nothing. After a __syncthreads().
template <int HD>
__device__ __forceinline__ void combine_warps(const AttnArgs& a, const float* sm, int t, int kvh, int split, int w, int warps, int lane) {
  constexpr int VL = HD / 32, stride = HD + 2;
  for (int g = w; g < a.group; g += warps) {
    const int h = kvh * a.group + g - a.head_off;
    if (h < 0 || h >= a.n_heads) continue;
    const float* src = sm + g * warps * stride;
    float M = -INFINITY, L = 0.0f, acc[VL];
#pragma unroll
    for (int i = 0; i < VL; ++i) acc[i] = 0.0f;
    for (int j = 0; j < warps; ++j)
      if (src[j * stride + HD + 1] > 0.0f) M = fmaxf(M, src[j * stride + HD]);
    for (int j = 0; j < warps; ++j) {
      const float lj = src[j * stride + HD + 1];
      if (lj <= 0.0f) continue;  // an empty slice
      const float wj = expf(src[j * stride + HD] - M);
      L += wj * lj;
#pragma unroll
      for (int i = 0; i < VL; ++i) acc[i] += wj * src[j * stride + lane * VL + i];
    }
    if (a.n_splits == 1) {
      const float inv = L > 0.0f ? 1.0f / L : 0.0f;
      float* out = a.out + int64_t(t) * a.ldo + int64_t(h) * HD + lane * VL;
#pragma unroll
      for (int i = 0; i < VL; ++i) out[i] = acc[i] * inv;
    } else {
      float* part = a.partial + ((int64_t(t) * a.n_heads + h) * a.n_splits + split) * stride;
#pragma unroll
      for (int i = 0; i < VL; ++i) part[lane * VL + i] = acc[i];
      if (lane == 0) part[HD] = M, part[HD + 1] = L;
    }
  }
}

// ---------------------------------------------------------------- decode, version 3
//
// The default (decode_version) wherever the shape allows it; dev/cuda/attn.cu times it against
// version 1 (H200: 0.48-0.93x its time, dev/README.md #19). The removed version 2 took 19.3 us a
// layer at 512 cached positions on an H200, where llama-2-7b's 8.4 MB of K and V take 2 us at
// the copy rate: latency, not bytes. Three changes from it:
//  - The step's positions are spread over all its parts: part c takes a chunk of
//    ceil(n / parts) positions rounded up to 32 (n = pos + 1) instead of the fixed part_len, so
//    a step at 512 positions keeps 16 parts of a head busy, not 8 (parts past the last chunk
//    are empty, l = 0). The parts are n_splits, fewer for many tokens (v3_parts).
//  - A warp takes its slice (chunk / 4 positions) in rounds of 8 and issues all of a round's K
//    and V loads before the first use: one memory round trip a round, where version 2 paid one
//    for K and then one per V row.
//  - Every query head of a GQA group is scored against the K/V rows the warp read once: the
//    group's queries wait in shared memory, the accumulators o [GM][HD / 32] in registers (GM
//    the group's bucket 1, 2, 4 or 8). Version 2 re-read the rows per head.
// grid (T, n_kv, n_splits), block (32, kV3Warps); shared memory: the queries [G][HD] fp32, then
// the warps' (o, m, l) [G][kV3Warps][HD + 2], combined by combine_warps.
constexpr int kV3Warps = 4;
constexpr int kV3Round = 8;  // positions a warp scores per round: 2 passes of 4 positions x 8 lanes

// The positions part c of a decode step takes, version 3: the n positions from the step's base
// (0, or under a sliding window its start rounded down to 32) over n_splits parts, rounded up to
// 32 (a whole round for each of the 4 warps).
__device__ __forceinline__ int v3_chunk(int n, int n_splits) { return ((n + n_splits - 1) / n_splits + 31) / 32 * 32; }

// Version 3's part count for T tokens over n_kv KV heads: about kV3Blocks blocks (4 of 4 warps on
// each of an H100/H200's 132 SMs), at least 1 and at most n_splits. A batch of many sequences
// takes fewer, longer parts: with n_splits fixed by the context, a 32-sequence step at 600
// positions launched 64 parts per (token, KV head), 45 of them empty; at one part the kernel
// writes the output and no merge runs. On an H200 (sixth GPU session, whole decode, targets
// interleaved) 528 against the earlier 2048: llama-2-7b Q4_0 at 4,096 positions 430 -> 448
// tok/s, a batch of 32 5,337 -> 5,447, at 640 positions and on llama-3-8b within 0.5%.
constexpr int64_t kV3Blocks = 528;
// set_decode_v3_blocks, or LLMQ_CUDA_V3_BLOCKS at start-up: 0 = kV3Blocks
EnvSetting g_v3_blocks([] {
  const char* e = std::getenv("LLMQ_CUDA_V3_BLOCKS");
  return e ? std::clamp(std::atoi(e), 0, 1 << 20) : 0;
});
int64_t v3_parts(int64_t T, int64_t n_kv, int64_t n_splits) {
  const int64_t set = g_v3_blocks.get(), target = set > 0 ? set : kV3Blocks;
  return std::clamp<int64_t>((target + T * n_kv - 1) / (T * n_kv), 1, n_splits);
}

size_t decode_v3_smem(int64_t G, int64_t hd) { return size_t(G) * size_t(hd) * 4 + size_t(G) * kV3Warps * size_t(hd + 2) * 4; }

// One round of head g's online softmax: the 8 positions' scores from this lane's K pieces
// (kr[pass]: position p0 + 4 pass + sub, dims sl · HD/8 ..), masked outside [k_lo, nv) (k_lo > 0
// only in the round holding a sliding window's start; k_lo < nv), folded into (m, l) and o with
// the round's V rows (vr[k]: position p0 + k, dims lane · HD/32 ..).
template <int HD>
__device__ __forceinline__ void v3_round(const float* qg, const uint4 (&kr)[2][HD / 64], const uint32_t (&vr)[kV3Round][HD / 64], int k_lo,
                                         int nv, float& m, float& l, float (&o)[HD / 32]) {
  constexpr int VL = HD / 32;
  const int lane = int(threadIdx.x), sl = lane & 7;
  float part[2];
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    part[pass] = 0.0f;
#pragma unroll
    for (int c = 0; c < HD / 64; ++c) part[pass] += dot8(qg + sl * (HD / 8) + 8 * c, kr[pass][c]);
#pragma unroll
    for (int x = 1; x < 8; x <<= 1) part[pass] += __shfl_xor_sync(kFullMask, part[pass], x);
  }
  float sc[kV3Round], mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kV3Round; ++k) {
    sc[k] = __shfl_sync(kFullMask, part[k / 4], 8 * (k % 4));
    sc[k] = k >= k_lo && k < nv ? sc[k] : -INFINITY;
    mx = fmaxf(mx, sc[k]);
  }
  const float m_new = fmaxf(m, mx), corr = expf(m - m_new);  // corr 0 on the first round (m = -inf)
  l *= corr;
#pragma unroll
  for (int i = 0; i < VL; ++i) o[i] *= corr;
#pragma unroll
  for (int k = 0; k < kV3Round; ++k) {
    const float pk = expf(sc[k] - m_new);  // 0 where masked
    l += pk;
    axpy_words<VL>(o, pk, vr[k]);
  }
  m = m_new;
}

template <int HD, int GM>
__global__ void __launch_bounds__(32 * kV3Warps) attention_decode_v3_kernel(AttnArgs a) {
  pdl_begin();
  constexpr int KL = HD / 8, VL = HD / 32, stride = HD + 2;
  const int G = a.group;  // <= GM
  float* qs = reinterpret_cast<float*>(dynamic_smem());  // [G][HD]
  float* sm = qs + G * HD;                                // [G][kV3Warps][HD + 2]
  const int t = int(blockIdx.x), kvh = int(blockIdx.y), split = int(blockIdx.z);
  const int w = int(threadIdx.y), lane = int(threadIdx.x), sub = lane >> 3, sl = lane & 7;
  // The step's positions [first, n): the parts split [base, n), base = first rounded down to 32,
  // so that chunks, slices and rounds stay on multiples of 8 (one page lookup a round).
  const int n = a.pos[t] + 1, first = attn_first(a, a.pos[t]), base = first / 32 * 32;
  const int chunk = v3_chunk(n - base, a.n_splits), lo = base + split * chunk, hi = min(lo + chunk, n);
  const int S = chunk / kV3Warps, p_begin = lo + w * S, p_end = min(p_begin + S, hi);  // this warp's slice (warp-uniform)
  if (lo >= hi) {  // a part past the token's position
    mark_empty_part(a, t, kvh, split, w, kV3Warps, lane, HD);
    return;  // block-uniform: before any barrier
  }
  const int32_t* table = a.tables ? a.tables + int64_t(a.seq[t]) * a.table_stride : nullptr;
  for (int i = w * 32 + lane; i < G * HD; i += 32 * kV3Warps) {
    const int h = kvh * G + i / HD - a.head_off;
    qs[i] = h >= 0 && h < a.n_heads ? a.q[int64_t(t) * a.ldq + int64_t(h) * HD + i % HD] * a.scale : 0.0f;
  }
  __syncthreads();
  float m[GM], l[GM], o[GM][VL];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < VL; ++i) o[g][i] = 0.0f;
  }
  // A round's 8 positions p0.. (p0 a multiple of 8: chunk and slice are) lie in one page when
  // block_tokens is a multiple of 8: one table lookup a round, not one per position and load.
  const bool one_page = !table || a.bt % kV3Round == 0;
  // Rounds from the one holding `first` (positions before it weigh 0); a slice wholly before it
  // runs none and stays empty (m = -inf, l = 0).
  for (int p0 = max(p_begin, first / kV3Round * kV3Round); p0 < p_end; p0 += kV3Round) {
    uint4 kr[2][KL / 8];
    uint32_t vr[kV3Round][VL / 2];
    const int64_t r0 = !table ? p0 : one_page ? int64_t(table[p0 / a.bt]) * a.bt + p0 % a.bt : 0;  // position p0's cache row
    auto at = [&](int p) {  // position p's K / V offset (p0 <= p < p0 + 8)
      return one_page ? (r0 + (p - p0)) * int64_t(a.n_kv) * HD + int64_t(kvh) * HD : kv_at(a, table, kvh, p, HD);
    };
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {  // positions past the slice read its last row, and weigh 0
      const uint4* src = reinterpret_cast<const uint4*>(a.kc + at(min(p0 + 4 * pass + sub, p_end - 1)) + sl * KL);
#pragma unroll
      for (int c = 0; c < KL / 8; ++c) kr[pass][c] = src[c];
    }
#pragma unroll
    for (int k = 0; k < kV3Round; ++k) load_halves<VL>(vr[k], a.vc + at(min(p0 + k, p_end - 1)) + lane * VL);
    const int nv = min(kV3Round, p_end - p0), k_lo = max(0, first - p0);
#pragma unroll
    for (int g = 0; g < GM; ++g)
      if (g < G) v3_round<HD>(qs + g * HD, kr, vr, k_lo, nv, m[g], l[g], o[g]);
  }
#pragma unroll
  for (int g = 0; g < GM; ++g)
    if (g < G) {
      float* dst = sm + (g * kV3Warps + w) * stride;
#pragma unroll
      for (int i = 0; i < VL; ++i) dst[lane * VL + i] = o[g][i];
      if (lane == 0) dst[HD] = m[g], dst[HD + 1] = l[g];  // an empty slice: -inf, 0
    }
  __syncthreads();
  combine_warps<HD>(a, sm, t, kvh, split, w, kV3Warps, lane);
}

// Version 3's launch: the kernel for head_dim HD and the group's bucket.
template <int HD>
void launch_v3(const AttnArgs& args, int64_t T, int64_t n_kv, int64_t n_splits, int64_t G, cudaStream_t s) {
  auto kernel = G <= 1   ? attention_decode_v3_kernel<HD, 1>
                : G <= 2 ? attention_decode_v3_kernel<HD, 2>
                : G <= 4 ? attention_decode_v3_kernel<HD, 4>
                         : attention_decode_v3_kernel<HD, 8>;
  const dim3 grid{unsigned(T), unsigned(n_kv), unsigned(n_splits)}, block{32, unsigned(kV3Warps), 1};
  LLMQ_LAUNCH(kernel, grid, block, decode_v3_smem(G, HD), s)(args);
  check_launch("attention (decode v3)");
}

// 0: the default, version 3 (where the shape allows it, else 1); 1 or 3: forced.
EnvSetting g_decode_version([] {
  const char* e = std::getenv("LLMQ_CUDA_DECODE_ATTN");
  const std::string v = e ? e : "";
  return v == "1" || v == "3" ? v[0] - '0' : 0;
});

// The version a decode step's parts run: on an H200 version 3 took 0.48-0.93x version 1's time on
// llama-2-7b (MHA), llama-3-8b (groups of 4) and SmolLM2 (groups of 3), at 512 and 4096 positions
// and in a batched step of 32 (version 2: 0.66-1.75x); whole Q4_0 decode 455.9 → 500.0 tok/s on
// llama-2-7b, 421.4 → 451.0 on llama-3-8b (dev/cuda/attn.cu; bench/RESULTS.md, fifth GPU session).
int decode_version() {
  const int v = g_decode_version.get();
  return v != 0 ? v : 3;
}

// ---------------------------------------------------------------- prefill on the tensor cores
//
// FlashAttention-2 (Dao 2023) on mma.m16n8k16 (fp16 operands, fp32 sums) for one sequence's
// prompt: a block takes kFaRows query tokens of one query head, 4 warps of 16 tokens each; K/V
// tiles of kFaCols positions are double-buffered in shared memory (cp.async), S = Q Kᵀ and
// O += P V run on the tensor cores, the softmax is kept online per row in registers (scores in
// log2 units: q is scaled by scale · log2 e, so p = 2^(s - m)). Q and P are rounded to fp16
// (the cache already is): ~1e-3 relative against fp64, as FlashAttention's fp16 path.
// Fragments (mma.cuh): Q's A fragments stay in registers for the whole block; K's B fragments
// are 32-bit loads from the padded K rows; V's come transposed through ldmatrix; the S
// accumulators of two 8-position tiles are P's A fragment for a 16-position step.
constexpr int kFaRows = 64;  // query tokens per block (4 warps x 16)
constexpr int kFaCols = 64;  // positions per K/V tile

__device__ __forceinline__ uint32_t lds32(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Issues the copies of positions p0 .. p0 + kFaCols - 1 (those below `end`; the rest zero-filled).
template <int HD>
__device__ __forceinline__ void fa_load_tile(const AttnArgs& a, __half* Ks, __half* Vs, int kvh, int p0, int end) {
  constexpr int P = HD + kPad, C = HD / 8;
  const int64_t kv_dim = int64_t(a.n_kv) * HD;
  for (int i = int(threadIdx.x); i < kFaCols * C; i += 128) {
    const int r = i / C, c = i % C, p = p0 + r;
    const int64_t at = int64_t(p < end ? p : 0) * kv_dim + int64_t(kvh) * HD + c * 8;
    cp_async16(Ks + r * P + c * 8, a.kc + at, p < end ? 16 : 0);
    cp_async16(Vs + r * P + c * 8, a.vc + at, p < end ? 16 : 0);
  }
}

// Q's mma fragments for query tokens r0 and r1 (rows g and g + 8 of the warp's 16) of head h,
// scaled into log2 units (scale · log2 e) and rounded to fp16; rows past a.T are zero.
template <int HD>
__device__ __forceinline__ void fa_load_q(uint32_t (&qf)[HD / 16][4], const AttnArgs& a, int h, int r0, int r1, int c) {
  const float qs = a.scale * 1.44269504088896340736f;
  auto qv = [&](int r, int k) { return r < a.T ? a.q[int64_t(r) * a.ldq + int64_t(h) * HD + k] * qs : 0.0f; };
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const int k = 16 * kk + 2 * c;
    qf[kk][0] = pack_half2(qv(r0, k), qv(r0, k + 1)), qf[kk][1] = pack_half2(qv(r1, k), qv(r1, k + 1));
    qf[kk][2] = pack_half2(qv(r0, k + 8), qv(r0, k + 9)), qf[kk][3] = pack_half2(qv(r1, k + 8), qv(r1, k + 9));
  }
}

// The causal mask (positions after a token's own, and before its sliding window's start
// first0 / first1, are -inf) on a tile starting at position p0, and the two rows' maxima over
// the tile, shared across the 4 lanes of a row.
__device__ __forceinline__ void fa_causal_max(float (&sc)[kFaCols / 8][4], int p0, int pos0, int pos1, int first0, int first1, int c,
                                              float& mx0, float& mx1) {
#pragma unroll
  for (int n = 0; n < kFaCols / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = p0 + 8 * n + 2 * c + e;
      if (p > pos0 || p < first0) sc[n][e] = -INFINITY;
      if (p > pos1 || p < first1) sc[n][2 + e] = -INFINITY;
      mx0 = fmaxf(mx0, sc[n][e]), mx1 = fmaxf(mx1, sc[n][2 + e]);
    }
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1)
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFullMask, mx0, o2)), mx1 = fmaxf(mx1, __shfl_xor_sync(kFullMask, mx1, o2));
}

// S = Q Kᵀ for one tile (kFaCols positions from Ks) on the tensor cores: sc [kFaCols/8][4], the
// mma accumulators of the warp's 16 query rows.
template <int HD>
__device__ __forceinline__ void fa_scores(float (&sc)[kFaCols / 8][4], const uint32_t (&qf)[HD / 16][4], const __half* Ks, int g, int c) {
  constexpr int P = HD + kPad;
#pragma unroll
  for (int n = 0; n < kFaCols / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
    for (int n = 0; n < kFaCols / 8; ++n) {
      const __half* kr = Ks + (8 * n + g) * P + 16 * kk + 2 * c;
      const uint32_t b[2] = {lds32(kr), lds32(kr + 8)};
      mma_f16(sc[n], qf[kk], b);
    }
}

// The online softmax's step (FlashAttention-2): the rows' new maxima m0 / m1 from the tile's
// mx0 / mx1, l and O rescaled by 2^(m_old - m_new); mu0 / mu1 are the maxima the tile's
// probabilities are taken against (0 for a row with nothing visible yet).
template <int NO>
__device__ __forceinline__ void fa_rescale(float (&o)[NO][4], float mx0, float mx1, float& m0, float& m1, float& l0, float& l1,
                                           float& mu0, float& mu1) {
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
  const float cr0 = exp2f(m0 - mu0), cr1 = exp2f(m1 - mu1);
  m0 = mn0, m1 = mn1, l0 *= cr0, l1 *= cr1;
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] *= cr0, o[n][1] *= cr0, o[n][2] *= cr1, o[n][3] *= cr1;
}

// O += P V for one tile: P = 2^(S - mu) rounded to fp16 (its row sums added to l0 / l1), two
// 8-position S tiles making one 16-position A fragment; V's B fragments through ldmatrix.trans.
template <int HD>
__device__ __forceinline__ void fa_pv(float (&o)[HD / 8][4], const float (&sc)[kFaCols / 8][4], const __half* Vs, float mu0, float mu1,
                                      float& l0, float& l1, int lane) {
  constexpr int P = HD + kPad;
#pragma unroll
  for (int kk = 0; kk < kFaCols / 16; ++kk) {
    float pr[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      pr[j][0] = exp2f(sc[2 * kk + j][0] - mu0), pr[j][1] = exp2f(sc[2 * kk + j][1] - mu0);
      pr[j][2] = exp2f(sc[2 * kk + j][2] - mu1), pr[j][3] = exp2f(sc[2 * kk + j][3] - mu1);
      l0 += pr[j][0] + pr[j][1], l1 += pr[j][2] + pr[j][3];
    }
    const uint32_t pa[4] = {pack_half2(pr[0][0], pr[0][1]), pack_half2(pr[0][2], pr[0][3]), pack_half2(pr[1][0], pr[1][1]),
                            pack_half2(pr[1][2], pr[1][3])};
    const int lrow = 16 * kk + lane % 8 + (lane / 8) % 2 * 8, lcol = (lane / 16) * 8;
#pragma unroll
    for (int np = 0; np < HD / 16; ++np) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, Vs + lrow * P + 16 * np + lcol);
      const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
      mma_f16(o[2 * np], pa, b0);
      mma_f16(o[2 * np + 1], pa, b1);
    }
  }
}

// The rows' sums l0 / l1 shared across the row's 4 lanes, and O / l written for query tokens r0
// and r1 (those below a.T) of head h.
template <int HD>
__device__ __forceinline__ void fa_store(const AttnArgs& a, const float (&o)[HD / 8][4], float l0, float l1, int h, int r0, int r1, int c) {
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) l0 += __shfl_xor_sync(kFullMask, l0, o2), l1 += __shfl_xor_sync(kFullMask, l1, o2);
  const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = h * HD + 8 * n + 2 * c;
    if (r0 < a.T) *reinterpret_cast<float2*>(a.out + int64_t(r0) * a.ldo + col) = make_float2(o[n][0] * inv0, o[n][1] * inv0);
    if (r1 < a.T) *reinterpret_cast<float2*>(a.out + int64_t(r1) * a.ldo + col) = make_float2(o[n][2] * inv1, o[n][3] * inv1);
  }
}

template <int HD>
__global__ void __launch_bounds__(128) attention_prefill_kernel(AttnArgs a) {
  pdl_begin();
  constexpr int P = HD + kPad, KS = HD / 16, NS = kFaCols / 8, NO = HD / 8;
  __half* const base = reinterpret_cast<__half*>(dynamic_smem());  // stage s: K [kFaCols][P], then V
  __shared__ int warp_top[4], warp_bot[4];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
  const int h = int(blockIdx.y), kvh = (h + a.head_off) / a.group;
  const int r0 = int(blockIdx.x) * kFaRows + warp * 16 + g, r1 = r0 + 8;  // this thread's two query tokens
  const int pos0 = r0 < a.T ? a.pos[r0] : -1, pos1 = r1 < a.T ? a.pos[r1] : -1;
  const int first0 = r0 < a.T ? attn_first(a, pos0) : 0, first1 = r1 < a.T ? attn_first(a, pos1) : 0;
  int wtop = max(pos0, pos1), wbot = min(r0 < a.T ? first0 : 1 << 30, r1 < a.T ? first1 : 1 << 30);  // the warp's last and first positions
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wtop = max(wtop, __shfl_xor_sync(kFullMask, wtop, o)), wbot = min(wbot, __shfl_xor_sync(kFullMask, wbot, o));
  if (lane == 0) warp_top[warp] = wtop, warp_bot[warp] = wbot;
  uint32_t qf[KS][4];
  fa_load_q<HD>(qf, a, h, r0, r1, c);
  __syncthreads();
  const int top = max(max(warp_top[0], warp_top[1]), max(warp_top[2], warp_top[3])) + 1;  // positions .. top-1
  const int bot = min(min(warp_bot[0], warp_bot[1]), min(warp_bot[2], warp_bot[3]));      // from the earliest window start
  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  // Tiles it0 .. it1 - 1 (those before every token's window are skipped), stage (it - it0) & 1.
  const int it0 = top > 0 ? min(bot, top - 1) / kFaCols : 0, it1 = (top + kFaCols - 1) / kFaCols;
  if (it1 > it0) fa_load_tile<HD>(a, base, base + kFaCols * P, kvh, it0 * kFaCols, top);
  cp_async_commit();
  for (int it = it0; it < it1; ++it) {
    if (it + 1 < it1) {
      __half* Kn = base + ((it + 1 - it0) & 1) * 2 * kFaCols * P;
      fa_load_tile<HD>(a, Kn, Kn + kFaCols * P, kvh, (it + 1) * kFaCols, top);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const __half* Ks = base + ((it - it0) & 1) * 2 * kFaCols * P;
    const __half* Vs = Ks + kFaCols * P;
    const int p0 = it * kFaCols;
    if (p0 <= wtop && p0 + kFaCols > wbot) {  // warp-uniform: some of this warp's tokens see this tile
      float sc[NS][4];
      fa_scores<HD>(sc, qf, Ks, g, c);
      float mx0 = -INFINITY, mx1 = -INFINITY;
      fa_causal_max(sc, p0, pos0, pos1, first0, first1, c, mx0, mx1);
      float mu0, mu1;
      fa_rescale<NO>(o, mx0, mx1, m0, m1, l0, l1, mu0, mu1);
      fa_pv<HD>(o, sc, Vs, mu0, mu1, l0, l1, lane);
    }
    __syncthreads();  // everyone is done with this stage before it is filled again
  }
  cp_async_wait<0>();
  fa_store<HD>(a, o, l0, l1, h, r0, r1, c);
}

size_t prefill_smem(int64_t hd) { return size_t(4) * kFaCols * size_t(hd + kPad) * 2; }

// LLMQ_CUDA_ATTN=0: prompts on the CUDA-core kernel too (for comparisons).
bool use_prefill_kernel(int64_t T, int64_t hd, int64_t n_splits, const KvPages& pages, const KvQ8& q8, int64_t ldo) {
  static const bool off = [] {
    const char* e = std::getenv("LLMQ_CUDA_ATTN");
    return e && std::string(e) == "0";
  }();
  return !off && T >= 16 && n_splits == 1 && !pages.tables && !q8.kq && (hd == 64 || hd == 128) && ldo % 2 == 0;
}

// grid (T, n_heads), one warp: out = Σ_c e^(m_c - M) o_c / Σ_c e^(m_c - M) l_c. Lane c reads
// part c's (m, l) (32 parts at a time), so the maximum and the weights cost one round of loads,
// not one per part (a loop over the parts' m, then l, then o had a chain of 3 x n_splits
// dependent loads: ~25 us of a decode step's layer on an H200); parts with l = 0 (past the
// token's position) weigh 0. With q.q (attention()'s q_out; hd a multiple of 32, ldo =
// n_heads · hd) out is also quantized for the product that reads it: lane j holds element j of
// each 32-block (quantize_act_block, the rule of quantize_act).
__global__ void attention_merge_kernel(const float* __restrict__ partial, int n_heads, int hd, int n_splits, float* __restrict__ out,
                                       int64_t ldo, DeviceActQ8 q) {
  pdl_begin();
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, stride = hd + 2;
  const float* P = partial + (int64_t(t) * n_heads + h) * n_splits * stride;
  float M = -INFINITY;
  for (int c = lane; c < n_splits; c += 32)
    if (P[c * stride + hd + 1] > 0.0f) M = fmaxf(M, P[c * stride + hd]);
  M = warp_max(M);
  float denom = 0.0f;
  for (int c = lane; c < n_splits; c += 32)
    if (P[c * stride + hd + 1] > 0.0f) denom += expf(P[c * stride + hd] - M) * P[c * stride + hd + 1];
  const float inv = 1.0f / warp_sum(denom);
  float acc[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) acc[i] = 0.0f;
  for (int c0 = 0; c0 < n_splits; c0 += 32) {
    const int c = c0 + lane;
    const float w = c < n_splits && P[c * stride + hd + 1] > 0.0f ? expf(P[c * stride + hd] - M) : 0.0f;
    const int nc = min(32, n_splits - c0);
#pragma unroll 4
    for (int j = 0; j < nc; ++j) {
      const float wj = __shfl_sync(kFullMask, w, j);
      if (wj == 0.0f) continue;  // warp-uniform: an empty part
      const float* pc = P + (c0 + j) * stride;
#pragma unroll
      for (int i = 0; i < kOut; ++i)
        if (lane + 32 * i < hd) acc[i] += wj * pc[lane + 32 * i];
    }
  }
#pragma unroll
  for (int i = 0; i < kOut; ++i)
    if (lane + 32 * i < hd) out[int64_t(t) * ldo + int64_t(h) * hd + lane + 32 * i] = acc[i] * inv;
  if (!q.q) return;
#pragma unroll
  for (int i = 0; i < kOut; ++i)
    if (32 * i < hd) {  // warp-uniform
      const float v[1] = {acc[i] * inv};
      quantize_act_block<1>(v, (int64_t(t) * ldo + int64_t(h) * hd) / 32 + i, lane, true, q);
    }
}

// Version 1: attention_kernel, tq tokens of one sequence per block.
void launch_v1(const AttnArgs& args, int64_t T, int64_t n_kv, int64_t n_splits, int64_t G, int64_t hd, const KvPages& pages,
               cudaStream_t s) {
  // Tokens per block: one sequence (no tables) shares K/V tiles between up to 4 tokens, as long
  // as a block stays within 8 warps.
  const int tq = pages.tables || T < 4 ? 1 : int(std::max<int64_t>(1, std::min<int64_t>(4, 8 / G)));
  const size_t smem = size_t(4) * kTile * (hd + kPad) * 2 + size_t(tq * G * hd) * 4;
  const dim3 grid{unsigned((T + tq - 1) / tq), unsigned(n_kv), unsigned(n_splits)}, block{32, unsigned(G), unsigned(tq)};
  auto launch = [&](auto kernel) {
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);  // above the default 48 KiB: opt in
    LLMQ_LAUNCH(kernel, grid, block, smem, s)(args);
  };
  if (tq == 4) launch(attention_kernel<4>);
  else if (tq == 2) launch(attention_kernel<2>);
  else launch(attention_kernel<1>);
  check_launch("attention");
}

}  // namespace

void attention_prepare(int64_t n_heads, int64_t n_kv, int64_t hd) {
  if (hd > kMaxHeadDim || n_kv <= 0 || n_heads % n_kv != 0) return;  // attention() reports these
  const int64_t G = n_heads / n_kv;
  if (hd == 64) allow_dynamic_smem(reinterpret_cast<const void*>(attention_prefill_kernel<64>), prefill_smem(64));
  if (hd == 128) allow_dynamic_smem(reinterpret_cast<const void*>(attention_prefill_kernel<128>), prefill_smem(128));
  const size_t parts = size_t(4) * kTile * size_t(hd + kPad) * 2 + size_t(4 * G * hd) * 4;  // attention_kernel, tq up to 4
  for (auto k : {attention_kernel<1>, attention_kernel<2>, attention_kernel<4>}) allow_dynamic_smem(reinterpret_cast<const void*>(k), parts);
}

bool attention(const float* q, int64_t ldq, const uint16_t* kc, const uint16_t* vc, const int32_t* pos, int64_t T, int64_t n_heads,
               int64_t n_kv, int64_t hd, float scale, int64_t n_splits, int64_t part_len, float* partial, float* out, int64_t ldo,
               cudaStream_t s, const KvPages& pages, const KvQ8& q8, const GqaSlice& gqa, const DeviceActQ8* q_out, int64_t window) {
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
  if (window < 0 || window > (int64_t(1) << 30)) throw UsageError("CUDA attention: sliding window " + std::to_string(window));
  if (T == 0) return false;
  if (G > 32) throw UsageError("CUDA attention: more than 32 query heads per KV head");
  const int version = n_splits > 1 && !q8.kq && (hd == 64 || hd == 128 || hd == 256) && G <= kDecMaxGroup ? decode_version() : 1;
  const int64_t parts = version == 3 ? v3_parts(T, n_kv, n_splits) : n_splits;  // version 3: fewer for many tokens
  const AttnArgs args{q, ldq, reinterpret_cast<const __half*>(kc), reinterpret_cast<const __half*>(vc), pos, pages.seq, pages.tables,
                      pages.table_stride, int(pages.block_tokens), q8.kq, reinterpret_cast<const __half*>(q8.kd), q8.vq,
                      reinterpret_cast<const __half*>(q8.vd), int(T), int(n_heads), int(n_kv), int(hd), int(off), int(G), scale, int(parts),
                      int(part_len), partial, out, ldo, int(window)};
  if (use_prefill_kernel(T, hd, n_splits, pages, q8, ldo)) {  // one sequence, fp16 cache, one part: the tensor cores
    const size_t smem = prefill_smem(hd);
    auto kernel = hd == 64 ? attention_prefill_kernel<64> : attention_prefill_kernel<128>;
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    const dim3 grid{unsigned((T + kFaRows - 1) / kFaRows), unsigned(n_heads), 1};
    LLMQ_LAUNCH(kernel, grid, 128, smem, s)(args);
    check_launch("attention (prefill)");
    return false;
  }
  if (version == 3) {
    if (hd == 64) launch_v3<64>(args, T, n_kv, parts, G, s);
    else if (hd == 128) launch_v3<128>(args, T, n_kv, parts, G, s);
    else launch_v3<256>(args, T, n_kv, parts, G, s);
  } else {
    launch_v1(args, T, n_kv, n_splits, G, hd, pages, s);
  }
  if (parts > 1) {
    const dim3 merge_grid{unsigned(T), unsigned(n_heads), 1};
    const bool quantize = q_out && hd % 32 == 0 && ldo == n_heads * hd;
    LLMQ_LAUNCH(attention_merge_kernel, merge_grid, 32, 0, s)(partial, int(n_heads), int(hd), int(parts), out, ldo,
                                                              quantize ? *q_out : DeviceActQ8{});
    check_launch("attention_merge");
    return quantize;
  }
  return false;
}

void set_decode_v3_blocks(int64_t blocks) {
  if (blocks < 0 || blocks > (1 << 20)) throw UsageError("decode attention version 3: the block target must be 0 (the default) .. 2^20");
  g_v3_blocks.set(int(blocks));
}

void set_decode_attention_version(int version) {
  if (version != 0 && version != 1 && version != 3)
    throw UsageError("decode attention version must be 0 (the default: 3 where the shape allows it), 1 or 3 (2 was removed)");
  g_decode_version.set(version);
}

}  // namespace llmq::cuda
