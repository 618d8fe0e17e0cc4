// MMQ: matrix products of block-quantized weights and int8 activations on the tensor cores
// (engine/cuda/matmul.h mmq), for prefill and batched decode.
//
// y [T, rows] = x [T, cols] · wᵀ, w Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K in the
// split layout or IQ4_NL / Q2_K / Q3_K in the file's (raw_blocks.cuh), x quantized per block of
// 32 by quantize_act (q, d, s = d·Σq). Per block of 32 columns, an integer product on the tensor cores
// (mma.m16n8k32, int32 sums), then scaled in fp32 as the GEMV does:
//   Q8_0:  Σ w x = d_w d_x Σ q_w q_x
//   Q4_0:  w = d_w (q_w - 8):   Σ w x = d_w (d_x Σ q_w q_x - 8 s_x)       (q_w as uint8 0..15)
//   Q4_1:  w = d_w q_w + m_w:   Σ w x = d_w d_x Σ q_w q_x + m_w s_x
//   Q4_K, Q5_K: per 32-weight sub-block w = a q_w - m (a = d·sc, m = dmin·mn): Q4_1's / Q5_1's
//          sum with d_w = a, m_w = -m (q_w 0..15, Q5_K 0..31); their split layouts load as Q4_1's
//          / Q5_1's, the sc | mn words as d_w and the super-block's d | dmin word as m_w.
//   Q5_0:  as Q4_0 with q_w 0..31 (the fifth bit from qh) and -16 s_x;  Q5_1: as Q4_1, q_w 0..31
//   IQ4_NL: as Q8_0 with q_w = the level of each nibble (iq4_nl_level)
//   Q6_K, Q3_K, Q2_K: a scale per 16 weights, so two products per block, each on one half of k
//          (the other half's A fragments zero):  d_x (a_lo Σ_lo + a_hi Σ_hi), with
//          Q6_K  a = d sc, q_w - 32 as int8 (split: nibble | crumb << 4, q6_bytes);
//          Q3_K  a = d (sc - 32), q_w - 4 as int8 (q3_k_scale);
//          Q2_K  a = d (sc & 15), q_w 0..3, and the minimum's - dmin (sc >> 4) Σ_half x, Σ_half q_x from
//          one more product with ones for A, shared by every row.
// (the same sums as llama.cpp's MMQ kernels and the CPU's block dot products, engine/cpu/cpu_ops.cpp).
//
// A CUDA block computes a tile of kMmqBM weight rows x BN tokens with 8 warps (4 along the rows,
// 2 along the tokens: each warp 32 rows x BN/2 tokens). The columns stream through shared memory
// in stages of 64 (two quant blocks), kMmqStages deep with cp.async, so the next stages load
// while the current one is multiplied. Shared-memory rows are padded by 16 bytes, so the warp's
// 32-bit fragment loads (8 rows x 4 words) fall in 32 distinct banks.
#include <algorithm>
#include <string>
#include <type_traits>

#include "engine/cuda/common.cuh"
#include "engine/cuda/matmul.h"
#include "engine/cuda/mma.cuh"
#include "engine/cuda/raw_blocks.cuh"
#include "base/error.h"

namespace llmq::cuda {

namespace {

constexpr int kMmqBM = 128;     // weight rows per CUDA block
constexpr int kMmqBK = 64;      // columns per stage: two quant blocks
constexpr int kMmqStages = 3;   // stages in flight
constexpr int kMmqThreads = 256;
constexpr int kMmqPad = 16;     // bytes after each shared-memory row

template <DType kType>
constexpr bool kSplit16 = kType == DType::Q2_K || kType == DType::Q3_K || kType == DType::Q6_K;  // a scale per 16 weights
template <DType kType>
constexpr bool kWords = kType == DType::Q2_K || kType == DType::Q3_K;  // raw rows by 16-bit loads, a header per row and stage
template <DType kType>
constexpr bool kQ5 = split_has_h(kType);  // split: Q4's nibbles and the h words
template <DType kType>
constexpr bool kMin = split_has_m(kType);  // split, with minimums
template <DType kType>
constexpr bool kSplitK = split_has_k(kType);  // split, two-level scales (Q4_K, Q5_K, Q6_K)
template <DType kType>
constexpr bool kB32 = kType == DType::IQ4_NL;  // raw 32-weight blocks, read by 16-bit loads
// Bytes of one 32-column block's quants as loaded from the q array (Q3_K: 16 of quants and
// 16 of high bits; Q5_0/Q5_1/Q5_K: the 16 of nibbles, their 4 of fifth bits come from the h array to
// bytes 32..39 of the row; Q6_K: the 16 of nibbles, its 8 of crumbs from the h array to bytes
// 32..47).
template <DType kType>
constexpr int kQuantBytes = kType == DType::Q8_0 || kType == DType::Q3_K ? 32 : 16;
template <DType kType>
constexpr int kAPitch = kB32<kType> || kQ5<kType> || kType == DType::Q6_K ? 48 : 2 * kQuantBytes<kType> + kMmqPad;  // 12 words, so 8 rows x 4 words hit 32 banks
constexpr int kBPitch = kMmqBK + kMmqPad;

// One stage in shared memory: two quant blocks of BM weight rows and BN tokens. Q4_K / Q5_K
// (split): dw holds the two blocks' sc | mn words and mw, as one word, the super-block's d |
// dmin; Q6_K (split): dw the blocks' words of two int8 scales, mw[0] the super-block's d. The
// raw Q3_K / Q2_K: the stage is sub-blocks 2p, 2p + 1 of a super-block (p = stage % 4), a holds
// qs[32h, 32h + 32) (block j's crumbs: bits 2 (2 (p % 2) + j) of byte i; Q3_K then hmask[0, 32),
// bit 2p + j), hdr Q3_K's 12 scale bytes and d, or Q2_K's four scale bytes of the stage, d and
// dmin.
template <DType kType, int BN>
struct MmqStage {
  alignas(16) uint8_t a[kMmqBM * kAPitch<kType>];  // weight quants [BM][2 blocks' bytes + pad]
  alignas(16) int8_t b[BN * kBPitch];                // activation quants [BN][64 + pad]
  alignas(16) uint16_t dw[kMmqBM * 2];               // weight scales [BM][2] fp16
  alignas(16) uint16_t mw[kMin<kType> || kSplitK<kType> ? kMmqBM * 2 : 8];  // Q4_1 / Q5_1 minimums [BM][2] fp16
  alignas(16) float dx[BN * 2];                      // activation scales [BN][2]
  alignas(16) float sx[BN * 2];                      // d·Σq [BN][2] (the types with an offset or a minimum)
  alignas(16) uint8_t hdr[kWords<kType> ? kMmqBM * 16 : 16];  // Q3_K / Q2_K super-block headers [BM][16]
};

struct MmqArgs {
  const uint8_t* wq;
  const uint16_t *wd, *wm;
  const uint32_t* wh;  // Q5_0 / Q5_1: the fifth bits [rows, cols/32]
  const uint16_t* wk;  // Q4_K, Q5_K, Q6_K: the super-blocks' fp16 pairs [rows, cols/256, 2]
  const int8_t* xq;
  const float *xd, *xs;
  float* y;       // splits == 1: the output, row t at y + t · ldy; else the partial sums [splits, T, rows]
  int64_t ldy;
  int rows, cols, T;
  int splits;     // gridDim.z: column ranges (split-K), each a contiguous run of stages
  int64_t rb;     // bytes per weight row (the raw types' rows)
  const uint16_t* xh = nullptr;  // mmq_h: the activations as fp16 [T, cols] (xq, xd, xs unused)
};

// IQ4_NL's part of a stage (column blocks kb, kb + 1) for the rows at row0, by 16-bit loads
// (18-byte blocks: 2-byte aligned): a row's qs of both blocks (bytes 0..31); d into dw.
template <DType kType, class Stage>
__device__ __forceinline__ void mmq_load_b32(Stage& st, const MmqArgs& p, int row0, int kb) {
  constexpr int P = kAPitch<kType>, B = raw_block_bytes(kType), W = B / 2;  // block bytes, words
  for (int i = int(threadIdx.x); i < kMmqBM * 2 * W; i += kMmqThreads) {
    const int r = i / (2 * W), jb = i / W % 2, w = i % W, row = min(row0 + r, p.rows - 1);
    const uint8_t* blk = p.wq + int64_t(row) * p.rb + int64_t(kb + jb) * B;
    const uint16_t v = __ldg(reinterpret_cast<const uint16_t*>(blk + 2 * w));
    if (w == 0) st.dw[2 * r + jb] = v;
    else *reinterpret_cast<uint16_t*>(st.a + r * P + 16 * jb + 2 * w - kIQ4NLQs) = v;
  }
}

// The 16-bit words of a Q3_K / Q2_K stage (pair pr of its super-block, half h = pr / 2):
// word w of a row comes from byte src of the super-block and goes to byte dst of the row's
// quants (to_hdr false) or of its header.
struct WordMove {
  int src, dst;
  bool to_hdr;
};
template <DType kType>
constexpr int kStageWords = kType == DType::Q3_K ? 39 : 20;
template <DType kType>
__device__ __forceinline__ WordMove stage_word(int w, int pr) {
  const int h = pr / 2;
  if constexpr (kType == DType::Q3_K)  // qs 32 + 32h.. (16), hmask (16), scales 96.. (6), d (1)
    return w < 16 ? WordMove{32 + 32 * h + 2 * w, 2 * w, false} : w < 32 ? WordMove{2 * (w - 16), 2 * w, false}
         : w < 38 ? WordMove{96 + 2 * (w - 32), 2 * (w - 32), true} : WordMove{108, 12, true};
  else  // Q2_K: qs 16 + 32h.. (16), scales 4pr.. (2), d, dmin
    return w < 16 ? WordMove{16 + 32 * h + 2 * w, 2 * w, false} : w < 18 ? WordMove{4 * pr + 2 * (w - 16), 2 * (w - 16), true}
         : WordMove{80 + 2 * (w - 18), 4 + 2 * (w - 18), true};
}

// A Q3_K / Q2_K stage (column blocks kb, kb + 1) for the rows at row0: their rows are only
// 2-byte aligned (110-byte super-blocks; Q2_K's 84 are 4), so 16-bit loads and stores rather
// than cp.async.
template <DType kType, class Stage>
__device__ __forceinline__ void mmq_load_words(Stage& st, const MmqArgs& p, int row0, int kb) {
  constexpr int P = kAPitch<kType>, W = kStageWords<kType>, B = raw_block_bytes(kType);
  const int pr = (kb / 2) % 4;
  for (int i = int(threadIdx.x); i < kMmqBM * W; i += kMmqThreads) {
    const int r = i / W, row = min(row0 + r, p.rows - 1);
    const WordMove m = stage_word<kType>(i % W, pr);
    const uint8_t* sb = p.wq + int64_t(row) * p.rb + int64_t(kb / 8) * B;
    *reinterpret_cast<uint16_t*>((m.to_hdr ? st.hdr + 16 * r : st.a + r * P) + m.dst) = __ldg(reinterpret_cast<const uint16_t*>(sb + m.src));
  }
}

// Issues the copies of stage (column blocks kb, kb + 1) for the tile at (row0, tok0) of the raw
// rows (Q2_K, Q3_K, IQ4_NL: 16-bit loads, the addresses computed per stage). Rows and tokens
// past the end read the last one (their results are not stored). The split layouts: MmqCopies.
template <DType kType, int BN>
__device__ __forceinline__ void mmq_load(MmqStage<kType, BN>& st, const MmqArgs& p, int row0, int tok0, int kb) {
  static_assert(kWords<kType> || kB32<kType>, "the split layouts load through MmqCopies");
  const int tid = int(threadIdx.x), nb = p.cols / 32;
  if constexpr (kWords<kType>) mmq_load_words<kType>(st, p, row0, kb);
  else mmq_load_b32<kType>(st, p, row0, kb);
  for (int i = tid; i < BN * 4; i += kMmqThreads) {
    const int t = i / 4, c = i % 4, tok = min(tok0 + t, p.T - 1);
    cp_async16(st.b + t * kBPitch + c * 16, p.xq + int64_t(tok) * p.cols + kb * 32 + c * 16);
  }
  for (int i = tid; i < BN; i += kMmqThreads) {
    const int64_t tok = min(tok0 + i, p.T - 1);
    cp_async8(st.dx + 2 * i, p.xd + tok * nb + kb);
    cp_async8(st.sx + 2 * i, p.xs + tok * nb + kb);
  }
}

// A thread's copies of the weights' part of every stage for the split layouts (all but the raw
// Q2_K / Q3_K / IQ4_NL rows), addressed once: each thread's chunks of quants (and fifth bits or
// crumbs) and its row's scales sit at the same place in every stage, and their sources move by a
// stage's columns. mmq_load recomputed 64-bit addresses in four or five loops a stage, about a
// third of the stage loop's instructions (dev/README.md #27). Rows past the end read the last
// one (their results are not stored); the arrays a type lacks stay null.
template <DType kType>
struct MmqWeightCopies {
  static constexpr int kQB = kQuantBytes<kType>, kRowChunks = 2 * kQB / 16 + (kType == DType::Q6_K ? 1 : 0);  // Q6_K: and the crumbs
  static constexpr int kChunks = kMmqBM * kRowChunks, kW = (kChunks + kMmqThreads - 1) / kMmqThreads;  // 16-byte chunks a thread
  const uint8_t* w[kW];
  int wo[kW], ws[kW];       // offset in the stage's a, source bytes a stage
  const uint16_t *d, *m;    // row tid's scales and minimums (threads < kMmqBM)
  const uint32_t* h;        // its fifth bits (Q5_0, Q5_1, Q5_K)
  const uint16_t* k;        // its super-blocks' d | dmin words (Q4_K, Q5_K, Q6_K)
  int kb0;                  // the first column block

  __device__ __forceinline__ MmqWeightCopies(const MmqArgs& p, int row0, int first_kb) : kb0(first_kb) {
    const int tid = int(threadIdx.x), nb = p.cols / 32;
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const int e = min(tid + i * kMmqThreads, kChunks - 1), r = e / kRowChunks, c = e % kRowChunks;
      const int64_t row = min(row0 + r, p.rows - 1);
      if (kType == DType::Q6_K && c == 2)  // the two blocks' 8 bytes of crumbs (16-byte aligned: kb is even)
        w[i] = reinterpret_cast<const uint8_t*>(p.wh) + (row * nb + first_kb) * 8, ws[i] = 16;
      else
        w[i] = p.wq + (row * nb + first_kb) * kQB + c * 16, ws[i] = 2 * kQB;
      wo[i] = r * kAPitch<kType> + c * 16;
    }
    const int64_t row = min(row0 + min(tid, kMmqBM - 1), p.rows - 1);
    d = p.wd + row * nb + first_kb;
    m = kMin<kType> ? p.wm + row * nb + first_kb : nullptr;
    h = kQ5<kType> ? p.wh + row * nb + first_kb : nullptr;
    k = kSplitK<kType> ? p.wk + 2 * row * (nb / 8) : nullptr;
  }
  // Stage s of this block's run (column blocks kb0 + 2 s, + 1) into st's a, dw (and mw).
  template <class Stage>
  __device__ __forceinline__ void issue(Stage& st, int s) const {
    const int tid = int(threadIdx.x);
#pragma unroll
    for (int i = 0; i < kW; ++i)
      if (kChunks >= kMmqThreads * (i + 1) || tid + i * kMmqThreads < kChunks) cp_async16(st.a + wo[i], w[i] + int64_t(s) * ws[i]);
    if (tid < kMmqBM) {
      if constexpr (kQ5<kType>) cp_async8(st.a + tid * kAPitch<kType> + 32, h + 2 * s);  // the two blocks' words of fifth bits
      cp_async4(st.dw + 2 * tid, d + 2 * s);
      if constexpr (kMin<kType>) cp_async4(st.mw + 2 * tid, m + 2 * s);
      if constexpr (kSplitK<kType>) cp_async4(st.mw + 2 * tid, k + 2 * ((kb0 + 2 * s) / 8));  // kb, kb + 1: one super-block
    }
  }
};

// mmq_kernel's copies of every stage for the split layouts: the weights' (MmqWeightCopies) and
// the int8 activations' with their scales and sums, addressed once the same way (tokens past
// the end read the last one).
template <DType kType, int BN>
struct MmqCopies {
  static constexpr int kX = (BN * 4 + kMmqThreads - 1) / kMmqThreads;  // 16-byte activation chunks a thread
  MmqWeightCopies<kType> wc;
  const int8_t* x[kX];
  int xo[kX];
  const float *dx, *sx;     // token tid's scales and sums (threads < BN; sx null for Q8_0)

  __device__ __forceinline__ MmqCopies(const MmqArgs& p, int row0, int tok0, int first_kb) : wc(p, row0, first_kb) {
    const int tid = int(threadIdx.x), nb = p.cols / 32;
#pragma unroll
    for (int i = 0; i < kX; ++i) {
      const int e = min(tid + i * kMmqThreads, BN * 4 - 1), t = e / 4, c = e % 4;
      x[i] = p.xq + int64_t(min(tok0 + t, p.T - 1)) * p.cols + first_kb * 32 + c * 16, xo[i] = t * kBPitch + c * 16;
    }
    const int64_t tok = min(tok0 + min(tid, BN - 1), p.T - 1);
    dx = p.xd + tok * nb + first_kb;
    sx = kType != DType::Q8_0 ? p.xs + tok * nb + first_kb : nullptr;
  }
  __device__ __forceinline__ void issue(MmqStage<kType, BN>& st, int s) const {
    const int tid = int(threadIdx.x);
    wc.issue(st, s);
#pragma unroll
    for (int i = 0; i < kX; ++i)
      if (BN * 4 >= kMmqThreads * (i + 1) || tid + i * kMmqThreads < BN * 4) cp_async16(st.b + xo[i], x[i] + int64_t(s) * 64);
    if (tid < BN) {
      cp_async8(st.dx + 2 * tid, dx + 2 * s);
      if constexpr (kType != DType::Q8_0) cp_async8(st.sx + 2 * tid, sx + 2 * s);
    }
  }
};

struct NoCopies {  // the raw types' stand-in for MmqCopies (mmq_load addresses their stages)
  __device__ __forceinline__ NoCopies(const MmqArgs&, int, int, int) {}
};

__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The fp32 scales a (and Q2_K's minimums m, else 0) of 16-weight groups 2j and 2j + 1 of the
// stage (block j's two halves) for row r of stage s (Q3_K / Q2_K: its header).
template <DType kType, class Stage>
__device__ __forceinline__ void split16_scales(const Stage& s, int r, int j, int pr, float (&a)[2], float (&m)[2]) {
  const uint8_t* h = s.hdr + 16 * r;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if constexpr (kType == DType::Q6_K) {  // split: d sc, sc the block word's byte e
      a[e] = fp16_bits_to_float(s.mw[2 * r]) * float(int8_t(s.dw[2 * r + j] >> (8 * e))), m[e] = 0.0f;
    } else if constexpr (kType == DType::Q3_K) {
      a[e] = fp16_bits_to_float(uint16_t(h[12] | h[13] << 8)) * float(q3_k_scale(h, 4 * pr + 2 * j + e) - 32), m[e] = 0.0f;
    } else {
      const int sc = h[2 * j + e];
      a[e] = fp16_bits_to_float(uint16_t(h[4] | h[5] << 8)) * float(sc & 15);
      m[e] = fp16_bits_to_float(uint16_t(h[6] | h[7] << 8)) * float(sc >> 4);
    }
  }
}

// Q6_K / Q3_K / Q2_K: block j of the stage for rows r and r + 8 of the warp's tile, added to acc;
// xs[ni]: Q2_K's Σ_half q_x per token pair (ones_sums), else unused.
template <DType kType, int NT, class Stage>
__device__ __forceinline__ void split16_accumulate(float (&acc)[NT][4], const uint32_t (&a)[4], const uint32_t (&b)[NT][2], const int (&xs)[NT][2][2],
                                                   const Stage& s, int r, int j, int pr, int wc, int c) {
  float a0[2], m0[2], a1[2], m1[2];
  split16_scales<kType>(s, r, j, pr, a0, m0), split16_scales<kType>(s, r + 8, j, pr, a1, m1);
  const uint32_t lo[4] = {a[0], a[1], 0u, 0u}, hi[4] = {0u, 0u, a[2], a[3]};
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    int dl[4] = {0, 0, 0, 0}, dh[4] = {0, 0, 0, 0};
    mma_s8(dl, lo, b[ni]), mma_s8(dh, hi, b[ni]);
    const int t = wc + 8 * ni + 2 * c;
    const float dx[2] = {s.dx[2 * t + j], s.dx[2 * (t + 1) + j]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // row r (i < 2) or r + 8, token t + i % 2
      const float(&ar)[2] = i < 2 ? a0 : a1;
      const float(&mr)[2] = i < 2 ? m0 : m1;
      float v = ar[0] * float(dl[i]) + ar[1] * float(dh[i]);
      if constexpr (kType == DType::Q2_K) v -= mr[0] * float(xs[ni][0][i % 2]) + mr[1] * float(xs[ni][1][i % 2]);
      acc[ni][i] += dx[i % 2] * v;
    }
  }
}

// Q2_K: Σ q_x over each half (k 0..15, 16..31) of block j for the warp's token pairs, from one
// product with ones for A (every row of D the same): xs[ni][half][0 / 1] for tokens 2c, 2c + 1.
template <int NT>
__device__ __forceinline__ void ones_sums(int (&xs)[NT][2][2], const uint32_t (&b)[NT][2]) {
  const uint32_t lo[4] = {0x01010101u, 0x01010101u, 0u, 0u}, hi[4] = {0u, 0u, 0x01010101u, 0x01010101u};
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    int dl[4] = {0, 0, 0, 0}, dh[4] = {0, 0, 0, 0};
    mma_s8(dl, lo, b[ni]), mma_s8(dh, hi, b[ni]);
    xs[ni][0][0] = dl[0], xs[ni][0][1] = dl[1], xs[ni][1][0] = dh[0], xs[ni][1][1] = dh[1];
  }
}

// The A fragments (layout: mma.cuh) of 16 rows at `rows` (pitch kAPitch) for quant block j of the
// stage: Q8_0 bytes as they are; Q4 nibbles, low ones = columns 0..15, high ones = 16..31;
// Q4_K / Q5_K: nibble j of the stage's 32 qs bytes (Q5_K: | bit 2 pr + j of the qh bytes << 4,
// pr = the stage's sub-block pair).
template <DType kType>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint8_t* rows, int j, int g, int c, int pr) {
  constexpr int P = kAPitch<kType>;
  if constexpr (kType == DType::Q6_K) {
    // block j's nibbles (bytes 16j..: low ones columns 4c.., high ones 16 + 4c..) with their
    // crumbs (bytes 32 + 8j..: byte i holds columns i, i + 8, i + 16, i + 24), as q - 32
    const uint8_t* r0 = rows + g * P;
    const uint32_t v0 = lds32(r0 + 16 * j + 4 * c), v1 = lds32(r0 + 8 * P + 16 * j + 4 * c);
    const uint32_t h0 = lds32(r0 + 32 + 8 * j + 4 * (c % 2)), h1 = lds32(r0 + 8 * P + 32 + 8 * j + 4 * (c % 2));
    const int sh = 2 * (c / 2);
    a[0] = q6_bytes(v0 & 0x0f0f0f0fu, h0 >> sh), a[1] = q6_bytes(v1 & 0x0f0f0f0fu, h1 >> sh);
    a[2] = q6_bytes((v0 >> 4) & 0x0f0f0f0fu, h0 >> (4 + sh)), a[3] = q6_bytes((v1 >> 4) & 0x0f0f0f0fu, h1 >> (4 + sh));
  } else if constexpr (kType == DType::Q3_K || kType == DType::Q2_K) {
    const uint8_t* r0 = rows + g * P + 4 * c;
    const int off[4] = {0, 8 * P, 16, 8 * P + 16}, jj = 2 * (pr % 2) + j;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = (lds32(r0 + off[i]) >> (2 * jj)) & 0x03030303u;
      if constexpr (kType == DType::Q3_K)  // | the hmask bit << 2, then - 4 bytewise (bytes 0..7: no borrow)
        a[i] = (((a[i] | ((lds32(r0 + 32 + off[i]) >> (2 * pr + j)) & 0x01010101u) << 2) | 0x80808080u) - 0x04040404u) ^ 0x80808080u;
    }
  } else if constexpr (kType == DType::IQ4_NL) {
    // block j's nibbles (low: columns 4c.., high: 16 + 4c..) as their int8 levels
    const uint8_t* r0 = rows + g * P + 16 * j + 4 * c;
    const uint32_t v0 = lds32(r0), v1 = lds32(r0 + 8 * P);
    a[0] = iq4_nl_level_bytes(v0), a[1] = iq4_nl_level_bytes(v1), a[2] = iq4_nl_level_bytes(v0 >> 4), a[3] = iq4_nl_level_bytes(v1 >> 4);
  } else if constexpr (kQ5<kType>) {
    // low / high nibbles of block j's qs (columns 4c.. and 16 + 4c..) with bits 4c.. / 16 + 4c.. of
    // its qh word moved to bit 4 of each byte
    const uint8_t* r0 = rows + g * P;
    const uint32_t v0 = lds32(r0 + 16 * j + 4 * c), v1 = lds32(r0 + 8 * P + 16 * j + 4 * c);
    const uint32_t h0 = lds32(r0 + 32 + 4 * j), h1 = lds32(r0 + 8 * P + 32 + 4 * j);
    a[0] = (v0 & 0x0f0f0f0fu) | fifth_bit_bytes(h0 >> (4 * c)), a[1] = (v1 & 0x0f0f0f0fu) | fifth_bit_bytes(h1 >> (4 * c));
    a[2] = ((v0 >> 4) & 0x0f0f0f0fu) | fifth_bit_bytes(h0 >> (16 + 4 * c)), a[3] = ((v1 >> 4) & 0x0f0f0f0fu) | fifth_bit_bytes(h1 >> (16 + 4 * c));
  } else if constexpr (kType == DType::Q8_0) {
    const uint8_t* r0 = rows + g * P + j * 32 + 4 * c;
    a[0] = lds32(r0), a[1] = lds32(r0 + 8 * P), a[2] = lds32(r0 + 16), a[3] = lds32(r0 + 8 * P + 16);
  } else {
    const uint8_t* r0 = rows + g * P + j * 16 + 4 * c;
    const uint32_t v0 = lds32(r0), v1 = lds32(r0 + 8 * P);
    a[0] = v0 & 0x0f0f0f0fu, a[1] = v1 & 0x0f0f0f0fu, a[2] = (v0 >> 4) & 0x0f0f0f0fu, a[3] = (v1 >> 4) & 0x0f0f0f0fu;
  }
}

// The scales of rows r and r + 8 for half j of a stage (the K-quants: the stage already holds the
// sub-block of this half): dw0 / dw1, and mw0 / mw1 for the types with a minimum.
template <DType kType, typename Stage>
__device__ __forceinline__ void mmq_row_scales(const Stage& s, int r, int j, float& dw0, float& dw1, float& mw0, float& mw1) {
  if constexpr (kSplitK<kType>) {  // Q4_K / Q5_K: a = d sc, -m = -dmin mn
    const uint32_t sm0 = s.dw[2 * r + j], sm1 = s.dw[2 * (r + 8) + j];
    const uint32_t k0 = lds32(s.mw + 2 * r), k1 = lds32(s.mw + 2 * (r + 8));
    dw0 = fp16_bits_to_float(uint16_t(k0 & 0xffff)) * float(sm0 & 0xff), mw0 = -fp16_bits_to_float(uint16_t(k0 >> 16)) * float(sm0 >> 8);
    dw1 = fp16_bits_to_float(uint16_t(k1 & 0xffff)) * float(sm1 & 0xff), mw1 = -fp16_bits_to_float(uint16_t(k1 >> 16)) * float(sm1 >> 8);
  } else {
    dw0 = fp16_bits_to_float(s.dw[2 * r + j]), dw1 = fp16_bits_to_float(s.dw[2 * (r + 8) + j]);
    if constexpr (kMin<kType>)
      mw0 = fp16_bits_to_float(s.mw[2 * r + j]), mw1 = fp16_bits_to_float(s.mw[2 * (r + 8) + j]);
  }
}

// One mma tile's integer dots d (rows r, r + 8 × tokens t, t + 1) scaled into o: Q8_0 / IQ4_NL
// d_w d_x Σ; Q4_0 / Q5_0 d_w (d_x Σ - 8 s_x / - 16 s_x); the others d_w d_x Σ + m_w s_x.
template <DType kType, typename Stage>
__device__ __forceinline__ void mmq_scale_add(float* o, const int (&d)[4], float dw0, float dw1, float mw0, float mw1, const Stage& s, int t,
                                              int j) {
  const float dx0 = s.dx[2 * t + j], dx1 = s.dx[2 * (t + 1) + j];
  if constexpr (kType == DType::Q8_0 || kType == DType::IQ4_NL) {
    o[0] += dw0 * dx0 * float(d[0]), o[1] += dw0 * dx1 * float(d[1]);
    o[2] += dw1 * dx0 * float(d[2]), o[3] += dw1 * dx1 * float(d[3]);
  } else {
    const float sx0 = s.sx[2 * t + j], sx1 = s.sx[2 * (t + 1) + j];
    if constexpr (kType == DType::Q4_0 || kType == DType::Q5_0) {
      constexpr float off = kType == DType::Q4_0 ? 8.0f : 16.0f;
      o[0] += dw0 * (dx0 * float(d[0]) - off * sx0), o[1] += dw0 * (dx1 * float(d[1]) - off * sx1);
      o[2] += dw1 * (dx0 * float(d[2]) - off * sx0), o[3] += dw1 * (dx1 * float(d[3]) - off * sx1);
    } else {
      o[0] += dw0 * dx0 * float(d[0]) + mw0 * sx0, o[1] += dw0 * dx1 * float(d[1]) + mw0 * sx1;
      o[2] += dw1 * dx0 * float(d[2]) + mw1 * sx0, o[3] += dw1 * dx1 * float(d[3]) + mw1 * sx1;
    }
  }
}

// The kernels' end: the warp's accumulators (MI × NT mma tiles of 16 rows × 8 tokens, lane (g, c)
// holding rows g and g + 8, tokens 2c and 2c + 1) into y, or into split z's part of p.y.
template <int MI, int NT>
__device__ __forceinline__ void mmq_store(const float (&acc)[MI][NT][4], const MmqArgs& p, int row0, int tok0, int wr, int wc, int g, int c,
                                          int z) {
  float* y = p.splits == 1 ? p.y : p.y + int64_t(z) * p.T * p.rows;
  const int64_t ldy = p.splits == 1 ? p.ldy : p.rows;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + wr + 16 * mi + g + (i >= 2 ? 8 : 0), tok = tok0 + wc + 8 * ni + 2 * c + (i & 1);
        if (row < p.rows && tok < p.T) y[int64_t(tok) * ldy + row] = acc[mi][ni][i];
      }
}

// MinB: the blocks per SM the registers must allow (__launch_bounds__'s second argument; 0: the
// compiler's choice, as the engine runs it: Q4_0 100 / 128 registers at 16 / 32 tokens, Q8_0 64 /
// 86, so 2 blocks per SM at 32). The lab's occupancy variants (MmqTuning::min_blocks) build 3
// (80 registers, no spills) and 4 (64; 60-68 bytes spilled at 32 tokens) for Q4_0 and Q8_0.
template <DType kType, int BN, int S = kMmqStages, int MinB = 0>
__global__ void __launch_bounds__(kMmqThreads, MinB) mmq_kernel(MmqArgs p) {
  pdl_begin();
  using Stage = MmqStage<kType, BN>;
  constexpr int NT = BN / 16;  // 8-token tiles per warp
  auto* st = reinterpret_cast<Stage*>(dynamic_smem());
  const int row0 = int(blockIdx.x) * kMmqBM, tok0 = int(blockIdx.y) * BN;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
  const int wr = (warp % 4) * 32, wc = (warp / 4) * (BN / 2);  // the warp's first row and token in the tile
  const int all_stages = p.cols / kMmqBK, z = int(blockIdx.z);
  const int first = int(int64_t(all_stages) * z / p.splits), n_stages = int(int64_t(all_stages) * (z + 1) / p.splits) - first;
  float acc[2][NT][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;

  constexpr bool kRaw = kWords<kType> || kB32<kType>;  // rows in the file's layout: mmq_load per stage
  const std::conditional_t<kRaw, NoCopies, MmqCopies<kType, BN>> copies(p, row0, tok0, 2 * first);
  auto load = [&](int s) {
    if constexpr (kRaw) mmq_load(st[s % S], p, row0, tok0, 2 * (first + s));
    else copies.issue(st[s % S], s);
  };
  for (int s = 0; s < S - 1; ++s) {
    if (s < n_stages) load(s);
    cp_async_commit();
  }
  for (int k = 0; k < n_stages; ++k) {
    cp_async_wait<S - 2>();  // stage k has landed (for this thread's copies) ...
    __syncthreads();                  // ... and everyone's; stage k - 1 is consumed by all
    const int kn = k + S - 1;
    if (kn < n_stages) load(kn);
    cp_async_commit();
    const Stage& s = st[k % S];
    const int pr = (first + k) % 4;  // K-quants: the stage's sub-block pair in its super-block
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t a[2][4], b[NT][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) load_a<kType>(a[mi], s.a + (wr + 16 * mi) * kAPitch<kType>, j, g, c, pr);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const int8_t* br = s.b + (wc + 8 * ni + g) * kBPitch + j * 32 + 4 * c;
        b[ni][0] = lds32(br), b[ni][1] = lds32(br + 16);
      }
      int xs[NT][2][2];  // Q2_K's Σ_half q_x
      if constexpr (kType == DType::Q2_K) ones_sums<NT>(xs, b);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wr + 16 * mi + g;
        if constexpr (kSplit16<kType>) {
          split16_accumulate<kType, NT>(acc[mi], a[mi], b, xs, s, r, j, pr, wc, c);
          continue;
        }
        float dw0, dw1, mw0 = 0.0f, mw1 = 0.0f;
        mmq_row_scales<kType>(s, r, j, dw0, dw1, mw0, mw1);
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) {
          int d[4] = {0, 0, 0, 0};
          if constexpr (kType == DType::Q8_0 || kType == DType::IQ4_NL) mma_s8(d, a[mi], b[ni]);
          else mma_u8s8(d, a[mi], b[ni]);
          mmq_scale_add<kType>(acc[mi][ni], d, dw0, dw1, mw0, mw1, s, wc + 8 * ni + 2 * c, j);
        }
      }
    }
  }
  cp_async_wait<0>();
  mmq_store<2, NT>(acc, p, row0, tok0, wr, wc, g, c, z);
}

// y [T, rows] (row t at y + t · ldy) = Σ_z part [z, T, rows], z in order.
__global__ void mmq_reduce_kernel(const float* __restrict__ part, float* __restrict__ y, int64_t ldy, int rows, int T, int splits) {
  pdl_begin();
  const int64_t n = int64_t(T) * rows;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.0f;
    for (int z = 0; z < splits; ++z) v += part[z * n + i];
    y[(i / rows) * ldy + i % rows] = v;
  }
}

// ---- MMQ on fp16 tiles (mmq_h; Q4_0 and Q8_0) ----
// The int8 kernel above scales every 16 x 8 tile's integer sums per 32-column block in fp32
// (a conversion and two FMAs per row, token and block): at 16-32 tokens those instructions,
// not the bytes, bound a stage (dev/README.md #21). Here each warp owns 16 rows and every token
// of the tile, dequantizes its weights once into mma.m16n8k16 A fragments (fp16 d_w (q - 8) or
// d_w q, exact q by the 0x6400 exponent trick), and multiplies fp16 activations with fp32
// accumulation: the per-(row, token) work is the mma alone, the dequantization is shared by all
// BN tokens. Activations are fp16 [T, cols] (the cuBLAS path's conversion), loaded by cp.async
// into rows of kXhPitch halves and read by ldmatrix.
constexpr int kXhPitch = kMmqBK + 8;  // halves a token's row (144 bytes: ldmatrix's 8 rows fall in distinct banks)

template <DType kType, int BN>
struct MmqHStage {
  alignas(16) uint8_t a[kMmqBM * kAPitch<kType>];  // weight quants [BM][2 blocks' bytes + pad], as MmqStage
  alignas(16) uint16_t x[BN * kXhPitch];            // fp16 activations [BN][64 + 8]
  alignas(16) uint16_t dw[kMmqBM * 2];               // weight scales [BM][2] fp16
};

// mmq_h_kernel's copies of every stage: the weights' as mmq_kernel's (MmqWeightCopies) and the
// fp16 activations' in 16-byte chunks, addressed once (tokens past the end read the last one).
template <DType kType, int BN>
struct MmqHCopies {
  static constexpr int kX = (BN * 8 + kMmqThreads - 1) / kMmqThreads;  // activation chunks a thread (BN 16: half the threads)
  MmqWeightCopies<kType> wc;
  const uint16_t* x[kX];
  int xo[kX];

  __device__ __forceinline__ MmqHCopies(const MmqArgs& p, int row0, int tok0, int first_kb) : wc(p, row0, first_kb) {
#pragma unroll
    for (int i = 0; i < kX; ++i) {
      const int e = min(int(threadIdx.x) + i * kMmqThreads, BN * 8 - 1), t = e / 8, c = e % 8, tok = min(tok0 + t, p.T - 1);
      x[i] = p.xh + int64_t(tok) * p.cols + first_kb * 32 + c * 8, xo[i] = t * kXhPitch + c * 8;
    }
  }
  __device__ __forceinline__ void issue(MmqHStage<kType, BN>& st, int s) const {
    wc.issue(st, s);
#pragma unroll
    for (int i = 0; i < kX; ++i)
      if (BN * 8 >= kMmqThreads * (i + 1) || int(threadIdx.x) + i * kMmqThreads < BN * 8) cp_async16(st.x + xo[i], x[i] + int64_t(s) * 64);
  }
};

__device__ __forceinline__ uint32_t lds16(const void* p) { return *reinterpret_cast<const uint16_t*>(p); }

// d (fp16 bits) × (the half2 of w - off): w holds two values v as fp16 1024 + v
// (0x6400 | v, v < 1024), so w - off is v - (off - 1024) exactly.
__device__ __forceinline__ uint32_t h2_dequant(uint32_t w, float off, uint32_t d) {
  const __half2 v = __halves2half2(__ushort_as_half(uint16_t(w & 0xffffu)), __ushort_as_half(uint16_t(w >> 16)));
  const __half dh = __ushort_as_half(uint16_t(d & 0xffffu));
  const __half2 r = __hmul2(__hsub2(v, __float2half2_rn(off)), __halves2half2(dh, dh));
  return uint32_t(__half_as_ushort(__low2half(r))) | uint32_t(__half_as_ushort(__high2half(r))) << 16;
}

// The mma_f16 A fragments of rows g and g + 8 of the warp's 16 (rows: the first, pitch
// kAPitch) for block j of the stage: a[0] its columns 0..15, a[1] columns 16..31, dequantized
// with the rows' scales d0, d1 (fp16 bits). A lane needs columns 2c, 2c + 1 and
// 8 + 2c, 9 + 2c of each half: Q4_0 bytes 2c, 2c + 1 and 8 + 2c, 9 + 2c (low nibbles: half 0,
// high: half 1); Q8_0 bytes 2c.. and 8 + 2c.. of each half.
template <DType kType>
__device__ __forceinline__ void load_a_h(uint32_t (&a)[2][4], const uint8_t* rows, int j, int g, int c, uint32_t d0, uint32_t d1) {
  constexpr int P = kAPitch<kType>;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // register i: row g (i even) or g + 8, columns + 8 (i >= 2)
    const uint32_t d = i % 2 ? d1 : d0;
    const uint8_t* r = rows + (g + 8 * (i % 2)) * P + 2 * c + (i >= 2 ? 8 : 0);
    if constexpr (kType == DType::Q4_0) {
      const uint32_t v = lds16(r + 16 * j);  // two bytes: columns 2c, 2c + 1 (low nibbles) and 16 + 2c, 17 + 2c (high)
      a[0][i] = h2_dequant(0x64006400u | (v & 0xfu) | ((v & 0xf00u) << 8), 1032.0f, d);
      a[1][i] = h2_dequant(0x64006400u | ((v >> 4) & 0xfu) | ((v & 0xf000u) << 4), 1032.0f, d);
    } else {  // Q8_0: int8 + 128 as 0..255
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t v = lds16(r + 32 * j + 16 * h);
        a[h][i] = h2_dequant(0x64006400u | (((v & 0xffu) | ((v & 0xff00u) << 8)) ^ 0x00800080u), 1152.0f, d);
      }
    }
  }
}

// y [T, rows] (or split z's part) = x · wᵀ for a tile of kMmqBM rows × BN tokens: 8 warps of 16
// rows, each over every token (NT = BN / 8 tiles of 8), stages of 64 columns kMmqStages deep.
template <DType kType, int BN>
__global__ void __launch_bounds__(kMmqThreads) mmq_h_kernel(MmqArgs p) {
  pdl_begin();
  using Stage = MmqHStage<kType, BN>;
  constexpr int NT = BN / 8, S = kMmqStages;
  auto* st = reinterpret_cast<Stage*>(dynamic_smem());
  const int row0 = int(blockIdx.x) * kMmqBM, tok0 = int(blockIdx.y) * BN;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, c = lane % 4, wr = warp * 16;
  const int all_stages = p.cols / kMmqBK, z = int(blockIdx.z);
  const int first = int(int64_t(all_stages) * z / p.splits), n_stages = int(int64_t(all_stages) * (z + 1) / p.splits) - first;
  // ldmatrix: lane L names row L % 8 of matrix L / 8 = (token tile +0 / +1) x (columns +0 / +8)
  const int lm = lane / 8, lrow = 8 * (lm / 2) + lane % 8, lcol = 8 * (lm % 2);
  float acc[1][NT][4];
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][ni][i] = 0.0f;

  const MmqHCopies<kType, BN> copies(p, row0, tok0, 2 * first);
  // the same cp.async pipeline as mmq_kernel's (written out in both: a shared helper taking the
  // stage's work as a lambda moved the int8 kernel's code, Q6_K 480 -> 502 instructions a stage)
  for (int s = 0; s < S - 1; ++s) {
    if (s < n_stages) copies.issue(st[s], s);
    cp_async_commit();
  }
  for (int k = 0; k < n_stages; ++k) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int kn = k + S - 1;
    if (kn < n_stages) copies.issue(st[kn % S], kn);
    cp_async_commit();
    const Stage& s = st[k % S];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t d0 = s.dw[2 * (wr + g) + j], d1 = s.dw[2 * (wr + g + 8) + j];
      uint32_t a[2][4];
      load_a_h<kType>(a, s.a + wr * kAPitch<kType>, j, g, c, d0, d1);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int ni = 0; ni < NT; ni += 2) {
          uint32_t r[4];
          ldmatrix_x4(r, s.x + (8 * ni + lrow) * kXhPitch + 32 * j + 16 * h + lcol);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
          mma_f16(acc[0][ni], a[h], b0), mma_f16(acc[0][ni + 1], a[h], b1);
        }
    }
  }
  cp_async_wait<0>();
  mmq_store<1, NT>(acc, p, row0, tok0, wr, 0, g, c, z);
}

template <DType kType, int BN>
void allow_smem_h() {
  allow_dynamic_smem(reinterpret_cast<const void*>(&mmq_h_kernel<kType, BN>), sizeof(MmqHStage<kType, BN>) * kMmqStages);
}

template <DType kType>
void launch_mmq_h_bn(const MmqArgs& a, int bn, cudaStream_t s) {
  auto go = [&](auto width) {
    constexpr int BN = decltype(width)::value;
    allow_smem_h<kType, BN>();
    const dim3 grid{unsigned((a.rows + kMmqBM - 1) / kMmqBM), unsigned((a.T + BN - 1) / BN), unsigned(a.splits)};
    auto* kernel = mmq_h_kernel<kType, BN>;
    LLMQ_LAUNCH(kernel, grid, kMmqThreads, sizeof(MmqHStage<kType, BN>) * kMmqStages, s)(a);
  };
  bn == 16 ? go(std::integral_constant<int, 16>{}) : bn == 32 ? go(std::integral_constant<int, 32>{}) : go(std::integral_constant<int, 64>{});
}

// The kernel's shared memory beyond the default 48 KiB: allowed once per instantiation and
// device (on first use, or by mmq_prepare before a CUDA graph is captured).
template <DType kType, int BN, int S = kMmqStages, int MinB = 0>
void allow_smem() {
  allow_dynamic_smem(reinterpret_cast<const void*>(&mmq_kernel<kType, BN, S, MinB>), sizeof(MmqStage<kType, BN>) * S);
}

template <DType kType>
void allow_smem_all() {
  allow_smem<kType, 16>(), allow_smem<kType, 32>(), allow_smem<kType, 64>(), allow_smem<kType, 128>();
}

template <DType kType, int BN, int S = kMmqStages, int MinB = 0>
void launch_mmq(const MmqArgs& a, cudaStream_t s) {
  constexpr size_t smem = sizeof(MmqStage<kType, BN>) * S;
  allow_smem<kType, BN, S, MinB>();
  const dim3 grid{unsigned((a.rows + kMmqBM - 1) / kMmqBM), unsigned((a.T + BN - 1) / BN), unsigned(a.splits)};
  auto* kernel = mmq_kernel<kType, BN, S, MinB>;  // a template name's comma would split the macro's arguments
  LLMQ_LAUNCH(kernel, grid, kMmqThreads, smem, s)(a);
}

// The lab's variants (MmqTuning): pipeline depths 4, 6, 8, or 3 stages with registers for 3 or 4
// blocks per SM; Q4_0 and Q8_0 at 16 or 32 tokens per block.
template <DType kType>
void launch_mmq_tuned(const MmqArgs& a, int bn, MmqTuning tune, cudaStream_t s) {
  auto pick = [&](auto depth, auto min_blocks) {
    constexpr int D = decltype(depth)::value, B = decltype(min_blocks)::value;
    bn == 16 ? launch_mmq<kType, 16, D, B>(a, s) : launch_mmq<kType, 32, D, B>(a, s);
  };
  using I = std::integral_constant<int, 0>;
  if (tune.min_blocks == 3) return pick(std::integral_constant<int, kMmqStages>{}, std::integral_constant<int, 3>{});
  if (tune.min_blocks == 4) return pick(std::integral_constant<int, kMmqStages>{}, std::integral_constant<int, 4>{});
  switch (tune.stages) {
    case 4: return pick(std::integral_constant<int, 4>{}, I{});
    case 6: return pick(std::integral_constant<int, 6>{}, I{});
    default: return pick(std::integral_constant<int, 8>{}, I{});
  }
}

template <DType kType>
void launch_mmq_bn(const MmqArgs& a, int bn, cudaStream_t s) {
  switch (bn) {
    case 16: return launch_mmq<kType, 16>(a, s);
    case 32: return launch_mmq<kType, 32>(a, s);
    case 64: return launch_mmq<kType, 64>(a, s);
    default: return launch_mmq<kType, 128>(a, s);
  }
}

// The kernel for w's type at the engine's pipeline depth.
void launch_mmq_type(DType type, const MmqArgs& a, int bn, cudaStream_t s) {
  switch (type) {
    case DType::Q8_0: launch_mmq_bn<DType::Q8_0>(a, bn, s); break;
    case DType::Q4_0: launch_mmq_bn<DType::Q4_0>(a, bn, s); break;
    case DType::Q5_0: launch_mmq_bn<DType::Q5_0>(a, bn, s); break;
    case DType::Q5_1: launch_mmq_bn<DType::Q5_1>(a, bn, s); break;
    case DType::IQ4_NL: launch_mmq_bn<DType::IQ4_NL>(a, bn, s); break;
    case DType::Q2_K: launch_mmq_bn<DType::Q2_K>(a, bn, s); break;
    case DType::Q3_K: launch_mmq_bn<DType::Q3_K>(a, bn, s); break;
    case DType::Q4_K: launch_mmq_bn<DType::Q4_K>(a, bn, s); break;
    case DType::Q5_K: launch_mmq_bn<DType::Q5_K>(a, bn, s); break;
    case DType::Q6_K: launch_mmq_bn<DType::Q6_K>(a, bn, s); break;
    default: launch_mmq_bn<DType::Q4_1>(a, bn, s); break;
  }
}

}  // namespace

void mmq_prepare() {
  allow_smem_all<DType::Q8_0>(), allow_smem_all<DType::Q4_0>(), allow_smem_all<DType::Q4_1>();
  allow_smem_all<DType::Q5_0>(), allow_smem_all<DType::Q5_1>(), allow_smem_all<DType::IQ4_NL>();
  allow_smem_all<DType::Q2_K>(), allow_smem_all<DType::Q3_K>(), allow_smem_all<DType::Q4_K>(), allow_smem_all<DType::Q5_K>();
  allow_smem_all<DType::Q6_K>();
  allow_smem_h<DType::Q4_0, 16>(), allow_smem_h<DType::Q4_0, 32>(), allow_smem_h<DType::Q4_0, 64>();
  allow_smem_h<DType::Q8_0, 16>(), allow_smem_h<DType::Q8_0, 32>(), allow_smem_h<DType::Q8_0, 64>();
}

bool mmq_h_supported(const DeviceWeight& w) { return (w.type == DType::Q4_0 || w.type == DType::Q8_0) && mmq_supported(w); }

bool mmq_supported(const DeviceWeight& w) {
  const bool split = is_quantized(w.type) && !is_raw_type(w.type);  // the split layout
  const bool words = is_raw_type(w.type);                             // raw rows by 16-bit loads
  const auto at = reinterpret_cast<uintptr_t>(w.q);
  return (split || (words && at % 2 == 0)) && w.cols % 64 == 0 && w.rows > 0;
}

int mmq_tile_tokens(int64_t T) { return T <= 16 ? 16 : T <= 32 ? 32 : T <= 64 ? 64 : 128; }

// Enough CUDA blocks for two per SM of an H100/H200 (132 SMs: 264 slots at 128 registers x 256
// threads): a 4096-row matrix at 16 tokens is 32 blocks, each walking all its columns' stages
// one after another (latency-bound: 50 us on an H200 against 3 us of weight bytes). Each split
// keeps at least 4 stages (256 columns) and fits the scratch.
// Tiles of 16 and 32 tokens: a grid just past a whole number of waves pays for a nearly empty
// one (llama-2-7b's qkv, 96 row blocks x 3 splits = 288 blocks: 46.0 us; x 5 = 480: 37.7 us;
// gate_up, 172 x 2 = 344: 71.1 us, x 3 = 516: 56.7 us; dev/cuda/mmq.cu --sweep on an H200,
// bench/RESULTS.md), so where 8 splits would fill more than one wave the split count maximises
// the filled share of the last wave, less 0.03 a split (the partial sums' traffic). Smaller
// grids and wider tiles keep the first rule (wider tiles were not swept).
int mmq_splits(const DeviceWeight& w, int64_t T, uint64_t split_bytes) {
  constexpr int64_t kSlots = 264;
  const int tile = mmq_tile_tokens(T);
  const int64_t blocks = (w.rows + kMmqBM - 1) / kMmqBM * ((T + tile - 1) / tile);
  auto fits = [&](int64_t s) { return s <= w.cols / kMmqBK / 4 && uint64_t(s) * uint64_t(T) * uint64_t(w.rows) * 4 <= split_bytes; };
  if (tile <= 32 && blocks * 8 > kSlots) {
    int64_t best = 1;
    double best_score = -1;
    for (int64_t s = 1; s <= 8 && (s == 1 || fits(s)); ++s) {
      const int64_t n = blocks * s, waves = (n + kSlots - 1) / kSlots;
      const double score = double(n) / double(waves * kSlots) - 0.03 * double(s);
      if (score > best_score) best_score = score, best = s;
    }
    return int(best);
  }
  int64_t splits = std::min<int64_t>({8, (kSlots + blocks - 1) / blocks, w.cols / kMmqBK / 4});
  while (splits > 1 && !fits(splits)) --splits;
  return int(std::max<int64_t>(1, splits));
}

namespace {

// The arguments of an MMQ kernel for w at T tokens (activations left to the caller): K split into
// `splits` column ranges (0: mmq_splits's count with scratch, 1 without) whose partial sums go
// to the scratch, else straight to y (ldy 0: w.rows). Throws UsageError for sizes out of range
// and for splits that do not fit the columns or the scratch.
MmqArgs mmq_args(const char* who, const DeviceWeight& w, float* y, int64_t T, int64_t ldy, float* split, uint64_t split_bytes, int splits) {
  if (T < 1 || T > (int64_t(1) << 24) || w.rows > (int64_t(1) << 30)) throw UsageError(std::string(who) + ": sizes out of range");
  if (!splits) splits = split ? mmq_splits(w, T, split_bytes) : 1;
  if (splits < 1 || splits > w.cols / kMmqBK || (splits > 1 && (!split || uint64_t(splits) * uint64_t(T) * uint64_t(w.rows) * 4 > split_bytes)))
    throw UsageError(std::string(who) + ": " + std::to_string(splits) + " splits do not fit the columns or the scratch");
  return MmqArgs{w.q, w.d, w.m, w.h, w.k, nullptr, nullptr, nullptr, splits > 1 ? split : y, ldy ? ldy : w.rows, int(w.rows), int(w.cols),
                 int(T), splits, int64_t(row_bytes(w.type, w.cols))};
}

// After a kernel launched with a's splits: their partial sums added into y (none for 1 split).
void mmq_reduce(const MmqArgs& a, float* y, cudaStream_t s) {
  if (a.splits == 1) return;
  const int64_t n = int64_t(a.T) * a.rows;
  LLMQ_LAUNCH(mmq_reduce_kernel, unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, s)(a.y, y, a.ldy, a.rows, a.T, a.splits);
  check_launch("mmq_reduce");
}

}  // namespace

void mmq(const DeviceWeight& w, const DeviceActQ8& xq, float* y, int64_t T, int64_t ldy, cudaStream_t s, int tile_tokens, float* split,
         uint64_t split_bytes, MmqTuning tune) {
  if (!mmq_supported(w)) throw UsageError("mmq: quantized weights with columns a multiple of 64");
  MmqArgs a = mmq_args("mmq", w, y, T, ldy, split, split_bytes, tune.splits);
  a.xq = xq.q, a.xd = xq.d, a.xs = xq.s;
  const int bn = tile_tokens ? tile_tokens : mmq_tile_tokens(T);
  const bool deeper = tune.stages != 0 && tune.stages != kMmqStages, denser = tune.min_blocks > 1;
  if (deeper || denser) {
    const bool ok = (w.type == DType::Q4_0 || w.type == DType::Q8_0) && (bn == 16 || bn == 32) &&
                    (deeper ? !denser && (tune.stages == 4 || tune.stages == 6 || tune.stages == 8) : tune.min_blocks <= 4);
    if (!ok)
      throw UsageError("mmq: the lab's variants are built for Q4_0 and Q8_0 at 16 or 32 tokens per block (4, 6 or 8 stages, or 3 stages "
                       "at 3 or 4 blocks per SM)");
    w.type == DType::Q4_0 ? launch_mmq_tuned<DType::Q4_0>(a, bn, tune, s) : launch_mmq_tuned<DType::Q8_0>(a, bn, tune, s);
  } else {
    launch_mmq_type(w.type, a, bn, s);
  }
  check_launch("mmq");
  mmq_reduce(a, y, s);
}

void mmq_h(const DeviceWeight& w, const uint16_t* xh, float* y, int64_t T, int64_t ldy, cudaStream_t s, int tile_tokens, float* split,
           uint64_t split_bytes, int splits) {
  if (!mmq_h_supported(w)) throw UsageError("mmq_h: Q4_0 or Q8_0 weights with columns a multiple of 64");
  MmqArgs a = mmq_args("mmq_h", w, y, T, ldy, split, split_bytes, splits);
  a.xh = xh;
  const int bn = tile_tokens ? tile_tokens : std::min(64, mmq_tile_tokens(T));
  if (bn != 16 && bn != 32 && bn != 64) throw UsageError("mmq_h: tiles of 16, 32 or 64 tokens");
  w.type == DType::Q4_0 ? launch_mmq_h_bn<DType::Q4_0>(a, bn, s) : launch_mmq_h_bn<DType::Q8_0>(a, bn, s);
  check_launch("mmq_h");
  mmq_reduce(a, y, s);
}

}  // namespace llmq::cuda
