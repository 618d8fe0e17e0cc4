// x86-64 SIMD kernels; see cpu_x86.h for the contract and the numerics.
//
// Block-quantized weights (every type of formats/quant.h but the floats), activations quantized
// per block of 32 to int8; the K-quants are taken a 32-weight sub-block at a time (Q3_K's and
// Q6_K's two 16-weight halves keep separate integer sums):
// - AVX-512: the weights are repacked into panels of 16 rows (section "Packed weights" below):
//   one 64-byte vector holds 4 consecutive quants of each of the 16 rows (Q4: nibbles still
//   packed), so one `vpdpbusd` with a broadcast 4-byte group of one token's activations does 64
//   multiply-adds for 16 rows, lanes are rows, and no horizontal sum is needed. Model::load packs
//   every matrix once, so decode reads one panel after the other as a single stream and prefill
//   reuses each panel from cache for every tile of 8 tokens; a weight not packed at load has each
//   panel packed into the thread's scratch per call. Decode and prefill run the same tiles.
// - AVX2, GEMV (up to 15 or 31 tokens): weight rows are read in place, one after the other, one
//   block per step with `_mm256_maddubs_epi16`; GEMM: 8 rows repacked per panel as above, with
//   `_mm256_maddubs_epi16` (see its section for the int16 range argument).
// `vpdpbusd` and `_mm256_maddubs_epi16` multiply unsigned by signed bytes. With AVX-512 the
// weights are made unsigned and the offset is removed exactly by an integer correction:
// Q8_0 as w+128 (corr = -128·Σx), Q4_0 as the raw nibble q = w+8 (corr = -8·Σx); Q4_1's
// nibble is unsigned already (its minimum m enters as m·s_x per block, s_x = d_x·Σq_x).
// AVX2 keeps Q8_0 signed and uses |w|·(x·sign w), because (w+128)·x overflows int16 pairs;
// its other types use the unsigned nibbles with the same corrections as AVX-512.
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the 5th and 6th bits kept as bit planes beside the nibbles,
// Q5_0's offset 16 corrected as Q4_0's 8, Q6_K's 32 per half block; Q3_K: 2-bit crumbs and a
// plane of bit 2, its offset 4 corrected per half block. Both levels read weights packed at load
// into panels of rows (AVX-512 16, AVX2 8; see their sections).
//
// Float weights (F32/F16/BF16): fp32 activations, tiles of R rows × C tokens with one vector
// accumulator per output along K (F16 by F16C, BF16 by a 16-bit shift), a fixed-order
// horizontal sum at the end; tokens blocked so that their activations stay in L2.
#include "engine/cpu/cpu_x86.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LLMQ_X86 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on _mm512_undefined_* (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
// Everything between LLMQ_TARGET_BEGIN("isa,...") and LLMQ_TARGET_END is compiled for that
// instruction set (the functions of one level), whatever the build's -march.
#define LLMQ_PRAGMA(x) _Pragma(#x)
#ifdef __clang__
#define LLMQ_TARGET_BEGIN(isa) LLMQ_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define LLMQ_TARGET_END LLMQ_PRAGMA(clang attribute pop)
#else
#define LLMQ_TARGET_BEGIN(isa) LLMQ_PRAGMA(GCC push_options) LLMQ_PRAGMA(GCC target(isa))
#define LLMQ_TARGET_END LLMQ_PRAGMA(GCC pop_options)
#endif
#endif

namespace llmq::x86 {

#if !LLMQ_X86

bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
const Kernels* kernels_avx2() { return nullptr; }
const Kernels* kernels_avx512() { return nullptr; }
bool cpu_has_avx512bf16() { return false; }

#else

// F16C from CPUID leaf 1 (ECX bit 29): clang (14) does not know "f16c" in __builtin_cpu_supports.
static bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}

bool cpu_has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  }();
  return ok;
}

bool cpu_has_avx512bf16() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
}

bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

namespace {

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

template <DType D>
constexpr size_t block_size() {
  return D == DType::Q8_0 ? sizeof(BlockQ8_0) : D == DType::Q4_0 || D == DType::IQ4_NL ? sizeof(BlockQ4_0) : sizeof(BlockQ4_1);
}
// Offset of the quants inside a block.
template <DType D>
constexpr size_t quant_offset() {
  return D == DType::Q4_1 ? 4 : 2;
}
// Calls f(Layout<D>{}) for the block type t (a quantized type): the per-type packed layouts of
// both levels (avx2::Pk8, avx512::Pk) are dispatched on a run-time DType once per call here.
template <template <DType> class Layout, class F>
auto with_layout(DType t, F&& f) {
  switch (t) {
    case DType::Q8_0: return f(Layout<DType::Q8_0>{});
    case DType::Q4_0: return f(Layout<DType::Q4_0>{});
    case DType::Q4_1: return f(Layout<DType::Q4_1>{});
    case DType::Q5_0: return f(Layout<DType::Q5_0>{});
    case DType::Q5_1: return f(Layout<DType::Q5_1>{});
    case DType::Q4_K: return f(Layout<DType::Q4_K>{});
    case DType::Q5_K: return f(Layout<DType::Q5_K>{});
    case DType::IQ4_NL: return f(Layout<DType::IQ4_NL>{});
    case DType::Q2_K: return f(Layout<DType::Q2_K>{});
    case DType::Q3_K: return f(Layout<DType::Q3_K>{});
    default: return f(Layout<DType::Q6_K>{});
  }
}

// What both levels' packed layouts need to know of a type beyond its file layout.
template <DType D>
struct QuantTraits {
  /// One scale per half block (16 weights): the halves' integer dots are kept apart.
  static constexpr bool kTwoScales = D == DType::Q2_K || D == DType::Q3_K || D == DType::Q6_K;
  /// One minimum per half block (Q2_K): − dmin·m_h · d_x·Σ_h q_x from corr's half sums.
  static constexpr bool kHalfMins = D == DType::Q2_K;
  /// The offset the two-scale types remove per half block (corr holds the halves' Σq_x).
  static constexpr int kHalfOffset = D == DType::Q6_K ? 32 : D == DType::Q3_K ? 4 : 0;
  /// Bits of each quant in the packed quant vectors: nibbles, or Q2_K's and Q3_K's 2-bit crumbs.
  static constexpr int kLowBits = D == DType::Q2_K || D == DType::Q3_K ? 2 : 4;
  /// Bit planes above them: Q6_K bits 4 and 5; Q5_0/Q5_1/Q5_K bit 4; Q3_K bit 2.
  static constexpr int kHighBits = D == DType::Q6_K ? 2
                                 : D == DType::Q5_0 || D == DType::Q5_1 || D == DType::Q5_K || D == DType::Q3_K ? 1
                                                                                                                 : 0;
};
// The two-scale types' corrections are the halves' sums (fill_corr_halves).
bool has_half_corr(DType t) {
  return with_layout<QuantTraits>(t, [](auto tr) { return decltype(tr)::kTwoScales; });
}

// Packing shared by both levels. The 2-bit quants of Q2_K/Q3_K from a decoded block, for row
// lane i of a panel whose quant vectors are `vec` bytes apart: u_J's quant k (the block's
// element 4J + k) at bits 2(J/2) of byte 4i + k of vector J%2; Q3_K's bit 2 at bit J of hb's byte.
template <DType D>
void pack_crumbs(const QuantBlock& qb, int i, size_t vec, uint8_t* q, uint8_t* hb) {
  for (int J = 0; J < 8; ++J)
    for (int k = 0; k < 4; ++k) {
      const int u = qb.q[4 * J + k], at = 4 * i + k;
      q[vec * size_t(J % 2) + size_t(at)] |= uint8_t((u & 3) << (2 * (J / 2)));
      if constexpr (D == DType::Q3_K) hb[at] = uint8_t(hb[at] | ((u >> 2) & 1) << J);
    }
}
// The two half-block scale bytes of 32-weight block b of a Q2_K (the file's sc | m << 4) or Q3_K
// (s − 32 as int8) row.
template <DType D>
void crumb_half_scales(const uint8_t* row, int64_t b, uint8_t& lo, uint8_t& hi) {
  const uint8_t* blk = row + size_t(b / 8) * dtype_info(D).block_bytes;
  const int k = int(2 * (b % 8));
  if constexpr (D == DType::Q3_K) {
    lo = uint8_t(q3_k_scale(blk + 96, k) - 32), hi = uint8_t(q3_k_scale(blk + 96, k + 1) - 32);
  } else {
    lo = blk[k], hi = blk[k + 1];
  }
}

// Integer correction factor per block: weights enter the integer dot as u = w + k_off, so
// Σ w·x = Σ u·x + corr_factor·Σx with corr_factor = -k_off.
constexpr int32_t corr_factor(DType t) {
  return t == DType::Q8_0 || t == DType::IQ4_NL ? -128 : t == DType::Q4_0 ? -8 : t == DType::Q5_0 ? -16 : 0;
}

// Fills corr[t, b] = corr_factor · Σq_x for the GEMM paths. For finite activations
// |Σq_x| <= 32 · 127 and nothing overflows; a NaN or infinite activation (a model file whose
// weights hold NaN/Inf, loaded with --no-verify or written so) makes the quants garbage
// (cvtps gives INT32_MIN), so the product wraps in unsigned arithmetic, as the vector lanes
// do, instead of being signed overflow (undefined behaviour; found by fuzz/llmq_file). The
// logits are NaN then anyway.
void fill_corr(DType type, const int32_t* sums, int64_t n, int32_t* corr) {
  const auto k = uint32_t(corr_factor(type));
  for (int64_t i = 0; i < n; ++i) corr[i] = int32_t(k * uint32_t(sums[i]));
}

// Q2_K's, Q3_K's and Q6_K's corrections hold the two half-block sums of the quants instead (|Σ| <= 16 ·
// 128, so each fits int16): corr[i] = Σ_{j<16} q_j (low 16 bits) | Σ_{j>=16} q_j << 16.
void fill_corr_halves(const BlockQ8Act* xq, int64_t n, int32_t* corr) {
  for (int64_t i = 0; i < n; ++i) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 16; ++j) lo += xq[i].qs[j], hi += xq[i].qs[16 + j];
    corr[i] = int32_t((uint32_t(lo) & 0xffffu) | uint32_t(hi) << 16);
  }
}

}  // namespace

// =====================================================================================
// AVX2 + FMA + F16C
// =====================================================================================
LLMQ_TARGET_BEGIN("avx2,fma,f16c")

namespace avx2 {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// max |x| over n values (n a multiple of 8).
float absmax(const float* x, int64_t n) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  return hmax(a);
}

void quantize_act(const float* x, BlockQ8Act* out, int32_t* sums, int64_t n, int group) {
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  ActScale sc{};
  for (int64_t b = 0; b < n / QK; ++b, x += QK) {
    if (b % (group / QK) == 0) sc = act_scale(absmax(x, group), group);
    const __m256 idv = _mm256_set1_ps(sc.id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), idv));  // nearest-even
    const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), p8);
    out[b].d = sc.d;
    out[b].s = sc.d * float(sum);
    if (sums) sums[b] = sum;
  }
}

// ---- The vector type of the shared float kernels (x86_float.inc): 8 fp32 lanes.

struct Vec {
  using F = __m256;
  static constexpr int N = 8;
  static constexpr int kTileRows = 3, kTileTokens = 4;  // 12 accumulators + 3 weights + 1 activation = 16 registers
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int n) {  // lanes [0, n) all ones
    alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - n));
  }
  static F load_part(const float* p, int n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_part(float* p, F v, int n) { _mm256_maskstore_ps(p, first(n), v); }
  static F keep_first(F v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first(n))); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static float hsum(F v) { return avx2::hsum(v); }
  static float hmax(F v) { return avx2::hmax(v); }
  static F widen(__m128i h, DType d) {  // 8 F16 or BF16 values to fp32
    return d == DType::F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  template <DType D>
  static F load_w(const uint8_t* row, int64_t k) {
    if constexpr (D == DType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    else return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)), D);
  }
  template <DType D>
  static F load_w_part(const uint8_t* row, int64_t k, int n) {
    if constexpr (D == DType::F32) return load_part(reinterpret_cast<const float*>(row) + k, n);
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, row + 2 * k, size_t(n) * 2);
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)), D);
  }
  // e^x: 2^n is built in the exponent field, so x is clamped to [-87.3, 88.7] (results below
  // ~1.2e-38 become ~1.2e-38, above FLT_MAX stay finite); n in [-126, 128] as (n + 127) << 23,
  // split in two factors so that n = 128 works too.
  static constexpr float kExpLo = -87.3f, kExpHi = 88.7f;
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2n(F p, F n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i h = _mm256_srai_epi32(ni, 1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  }
};

#include "engine/cpu/x86_float.inc"

// Stores C tokens' accumulators of 8 rows (lanes) at y + c·M, the first nrows lanes only.
template <int C>
inline void store_rows8(float* y, int64_t M, const __m256* acc, int nrows) {
  if (nrows == 8) {
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * M, acc[c]);
    return;
  }
  alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - nrows));
  for (int c = 0; c < C; ++c) _mm256_maskstore_ps(y + c * M, mask, acc[c]);
}

// ---- Quantized matmul: 8-row panels, packed once at load (pack_weights) or per call.
//
// A panel holds 8 consecutive rows, block after block along K, as one sequential stream (the
// file's bytes rearranged, the same size but for K-quant scales), rows in the 8 int32 lanes:
// quant vector j (0..3) of a block holds in lane i the bytes 4j..4j+3 of row i's 16 nibble
// bytes, whose low nibbles are quants 4j..4j+3 and high nibbles quants 16+4j..16+4j+3 (Q8_0: 8
// vectors, lane i = signed quants 4j..4j+3 of row i). A block decodes in registers to 8
// vectors u_J (J = 0..7: lane i = quants 4J..4J+3 of row i), each the partner of one 4-byte
// broadcast of a token's activations: one decode serves C tokens, and as rows are lanes no
// horizontal sum is needed. The same tile serves decode (C = 1..3) and prefill (C = 4), so
// batched prefill equals token-by-token decode bit for bit. Per block:
//   [quants QB][high bits HB][scales SB]   (K-quants: a header of HDR bytes per super-block)
// Q2_K's and Q3_K's quants are 2-bit crumbs instead: vector c (0, 1) holds u_J for J = c + 2s at
// bits 2s.
// - high bits (Q5_0/Q5_1/Q5_K/Q3_K: one vector, Q6_K: two): byte 4i+k holds the bits that u_J's
//   quant k of row i misses: Q5 bit J = bit 4, Q3_K bit J = bit 2; Q6_K vector J/4, bits
//   2(J%4)+{0,1} = bits 4-5.
// - scales: Q4_0/Q5_0/Q8_0/IQ4_NL d[8] f16; Q4_1/Q5_1 d[8], m[8] f16; Q4_K/Q5_K the 6-bit sc[8] and
//   min[8] as bytes (header: d[8] and −dmin[8] as f16); Q6_K sc_lo[8], sc_hi[8] int8, Q3_K the
//   same as s − 32 (header d[8]); Q2_K the file's scale bytes of the two halves, [8] each
//   (header d[8], −dmin[8]).
// Bytes per block of 8 rows: Q4_0 and IQ4_NL 144 (the file's 144), Q4_1 160, Q5_0 176, Q5_1 192, Q8_0 272
// (all as the file), Q2_K 84 (file 84), Q3_K 114 (110), Q4_K 148 (144), Q5_K 180 (176), Q6_K 210.
//
// Integer part: `_mm256_maddubs_epi16` (unsigned u × signed x, pairs summed to saturating
// int16), summed in int16 over G vectors where that cannot overflow (Q4: 8 · 2·15·127 = 30480;
// 5-bit: 4 · 2·31·127 = 31496; Q6_K: 2 · 2·63·127 = 32004; Q3_K 4 per half), then widened. The
// offsets come back as integer corrections (Q4_0 −8·Σx, Q5_0 −16·Σx, Q6_K −32 and Q3_K −4 per
// half block: prepare_quant).
// Q8_0's signed quants and IQ4_NL's signed levels (a vpshufb of the nibbles) take the sign trick
// |w| · (x·sign(w)) (at most 2·128·127 per pair),
// widened per vector. fp32 part per block: acc = fma(float(dot), a0·d_x, acc), then
// fma(m, s_x, acc) for the types with a minimum (Q3_K, Q6_K: the two halves with their own scales).
template <DType D>
struct Pk8 : QuantTraits<D> {
  using T = QuantTraits<D>;
  static constexpr DType kType = D;
  static constexpr bool kQ8 = D == DType::Q8_0;
  /// Signed quant vectors, multiplied by the sign trick: Q8_0's bytes, IQ4_NL's levels.
  static constexpr bool kSigned = kQ8 || D == DType::IQ4_NL;
  static constexpr bool kSuper = D == DType::Q2_K || D == DType::Q3_K || D == DType::Q4_K || D == DType::Q5_K || D == DType::Q6_K;
  static constexpr bool kMin = D == DType::Q4_1 || D == DType::Q5_1 || D == DType::Q4_K || D == DType::Q5_K;
  static constexpr bool kCorr = D == DType::Q4_0 || D == DType::Q5_0;  // a whole-block integer correction
  // vectors summed in int16 (the two-scale types at most a half block: 4)
  static constexpr int G = D == DType::Q6_K ? 2 : T::kHighBits || T::kTwoScales ? 4 : 8;
  static constexpr size_t QB = kQ8 ? 256 : 32 * size_t(T::kLowBits), HB = 32 * size_t(T::kHighBits);
  static constexpr size_t SB = D == DType::Q4_1 || D == DType::Q5_1 ? 32 : 16;
  static constexpr size_t BLOCK = QB + HB + SB;
  static constexpr size_t HDR = !kSuper ? 0 : T::kTwoScales && !T::kHalfMins ? 16 : 32;
  static size_t panel_bytes(int64_t K) { return size_t(K / QK) * BLOCK + size_t(K / QK / 8) * HDR; }
  // Two panels (16 rows, the matmul's unit of work) rounded up to 64 bytes.
  static size_t pair_bytes(int64_t K) { return (2 * panel_bytes(K) + 63) / 64 * 64; }
};

size_t packed_bytes(DType type, int64_t rows, int64_t cols) {
  if (!is_quantized(type)) return 0;
  return with_layout<Pk8>(type, [&](auto pk) { return size_t((rows + 15) / 16) * pk.pair_bytes(cols); });
}

// Row i (of 8) of block b of a row at its places in a packed block (q, hb, sc), from the file's
// bytes (Q8_0) or the decoded block (formats/quant.h decode_quant_block).
template <DType D>
void pack_block8(const uint8_t* row, int64_t b, int i, uint8_t* q, uint8_t* hb, uint8_t* sc) {
  using P = Pk8<D>;
  if constexpr (P::kSigned) {  // the file's bytes: Q8_0's quants, IQ4_NL's nibbles (byte 4j + k: u_j's and u_{4+j}'s quant k)
    const uint8_t* blk = row + size_t(b) * block_size<D>();
    for (size_t j = 0; j < P::QB / 32; ++j) std::memcpy(q + 32 * j + 4 * size_t(i), blk + 2 + 4 * j, 4);
    std::memcpy(sc + 2 * i, blk, 2);
    return;
  }
  QuantBlock qb;
  decode_quant_block(D, row, b, qb);
  if constexpr (P::kLowBits == 2) {
    pack_crumbs<D>(qb, i, 32, q, hb);
    crumb_half_scales<D>(row, b, sc[i], sc[8 + i]);
    return;
  }
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) {
      const int lo = qb.q[4 * j + k], hi = qb.q[16 + 4 * j + k], at = 4 * i + k;
      q[32 * j + at] = uint8_t((lo & 15) | (hi & 15) << 4);
      if constexpr (P::kHighBits == 1) hb[at] = uint8_t(hb[at] | ((lo >> 4) & 1) << j | ((hi >> 4) & 1) << (4 + j));
      if constexpr (P::kHighBits == 2) {
        hb[at] = uint8_t(hb[at] | ((lo >> 4) & 3) << (2 * j));
        hb[32 + at] = uint8_t(hb[32 + at] | ((hi >> 4) & 3) << (2 * j));
      }
    }
  if constexpr (D == DType::Q4_0 || D == DType::Q4_1 || D == DType::Q5_0 || D == DType::Q5_1) {
    const uint8_t* blk = row + size_t(b) * dtype_info(D).block_bytes;
    std::memcpy(sc + 2 * i, blk, 2);                                    // d
    if constexpr (P::kMin) std::memcpy(sc + 16 + 2 * i, blk + 2, 2);  // m
  } else if constexpr (D == DType::Q6_K) {
    const auto* scales = reinterpret_cast<const int8_t*>(row + size_t(b / 8) * sizeof(BlockQ6_K) + 192);
    sc[i] = uint8_t(scales[2 * (b % 8)]), sc[8 + i] = uint8_t(scales[2 * (b % 8) + 1]);
  } else {
    int s, m;
    k_quant_scale_min(int(b % 8), row + size_t(b / 8) * dtype_info(D).block_bytes + 4, &s, &m);
    sc[i] = uint8_t(s), sc[8 + i] = uint8_t(m);
  }
}

// The super-block header of row i: d (Q3_K, Q6_K), or d and −dmin (the sign flipped: exact).
template <DType D>
void pack_header8(const uint8_t* row, int64_t s, int i, uint8_t* hdr) {
  if constexpr (D == DType::Q6_K || D == DType::Q3_K) {
    const size_t bytes = dtype_info(D).block_bytes;
    std::memcpy(hdr + 2 * i, row + size_t(s) * bytes + bytes - 2, 2);  // d is their last field
  } else {
    const uint8_t* sb = row + size_t(s) * dtype_info(D).block_bytes + (D == DType::Q2_K ? 80 : 0);  // d, dmin
    std::memcpy(hdr + 2 * i, sb, 2);
    const uint16_t neg_min = uint16_t(load_u16(sb + 2) ^ 0x8000u);
    std::memcpy(hdr + 16 + 2 * i, &neg_min, 2);
  }
}

// Rows 8p .. 8p+7 of w as one packed panel at out (Pk8::panel_bytes; rows past the matrix zero).
template <DType D>
void pack_panel8(const Weight& w, int64_t p, uint8_t* out) {
  using P = Pk8<D>;
  const int64_t nb = w.cols / QK, nrows = std::min<int64_t>(8, w.rows - p * 8);
  std::memset(out, 0, P::panel_bytes(w.cols));  // padding rows; high bits are OR-ed
  for (int i = 0; i < nrows; ++i) {
    const uint8_t* row = w.row(p * 8 + i);
    uint8_t* o = out;
    for (int64_t b = 0; b < nb; ++b) {
      if constexpr (P::kSuper)
        if (b % 8 == 0) pack_header8<D>(row, b / 8, i, o), o += P::HDR;
      pack_block8<D>(row, b, i, o, o + P::QB, o + P::QB + P::HB);
      o += P::BLOCK;
    }
  }
}

void pack_quant(const Weight& w, uint8_t* out) {
  if (!is_quantized(w.type)) return;
  with_layout<Pk8>(w.type, [&](auto pk) {
    constexpr DType D = decltype(pk)::kType;
    const size_t pb = pk.panel_bytes(w.cols), pair = pk.pair_bytes(w.cols);
    for (int64_t p = 0; p < (w.rows + 15) / 16 * 2; ++p) pack_panel8<D>(w, p, out + size_t(p / 2) * pair + size_t(p % 2) * pb);
    if (pair > 2 * pb)
      for (int64_t u = 0; u < (w.rows + 15) / 16; ++u) std::memset(out + size_t(u) * pair + 2 * pb, 0, pair - 2 * pb);
    return 0;
  });
}

template <int N, class F>
inline void static_for(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(std::make_integer_sequence<int, N>{});
}

inline __m256i loadu256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <bool Signed>
inline __m256 bytes8_ps(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// Quant vector u_J of a packed block (q: its quants, hb: its high bits).
template <DType D, int J>
inline __m256i quant_vec(const uint8_t* q, const uint8_t* hb) {
  using P = Pk8<D>;
  if constexpr (P::kQ8) {
    return loadu256(q + 32 * J);
  } else if constexpr (P::kLowBits == 2) {  // crumbs at bits 2(J/2) of vector J%2; Q3_K: bit J of hb to bit 2
    const __m256i u = _mm256_and_si256(_mm256_srli_epi16(loadu256(q + 32 * (J % 2)), 2 * (J / 2)), _mm256_set1_epi8(3));
    if constexpr (P::kHighBits == 0) return u;
    const __m256i h = _mm256_and_si256(loadu256(hb), _mm256_set1_epi8(char(1 << J)));
    return _mm256_or_si256(u, J <= 2 ? _mm256_slli_epi16(h, 2 - J) : _mm256_srli_epi16(h, J - 2));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i v = loadu256(q + 32 * (J % 4));
    __m256i u = J < 4 ? _mm256_and_si256(v, low4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (D == DType::IQ4_NL)  // the signed level of each nibble
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues))), u);
    if constexpr (P::kHighBits == 1) {  // bit J of the byte to bit 4
      const __m256i h = _mm256_and_si256(loadu256(hb), _mm256_set1_epi8(char(1 << J)));
      u = _mm256_or_si256(u, J <= 4 ? _mm256_slli_epi16(h, 4 - J) : _mm256_srli_epi16(h, J - 4));
    } else if constexpr (P::kHighBits == 2) {  // bits 2(J%4), 2(J%4)+1 to bits 4, 5
      constexpr int s = 2 * (J % 4);
      const __m256i h = _mm256_and_si256(loadu256(hb + 32 * (J / 4)), _mm256_set1_epi8(char(3 << s)));
      u = _mm256_or_si256(u, s <= 4 ? _mm256_slli_epi16(h, 4 - s) : _mm256_srli_epi16(h, s - 4));
    }
    return u;
  }
}

// The block's fp32 scales of the 8 rows: a0 (two-scale types: first half) and a1 (the minimum
// term's factor m or −m, or the second half's scale); Q2_K's −dmin·m of each half in m0, m1.
struct Scales8 {
  __m256 a0, a1, m0, m1;
};
// The low (H = 0) or high nibbles of 8 bytes as fp32.
template <int H>
inline __m256 nibbles8_ps(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(H ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
}
// dsup/msup: the super-block's d and −dmin.
template <DType D>
inline Scales8 block_scales(const uint8_t* sc, __m256 dsup, __m256 msup) {
  Scales8 s{};
  if constexpr (D == DType::Q2_K) {
    s.a0 = _mm256_mul_ps(dsup, nibbles8_ps<0>(sc)), s.a1 = _mm256_mul_ps(dsup, nibbles8_ps<0>(sc + 8));
    s.m0 = _mm256_mul_ps(msup, nibbles8_ps<1>(sc)), s.m1 = _mm256_mul_ps(msup, nibbles8_ps<1>(sc + 8));
  } else if constexpr (D == DType::Q4_K || D == DType::Q5_K) {
    s.a0 = _mm256_mul_ps(dsup, bytes8_ps<false>(sc)), s.a1 = _mm256_mul_ps(msup, bytes8_ps<false>(sc + 8));
  } else if constexpr (Pk8<D>::kTwoScales) {
    s.a0 = _mm256_mul_ps(dsup, bytes8_ps<true>(sc)), s.a1 = _mm256_mul_ps(dsup, bytes8_ps<true>(sc + 8));
  } else {
    s.a0 = f16x8(sc);
    if constexpr (Pk8<D>::kMin) s.a1 = f16x8(sc + 16);
  }
  return s;
}

// One token's fp32 step for a block of 8 rows: lo (two-scale types: first half, hi the second)
// are the exact integer dots without the offset correction `corr` (prepare_quant's, of this token
// and block); acc += float(dot) · a0·d_x (+ a1·s_x for the types with a minimum; Q2_K: + m_h ·
// d_x·Σ_h q_x per half, the half sums from corr).
template <DType D>
inline __m256 block_fp(__m256 acc, __m256i lo, __m256i hi, const Scales8& s, const BlockQ8Act& xa, int32_t corr) {
  const __m256 dx = _mm256_set1_ps(xa.d), a0 = s.a0, a1 = s.a1;
  if constexpr (Pk8<D>::kTwoScales) {
    const auto k = uint32_t(corr);
    const int32_t sum_lo = int16_t(k & 0xffffu), sum_hi = int16_t(k >> 16);
    constexpr int32_t o = Pk8<D>::kHalfOffset;
    if constexpr (o != 0) {
      lo = _mm256_add_epi32(lo, _mm256_set1_epi32(-o * sum_lo));
      hi = _mm256_add_epi32(hi, _mm256_set1_epi32(-o * sum_hi));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(a0, dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(a1, dx), acc);
    if constexpr (Pk8<D>::kHalfMins) {
      acc = _mm256_fmadd_ps(s.m0, _mm256_set1_ps(xa.d * float(sum_lo)), acc);
      acc = _mm256_fmadd_ps(s.m1, _mm256_set1_ps(xa.d * float(sum_hi)), acc);
    }
    return acc;
  }
  if constexpr (Pk8<D>::kCorr) lo = _mm256_add_epi32(lo, _mm256_set1_epi32(corr));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(a0, dx), acc);
  if constexpr (Pk8<D>::kMin) acc = _mm256_fmadd_ps(a1, _mm256_set1_ps(xa.s), acc);
  return acc;
}

inline __m256i bcast4(const int8_t* x) { return _mm256_set1_epi32(int(load_u32(x))); }

// The integer dots of C tokens (x[c]: a token's 32 quantized activations of the block) with the
// block's quant vectors vec(J), J = 0..7: int16 sums over groups of G vectors, widened and added
// (Q8_0: the sign trick, widened per vector). lo/hi as block_fp's.
template <DType D, int C, class V>
inline void block_dots(const V& vec, const int8_t* const* x, __m256i* lo, __m256i* hi) {
  using P = Pk8<D>;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (P::kSigned) {  // sign trick, widened per vector
    for (int c = 0; c < C; ++c) lo[c] = _mm256_setzero_si256();
    static_for<8>([&](auto J) {
      const __m256i w = vec(J), aw = _mm256_sign_epi8(w, w);
      for (int c = 0; c < C; ++c)
        lo[c] = _mm256_add_epi32(lo[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(x[c] + 4 * J), w)), ones));
    });
    return;
  }
  static_for<8 / P::G>([&](auto g) {
    constexpr int J0 = decltype(g)::value * P::G;
    __m256i s16[C];
    for (int c = 0; c < C; ++c) s16[c] = _mm256_setzero_si256();
    static_for<P::G>([&](auto jj) {
      const __m256i u = vec(std::integral_constant<int, J0 + decltype(jj)::value>{});
      for (int c = 0; c < C; ++c) s16[c] = _mm256_add_epi16(s16[c], _mm256_maddubs_epi16(u, bcast4(x[c] + 4 * (J0 + decltype(jj)::value))));
    });
    __m256i* dst = P::kTwoScales && J0 >= 4 ? hi : lo;  // Q3_K/Q6_K: vectors 0-3 are the first half
    for (int c = 0; c < C; ++c) {
      const __m256i w32 = _mm256_madd_epi16(s16[c], ones);
      dst[c] = J0 == 0 || (P::kTwoScales && J0 == 4) ? w32 : _mm256_add_epi32(dst[c], w32);
    }
  });
}

// Prefill: from this many tokens, the quant vectors of a panel (not Q8_0's: those are loads
// already) are decoded once per call into the thread's scratch, [nb][8] vectors (expand_panel8),
// and the tiles take one token at a time from there (decoding in registers for every tile of
// 4 tokens cost 16% of SmolLM2's Q4_1 prefill, Zen 4 at the AVX2 level). Same integers, so the
// same bits.
constexpr int64_t kExpandMinT = 8;

template <DType D>
void expand_panel8(const uint8_t* panel, int64_t nb, uint8_t* out) {
  using P = Pk8<D>;
  const uint8_t* p = panel;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (P::kSuper)
      if (b % 8 == 0) p += P::HDR;
    static_for<8>([&](auto J) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + size_t(b) * 256 + 32 * J), quant_vec<D, J>(p, p + P::QB));
    });
    p += P::BLOCK;
  }
}

// 8 packed rows × C tokens (xq, corr: [C][nb]); outputs y[c·M + i] for the first nrows rows.
// A block's 8 quant vectors (decoded here, or expand_panel8's from ex) stay in registers while a
// rolled loop takes the tokens one after another: unrolled, GCC interleaved the 4 tokens' 32
// products and spilled them (prefill −25%). Q8_0 takes the C tokens together per vector.
template <DType D, int C>
void tile8(float* y, int64_t M, const uint8_t* panel, int64_t nb, const BlockQ8Act* xq, const int32_t* corr, int nrows,
           const uint8_t* ex = nullptr) {
  using P = Pk8<D>;
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  __m256 dsup = _mm256_setzero_ps(), msup = _mm256_setzero_ps();
  const uint8_t* p = panel;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (P::kSuper)
      if (b % 8 == 0) {
        dsup = f16x8(p);
        if constexpr (P::kMin || P::kHalfMins) msup = f16x8(p + 16);
        p += P::HDR;
      }
    const uint8_t *q = p, *hb = p + P::QB;
    const Scales8 sc = block_scales<D>(hb + P::HB, dsup, msup);
    p += P::BLOCK;
    if constexpr (P::kSigned) {  // C tokens at once
      __m256i lo[C], hi[C] = {};
      const int8_t* x[C];
      for (int c = 0; c < C; ++c) x[c] = xq[c * nb + b].qs;
      block_dots<D, C>([&](auto J) { return quant_vec<D, decltype(J)::value>(q, hb); }, x, lo, hi);
      for (int c = 0; c < C; ++c) acc[c] = block_fp<D>(acc[c], lo[c], hi[c], sc, xq[c * nb + b], corr[c * nb + b]);
      continue;
    }
    __m256i u[8];  // the block's 8 quant vectors in registers, then token after token
    if (ex) static_for<8>([&](auto J) { u[J] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ex + size_t(b) * 256) + J); });
    else static_for<8>([&](auto J) { u[J] = quant_vec<D, J>(q, hb); });
#pragma GCC unroll 1
    for (int c = 0; c < C; ++c) {
      const int8_t* x = xq[c * nb + b].qs;
      __m256i l, h = _mm256_setzero_si256();
      block_dots<D, 1>([&](auto J) { return u[J]; }, &x, &l, &h);
      acc[c] = block_fp<D>(acc[c], l, h, sc, xq[c * nb + b], corr[c * nb + b]);
    }
  }
  store_rows8<C>(y, M, acc, nrows);
}

// Where the expanded quant vectors start in the thread scratch (after a panel, 64-aligned).
inline size_t expand_offset(size_t panel_bytes) { return (panel_bytes + 63) / 64 * 64; }

// Rows [r0, r1) (r0 a multiple of 16), all T tokens, 4 per tile. A weight that was not packed
// at load (tests, LLMQ_PACK=0, a row slice not starting on a panel) has each panel packed into
// the thread's scratch first: the same tiles, so the same bits.
template <DType D>
void packed_matmul8(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  using P = Pk8<D>;
  const int64_t M = w.rows, T = a.T, nb = a.nb;
  const size_t pb = P::panel_bytes(w.cols), pair = P::pair_bytes(w.cols);
  for (int64_t r = r0; r < r1; r += 8) {
    const int64_t p = r / 8;
    const uint8_t* panel = w.packed + size_t(p / 2) * pair + size_t(p % 2) * pb;
    if (!w.packed) pack_panel8<D>(w, p, scratch), panel = scratch;
    const int nrows = int(std::min<int64_t>(8, r1 - r));
    uint8_t* ex = nullptr;
    if (!P::kSigned && T >= kExpandMinT) expand_panel8<D>(panel, nb, ex = scratch + expand_offset(pb));
    const auto tile = [&](auto cc, int64_t t) {
      tile8<D, decltype(cc)::value>(y + t * M + r, M, panel, nb, a.xq + t * nb, a.corr + t * nb, nrows, ex);
    };
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) tile(std::integral_constant<int, 4>{}, t);
    switch (T - t) {
      case 3: tile(std::integral_constant<int, 3>{}, t); break;
      case 2: tile(std::integral_constant<int, 2>{}, t); break;
      case 1: tile(std::integral_constant<int, 1>{}, t); break;
      default: break;
    }
  }
}

// The AVX2 int8 peak: 12 chains of vpmaddubsw + vpaddw (the pair the tiles are built on), two
// per chain and round: 24 · 32 = 12 · 64 byte products per round, as the AVX-512 loop's.
int64_t int8_dot_loop(int64_t rounds) {
  __m256i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi16(short(i));
  __m256i u = _mm256_set1_epi32(0x01020304), v = _mm256_set1_epi32(0x05060708);
  for (int64_t r = 0; r < rounds; ++r) {
    asm volatile("" : "+x"(u), "+x"(v));
    for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(u, v));
    for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(v, u));
  }
  __m256i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_epi16(s, a[i]);
  return _mm_cvtsi128_si32(_mm256_castsi256_si128(s));
}

size_t prep_bytes(DType, int64_t, int64_t) { return 0; }
void prepare_quant(DType type, const QuantActs& a, const int32_t* sums, int64_t t0, int64_t t1, int32_t* corr, uint8_t*) {
  if (has_half_corr(type)) fill_corr_halves(a.xq + t0 * a.nb, (t1 - t0) * a.nb, corr + t0 * a.nb);
  else fill_corr(type, sums + t0 * a.nb, (t1 - t0) * a.nb, corr + t0 * a.nb);
}
// Scratch: one panel, for weights that were not packed at load, then (prefill) its expanded
// quant vectors.
size_t thread_bytes(DType type, int64_t T, int64_t K) {
  return with_layout<Pk8>(type, [&](auto pk) {
    return expand_offset(pk.panel_bytes(K)) + (!pk.kSigned && T >= kExpandMinT ? size_t(K / QK) * 256 : 0);
  });
}

void matmul_quant(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  with_layout<Pk8>(w.type, [&](auto pk) {
    packed_matmul8<decltype(pk)::kType>(y, a, w, r0, r1, scratch);
    return 0;
  });
}

// Keys transposed ([hd, bt]): 8 positions per vector, four partial sums over j mod 4 per head.
void attn_scores(float* s, int64_t ss, const float* q, int64_t G, const float* kT, int64_t n, int64_t bt, int64_t hd,
                 float scale) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * hd;
    for (int64_t p0 = 0; p0 < n; p0 += 8) {
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(8, n - p0))), lane);
      __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      int64_t j = 0;
      for (; j + 4 <= hd; j += 4)
        for (int u = 0; u < 4; ++u)
          a[u] = _mm256_fmadd_ps(_mm256_set1_ps(qg[j + u]), _mm256_maskload_ps(kT + (j + u) * bt + p0, m), a[u]);
      for (int u = 0; u < 3; ++u)
        if (j + u < hd) a[u] = _mm256_fmadd_ps(_mm256_set1_ps(qg[j + u]), _mm256_maskload_ps(kT + (j + u) * bt + p0, m), a[u]);
      const __m256 r = _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])), _mm256_set1_ps(scale));
      _mm256_maskstore_ps(s + g * ss + p0, m, r);
    }
  }
}

void attn_accumulate(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride,
                     int64_t hd) {
  for (int64_t g = 0; g < G; ++g, out += hd, a += as) {
    int64_t j = 0;
    for (; j + 8 <= hd; j += 8) {
      __m256 o = _mm256_loadu_ps(out + j);
      for (int64_t p = 0; p < n; ++p) o = _mm256_fmadd_ps(_mm256_set1_ps(a[p]), _mm256_loadu_ps(v + p * stride + j), o);
      _mm256_storeu_ps(out + j, o);
    }
    for (; j < hd; ++j)
      for (int64_t p = 0; p < n; ++p) out[j] = std::fma(a[p], v[p * stride + j], out[j]);
  }
}

// bf16 KV blocks (layouts in cpu_ops.h) without `vdpbf16ps`: a 32-bit lane holds a pair, its low
// half widens to fp32 by a 16-bit shift and its high half by masking, then two FMAs. Also what
// the AVX-512 level uses on CPUs without AVX512_BF16.
inline __m256 bf16_lo(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 bf16_hi(__m256i pairs) { return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u)))); }

void attn_scores_bf16(float* s, int64_t ss, const uint16_t* q, int64_t G, const uint16_t* k, int64_t n, int64_t bt,
                      int64_t hd, float scale) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = q + g * hd;
    for (int64_t p0 = 0; p0 < n; p0 += 8) {
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(8, n - p0))), lane);
      __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t i = 0; i < hd / 2; i += 2)
        for (int u = 0; u < 2 && i + u < hd / 2; ++u) {
          const __m256i kv = _mm256_maskload_epi32(reinterpret_cast<const int*>(k + ((i + u) * bt + p0) * 2), m);
          a[u] = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_fp32(qg[2 * (i + u)])), bf16_lo(kv), a[u]);
          a[u] = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_fp32(qg[2 * (i + u) + 1])), bf16_hi(kv), a[u]);
        }
      _mm256_maskstore_ps(s + g * ss + p0, m, _mm256_mul_ps(_mm256_add_ps(a[0], a[1]), _mm256_set1_ps(scale)));
    }
  }
}

void attn_accumulate_bf16(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n, int64_t hd) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < hd; j += 8) {
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(8, hd - j))), lane);
      __m256 o = _mm256_maskload_ps(out + g * hd + j, m);
      for (int64_t pp = 0; pp < (n + 1) / 2; ++pp) {
        const __m256i vv = _mm256_maskload_epi32(reinterpret_cast<const int*>(v + (pp * hd + j) * 2), m);
        o = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_fp32(a[g * as + 2 * pp])), bf16_lo(vv), o);
        o = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_fp32(a[g * as + 2 * pp + 1])), bf16_hi(vv), o);
      }
      _mm256_maskstore_ps(out + g * hd + j, m, o);
    }
}

}  // namespace
}  // namespace avx2

LLMQ_TARGET_END

// =====================================================================================
// AVX-512 F/BW/VL/DQ + VNNI
// =====================================================================================
LLMQ_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace avx512 {
namespace {

inline float hsum(__m512 v) {
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// max |x| over n values (n a multiple of 16).
float absmax(const float* x, int64_t n) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) a = _mm512_max_ps(a, _mm512_and_ps(_mm512_loadu_ps(x + i), absmask));
  return _mm512_reduce_max_ps(a);
}

void quantize_act(const float* x, BlockQ8Act* out, int32_t* sums, int64_t n, int group) {
  ActScale sc{};
  for (int64_t b = 0; b < n / QK; ++b, x += QK) {
    if (b % (group / QK) == 0) sc = act_scale(absmax(x, group), group);
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 idv = _mm512_set1_ps(sc.id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));  // round to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs + 16), _mm512_cvtsepi32_epi8(q1));
    // The sum of the int8 values as stored (saturated): equal to q0 + q1 for finite inputs, and
    // no int32 overflow when NaN/Inf activations turn into INT_MIN (UBSan, fuzz/llmq_file).
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    const __m512i s0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi), s1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
    out[b].d = sc.d;
    out[b].s = sc.d * float(sum);
    if (sums) sums[b] = sum;
  }
}

// ---- The vector type of the shared float kernels (x86_float.inc): 16 fp32 lanes.

struct Vec {
  using F = __m512;
  static constexpr int N = 16;
  static constexpr int kTileRows = 4, kTileTokens = 6;  // 24 accumulators + 4 weights + 1 activation of 32 registers
  static __mmask16 first(int n) { return __mmask16((1u << n) - 1); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_part(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_part(float* p, F v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static F keep_first(F v, int n) { return _mm512_maskz_mov_ps(first(n), v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static float hsum(F v) { return avx512::hsum(v); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static F widen(__m256i h, DType d) {  // 16 F16 or BF16 values to fp32
    return d == DType::F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  template <DType D>
  static F load_w(const uint8_t* row, int64_t k) {
    if constexpr (D == DType::F32) {
      // two 256-bit loads: streams from DRAM faster than one 512-bit load on Zen 4 (dev/cpu)
      const float* p = reinterpret_cast<const float*>(row) + k;
      return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 8), 1);
    } else {
      return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)), D);
    }
  }
  template <DType D>
  static F load_w_part(const uint8_t* row, int64_t k, int n) {
    if constexpr (D == DType::F32) return load_part(reinterpret_cast<const float*>(row) + k, n);
    else return widen(_mm256_maskz_loadu_epi16(first(n), row + 2 * k), D);
  }
  // e^x: 2^n by vscalefps, which gives +inf / 0 on overflow / underflow; the clamp only keeps r finite.
  static constexpr float kExpLo = -200.0f, kExpHi = 200.0f;
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2n(F p, F n) { return _mm512_scalef_ps(p, n); }
};

#include "engine/cpu/x86_float.inc"

// ---- Q8_0 / Q4_0 / Q4_1

// The GEMM's tiles of kTile tokens read their activations from `prep`, rearranged so that one
// pointer reaches all of them: per tile and block, the kTile tokens' BlockQ8Act, then their
// integer corrections (kTileBlockBytes). The tokens past the last whole tile (and decode) read
// xq and corr as they are.
constexpr int kTile = 8;
constexpr size_t kTileBlockBytes = kTile * sizeof(BlockQ8Act) + kTile * sizeof(int32_t);

size_t prep_bytes(DType, int64_t T, int64_t K) {
  return size_t(T / kTile) * size_t(K / QK) * kTileBlockBytes;
}

void prepare_quant(DType type, const QuantActs& a, const int32_t* sums, int64_t t0, int64_t t1, int32_t* corr,
                   uint8_t* prep) {
  const int64_t nb = a.nb, tiled = a.T / kTile * kTile;
  if (has_half_corr(type)) fill_corr_halves(a.xq + t0 * nb, (t1 - t0) * nb, corr + t0 * nb);
  else fill_corr(type, sums + t0 * nb, (t1 - t0) * nb, corr + t0 * nb);
  for (int64_t t = t0; t < std::min(t1, tiled); ++t) {
    uint8_t* tile = prep + size_t(t / kTile) * size_t(nb) * kTileBlockBytes;
    const size_t c = size_t(t % kTile);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* tb = tile + size_t(b) * kTileBlockBytes;
      std::memcpy(tb + c * sizeof(BlockQ8Act), a.xq + t * nb + b, sizeof(BlockQ8Act));
      std::memcpy(tb + kTile * sizeof(BlockQ8Act) + c * sizeof(int32_t), corr + t * nb + b, sizeof(int32_t));
    }
  }
}

// ---- Packed weights (Weight::packed): the GEMM's panels built once at load, nibbles kept packed.
//
// Panels of 16 rows, one after the other (rows past the matrix: zero quants and scales). A
// panel holds its 32-weight blocks in pairs (b0, b1; an odd last block pairs with zeros):
//   [quants b0 | quants b1 | high bits b0 | high bits b1 | scales b0 | scales b1]
// quants of a block, lanes = the 16 rows, 64 bytes per vector:
//   Q8_0:   8 vectors; vector j, lane r = quants 4j..4j+3 of row r, stored as w + 128.
//   others: 4 vectors; vector j, lane r holds in its low nibbles the low 4 bits of elements
//           4j..4j+3 of row r, in its high nibbles those of elements 16+4j..16+4j+3 (for Q4_0,
//           Q4_1 and IQ4_NL these are the file's quant bytes 4j..4j+3; IQ4_NL's become their
//           level + 128 by a vpshufb).
//   Q2_K, Q3_K: 2 vectors of 2-bit crumbs; u_J (the elements 4J..4J+3 of each row, J = 0..7) at
//           bits 2(J/2) of vector J%2.
// high bits (formats/quant.h's QuantBlock q ≥ 16, Q3_K's q ≥ 4): one 64-byte bit plane per
//   bit, byte 4r+k holding in bit J that bit of the element in byte k of lane r of quant vector
//   u_J (J = 0..3 the low nibbles of vectors 0..3, 4..7 their high nibbles): Q5_0/Q5_1/Q5_K
//   the plane of bit 4 (64 bytes); Q6_K that of bit 4, then of bit 5 (128 bytes); Q3_K bit 2.
// scales of the 16 rows: Q8_0/Q4_0/Q5_0/IQ4_NL d as fp16 (32 bytes); Q4_1/Q5_1 d, then m, as fp16
//   (64); Q4_K/Q5_K a = d·sc, then the added minimum −dmin·m, as fp32 (128; both exact
//   products of the file's fields); Q6_K the two half-block scales d·sc as fp32 (128); Q3_K
//   the two halves' s − 32 as int8, then the super-block's d as fp16 (64; multiplied per block);
//   Q2_K the file's scale bytes (sc | m << 4) of the two halves, then d and −dmin as fp16 (96).
// A pair is a multiple of 64 bytes, so every load is aligned: Q4_0 576 (= 16 rows × 2 blocks
// × 18: the file's bytes; IQ4_NL the same), Q4_1 640, Q5_0 704 (the file's), Q5_1 768, Q8_0 1088, Q2_K 448
// (file: 336), Q3_K 512 (440), Q4_K 768 and Q5_K 896 (the file's 576 and 704 plus the scales
// widened to fp32), Q6_K 1024 (file: 840).
// One panel is one sequential stream, which decode reads at the DRAM bandwidth (16 rows read in
// place, 16 streams, lost up to half of it: dev/README.md #5, #14); prefill reuses
// each panel (up to 27 KiB for K = 1536 at Q4_0) from L1/L2 for every tile of 8 tokens.
template <DType D>
struct Pk : QuantTraits<D> {
  using T = QuantTraits<D>;
  static constexpr DType kType = D;
  static constexpr bool kF32Scales = D == DType::Q4_K || D == DType::Q5_K || D == DType::Q6_K;
  static constexpr bool kMin = D == DType::Q4_1 || D == DType::Q5_1 || D == DType::Q4_K || D == DType::Q5_K;
  static constexpr size_t QB = D == DType::Q8_0 ? 512 : 64 * size_t(T::kLowBits);
  static constexpr size_t HB = 64 * size_t(T::kHighBits);
  static constexpr size_t SB = kF32Scales ? 128 : D == DType::Q2_K ? 96 : kMin || D == DType::Q3_K ? 64 : 32;
  static constexpr size_t PAIR = 2 * (QB + HB + SB);
  static size_t panel_bytes(int64_t K) { return size_t((K / QK + 1) / 2) * PAIR; }
};

size_t packed_bytes(DType type, int64_t rows, int64_t cols) {
  if (!is_quantized(type)) return 0;
  return with_layout<Pk>(type, [&](auto pk) { return size_t((rows + 15) / 16) * pk.panel_bytes(cols); });
}

// Block b of row i (of 16) at its place in a panel: Q8_0/Q4_0/Q4_1 byte copies of the file.
template <DType D>
void pack_block_bytes(const uint8_t* blk, int i, uint8_t* q, uint8_t* sc) {
  constexpr size_t off = quant_offset<D>();
  for (size_t j = 0; j < Pk<D>::QB / 64; ++j)
    for (int k = 0; k < 4; ++k) {
      const uint8_t v = blk[off + 4 * j + size_t(k)];
      q[64 * j + 4 * size_t(i) + size_t(k)] = D == DType::Q8_0 ? uint8_t(v ^ 0x80) : v;
    }
  std::memcpy(sc + 2 * i, blk, 2);                                           // d
  if constexpr (D == DType::Q4_1) std::memcpy(sc + 32 + 2 * i, blk + 2, 2);  // m
}

// Q2_K's and Q3_K's block b of row i: crumbs (and Q3_K's bit plane) from the decoded block, the
// half-block scale bytes, then the super-block's d (and Q2_K's −dmin) beside them.
template <DType D>
void pack_block_crumbs(const uint8_t* row, int64_t b, const QuantBlock& qb, int i, uint8_t* q, uint8_t* hb, uint8_t* sc) {
  pack_crumbs<D>(qb, i, 64, q, hb);
  crumb_half_scales<D>(row, b, sc[i], sc[16 + i]);
  const uint8_t* blk = row + size_t(b / 8) * dtype_info(D).block_bytes;
  std::memcpy(sc + 32 + 2 * i, blk + (D == DType::Q3_K ? 108 : 80), 2);
  if constexpr (D == DType::Q2_K) {
    const uint16_t neg_min = uint16_t(load_u16(blk + 82) ^ 0x8000u);
    std::memcpy(sc + 64 + 2 * i, &neg_min, 2);
  }
}

// The other types from their decoded block (formats/quant.h decode_quant_block).
template <DType D>
void pack_block_decoded(const QuantBlock& qb, int i, uint8_t* q, uint8_t* hb, uint8_t* sc) {
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) {
      const uint8_t lo = qb.q[4 * j + k], hi = qb.q[16 + 4 * j + k];
      const int at = 4 * i + k;
      q[64 * j + at] = uint8_t((lo & 15) | (hi & 15) << 4);
      for (int h = 0; h < Pk<D>::kHighBits; ++h)  // bit plane h: bit J of byte `at` for vector J
        hb[64 * h + at] = uint8_t(hb[64 * h + at] | ((lo >> (4 + h)) & 1) << j | ((hi >> (4 + h)) & 1) << (4 + j));
    }
  if constexpr (Pk<D>::kF32Scales) {
    auto* f = reinterpret_cast<float*>(sc);
    f[i] = qb.a[0];
    f[16 + i] = Pk<D>::kTwoScales ? qb.a[1] : -qb.m[0];
  } else {
    const uint16_t d = fp32_to_fp16(qb.a[0]), m = fp32_to_fp16(-qb.m[0]);  // exact: they were fp16
    std::memcpy(sc + 2 * i, &d, 2);
    if constexpr (Pk<D>::kMin) std::memcpy(sc + 32 + 2 * i, &m, 2);
  }
}

// Rows 16p .. 16p+15 of w as one packed panel at out (Pk::panel_bytes; rows past the matrix zero).
template <DType D>
void pack_panel(const Weight& w, int64_t p, uint8_t* out) {
  using P = Pk<D>;
  const int64_t nb = w.cols / QK, nrows = std::min<int64_t>(16, w.rows - p * 16);
  if (nrows < 16 || nb % 2 || P::kHighBits || P::kLowBits == 2) std::memset(out, 0, P::panel_bytes(w.cols));  // padding; bit planes are OR-ed
  QuantBlock qb;
  for (int i = 0; i < nrows; ++i) {
    const uint8_t* row = w.row(p * 16 + i);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* pair = out + size_t(b / 2) * P::PAIR;
      uint8_t* q = pair + size_t(b % 2) * P::QB;
      uint8_t* hb = pair + 2 * P::QB + size_t(b % 2) * P::HB;
      uint8_t* sc = pair + 2 * (P::QB + P::HB) + size_t(b % 2) * P::SB;
      if constexpr (D == DType::Q8_0 || D == DType::Q4_0 || D == DType::Q4_1 || D == DType::IQ4_NL) {
        pack_block_bytes<D>(row + size_t(b) * block_size<D>(), i, q, sc);
      } else {
        decode_quant_block(D, row, b, qb);
        if constexpr (P::kLowBits == 2) pack_block_crumbs<D>(row, b, qb, i, q, hb, sc);
        else pack_block_decoded<D>(qb, i, q, hb, sc);
      }
    }
  }
}

void pack_quant(const Weight& w, uint8_t* out) {
  if (!is_quantized(w.type)) return;
  with_layout<Pk>(w.type, [&](auto pk) {
    constexpr DType D = decltype(pk)::kType;
    const size_t panel_bytes = pk.panel_bytes(w.cols);
    for (int64_t p = 0; p < (w.rows + 15) / 16; ++p) pack_panel<D>(w, p, out + size_t(p) * panel_bytes);
    return 0;
  });
}

// Token c's activations of block b: with C = kTile from one tile of prep (xq points at it, corr
// unused; constant offsets from one pointer), with C = 1 from xq and corr as quantized.
template <int C>
inline const BlockQ8Act& tile_act(const BlockQ8Act* xq, int64_t nb, int c, int64_t b) {
  if constexpr (C == kTile)
    return *reinterpret_cast<const BlockQ8Act*>(reinterpret_cast<const uint8_t*>(xq) + size_t(b) * kTileBlockBytes +
                                                size_t(c) * sizeof(BlockQ8Act));
  else
    return xq[c * nb + b];
}
template <int C>
inline int32_t tile_corr(const BlockQ8Act* xq, const int32_t* corr, int64_t nb, int c, int64_t b) {
  if constexpr (C == kTile)
    return *reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(xq) + size_t(b) * kTileBlockBytes +
                                             kTile * sizeof(BlockQ8Act) + size_t(c) * sizeof(int32_t));
  else
    return corr[c * nb + b];
}

// The low (h = 0) or high (h = 1) nibbles of quant vector v, with the high bits of that vector
// (j: its index 0..3) added back from the bit planes (a byte mask by one vptestmb each: the
// planes were stored as 64-bit masks first, and their kmovq loads made Q5_0 decode read 50% of
// the bandwidth where AVX2 read 73%).
template <DType D>
inline __m512i nibbles_with_high_bits(__m512i v, const uint8_t* hb, int j, int h) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bit = _mm512_set1_epi8(char(1 << (4 * h + j)));
  __m512i n = h ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4) : _mm512_and_si512(v, low4);
  if constexpr (Pk<D>::kHighBits > 0) {
    const __mmask64 m4 = _mm512_test_epi8_mask(_mm512_load_si512(hb), bit);
    n = _mm512_mask_add_epi8(n, m4, n, _mm512_set1_epi8(0x10));
  }
  if constexpr (Pk<D>::kHighBits > 1) {
    const __mmask64 m5 = _mm512_test_epi8_mask(_mm512_load_si512(hb + 64), bit);
    n = _mm512_mask_add_epi8(n, m5, n, _mm512_set1_epi8(0x20));
  }
  if constexpr (D == DType::IQ4_NL) {  // the level + 128 of each nibble (corrected by −128·Σx as Q8_0)
    static constexpr auto kLevels = [] {
      std::array<uint8_t, 16> a{};
      for (int i = 0; i < 16; ++i) a[size_t(i)] = uint8_t(kIQ4NLValues[i] + 128);
      return a;
    }();
    n = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevels.data()))), n);
  }
  return n;
}

// Q2_K's and Q3_K's quant vectors u_J and u_{4+j} (J = j) of a block: the crumbs of vector j%2
// at bits 2(j/2) and 2(j/2) + 4; Q3_K's bit 2 added from the bit plane (bits j and 4 + j).
template <DType D>
inline void crumbs_with_high_bit(const uint8_t* q, const uint8_t* hb, int j, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_load_si512(q + 64 * (j % 2)), three = _mm512_set1_epi8(3);
  const unsigned sh = unsigned(2 * (j / 2));
  lo = _mm512_and_si512(_mm512_srli_epi16(v, sh), three);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, sh + 4), three);
  if constexpr (Pk<D>::kHighBits == 1) {
    const __m512i h = _mm512_load_si512(hb), four = _mm512_set1_epi8(4);
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8(char(1 << j))), lo, four);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8(char(1 << (4 + j)))), hi, four);
  }
}

// The integer corrections of a token's block, for the first and second half accumulators:
// Q3_K's and Q6_K's corr holds the two half sums of q_x as int16 (fill_corr_halves), the others
// the whole block's correction.
template <DType D>
inline void block_corr(int32_t c, int32_t& lo, int32_t& hi) {
  if constexpr (Pk<D>::kTwoScales) {
    constexpr int32_t o = Pk<D>::kHalfOffset;
    lo = -o * int32_t(int16_t(uint32_t(c) & 0xffffu)), hi = -o * int32_t(int16_t(uint32_t(c) >> 16));
  } else {
    lo = c, hi = 0;
  }
}

// Integer accumulators per token of packed_tile: with one token, two chains (even and odd quant
// vectors) halve the vpdpbusd dependency chain; with 8 tokens there are 8 chains already (and
// more accumulators would spill). Q6_K keeps its halves apart.
template <DType D, int C>
constexpr int kChains = C >= 4 && !Pk<D>::kTwoScales ? 1 : 2;

// Block b's float scales of 16 packed rows from its scale bytes sc: dw (and dw2, Q6_K's second
// half), mw (and mw2, Q2_K's second half) the minimums' factors; unused ones stay zero.
template <DType D>
inline void block_scales(const uint8_t* sc, __m512& dw, __m512& dw2, __m512& mw, __m512& mw2) {
  using P = Pk<D>;
  if constexpr (P::kF32Scales) {
    dw = _mm512_load_ps(reinterpret_cast<const float*>(sc));
    (P::kTwoScales ? dw2 : mw) = _mm512_load_ps(reinterpret_cast<const float*>(sc + 64));
  } else if constexpr (D == DType::Q2_K) {  // d · sc and −dmin · m: exact in fp32, as decode_quant_block's
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    const __m512 nmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + 64)));
    const __m512i s = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m512i s2 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc + 16)));
    const __m512i low4 = _mm512_set1_epi32(15);
    dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(s, low4)));
    dw2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(s2, low4)));
    mw = _mm512_mul_ps(nmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(s, 4)));
    mw2 = _mm512_mul_ps(nmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(s2, 4)));
  } else if constexpr (D == DType::Q3_K) {  // d · (s − 32): exact in fp32, as decode_quant_block's
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    const __m128i s = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
    const __m128i s2 = _mm_load_si128(reinterpret_cast<const __m128i*>(sc + 16));
    dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
    dw2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s2)));
  } else {
    dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc)));
    if constexpr (P::kMin) mw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + 32)));
  }
}

// acc plus token c's share of block b: its integer dots s (one or two chains, or Q6_K's halves)
// times d_w·d_x, and the minimums' terms (m·s_x; Q2_K's two half minimums times d_x·Σ_h q_x).
template <DType D, int C, int NS>
inline __m512 scale_block(__m512 acc, const __m512i (&s)[NS], __m512 dw, __m512 dw2, __m512 mw, __m512 mw2, const BlockQ8Act* xq,
                          const int32_t* corr, int64_t nb, int c, int64_t b) {
  using P = Pk<D>;
  const BlockQ8Act& xa = tile_act<C>(xq, nb, c, b);
  const __m512 dx = _mm512_set1_ps(xa.d);
  if constexpr (P::kTwoScales) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(dw, dx), acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(dw2, dx), acc);
  } else {
    const __m512i dot = NS > 1 ? _mm512_add_epi32(s[0], s[NS - 1]) : s[0];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc);
  }
  if constexpr (P::kMin) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(xa.s), acc);
  if constexpr (P::kHalfMins) {  // Q2_K: −dmin·m_h · d_x·Σ_h q_x, the half sums from corr
    const auto k = uint32_t(tile_corr<C>(xq, corr, nb, c, b));
    acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(xa.d * float(int16_t(k & 0xffffu))), acc);
    acc = _mm512_fmadd_ps(mw2, _mm512_set1_ps(xa.d * float(int16_t(k >> 16))), acc);
  }
  return acc;
}

// 16 packed rows × C tokens: the integer dot of every block (two accumulators per token, summed
// exactly, or scaled apart for Q6_K's two half-block scales), then acc = fma(float(dot),
// d_w·d_x, acc) (+ fma(m, s_x, acc)) over the blocks in order: the same instructions for an
// output whatever the number of tokens.
template <DType D, int C>
void packed_tile(float* y, int64_t M, const uint8_t* panel, int64_t nb, const BlockQ8Act* xq, const int32_t* corr,
                 __mmask16 rmask) {
  using P = Pk<D>;
  static_assert(C == 1 || C == kTile, "tiles of one token or kTile tokens");
  constexpr int NS = kChains<D, C>;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pair = panel + size_t(b / 2) * P::PAIR;
    const uint8_t* q = pair + size_t(b % 2) * P::QB;
    const uint8_t* hb = pair + 2 * P::QB + size_t(b % 2) * P::HB;
    const uint8_t* sc = pair + 2 * (P::QB + P::HB) + size_t(b % 2) * P::SB;
    __m512i s[C][NS];
    for (int c = 0; c < C; ++c) {
      int32_t lo, hi;
      block_corr<D>(tile_corr<C>(xq, corr, nb, c, b), lo, hi);
      s[c][0] = _mm512_set1_epi32(lo);
      if constexpr (NS > 1) s[c][NS - 1] = _mm512_set1_epi32(hi);
    }
    if constexpr (D == DType::Q8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_load_si512(q + 64 * j);
        for (int c = 0; c < C; ++c)
          s[c][j % NS] =
              _mm512_dpbusd_epi32(s[c][j % NS], v, _mm512_set1_epi32(int(load_u32(tile_act<C>(xq, nb, c, b).qs + 4 * j))));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        if constexpr (P::kLowBits == 2) {
          crumbs_with_high_bit<D>(q, hb, j, lo, hi);
        } else {
          const __m512i v = _mm512_load_si512(q + 64 * j);
          lo = nibbles_with_high_bits<D>(v, hb, j, 0), hi = nibbles_with_high_bits<D>(v, hb, j, 1);
        }
        for (int c = 0; c < C; ++c) {
          const int8_t* x = tile_act<C>(xq, nb, c, b).qs;
          s[c][0] = _mm512_dpbusd_epi32(s[c][0], lo, _mm512_set1_epi32(int(load_u32(x + 4 * j))));
          s[c][NS - 1] = _mm512_dpbusd_epi32(s[c][NS - 1], hi, _mm512_set1_epi32(int(load_u32(x + 16 + 4 * j))));
        }
      }
    }
    __m512 dw, dw2 = _mm512_setzero_ps(), mw = _mm512_setzero_ps(), mw2 = _mm512_setzero_ps();
    block_scales<D>(sc, dw, dw2, mw, mw2);
    for (int c = 0; c < C; ++c) acc[c] = scale_block<D, C, NS>(acc[c], s[c], dw, dw2, mw, mw2, xq, corr, nb, c, b);
  }
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + c * M, rmask, acc[c]);
}

// Rows [r0, r1) (r0 a multiple of 16), all T tokens, 8 tokens per tile. A weight that was not
// packed at load (tests, LLMQ_PACK=0) has each of its panels packed into the thread's scratch
// first: the same tiles, so the same bits, at the cost of a repack per call.
template <DType D>
void packed_matmul(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  constexpr int C = kTile;
  const int64_t M = w.rows, T = a.T, nb = a.nb;
  const size_t panel_bytes = Pk<D>::panel_bytes(w.cols);
  for (int64_t r = r0; r < r1; r += 16) {
    const uint8_t* panel = w.packed + size_t(r / 16) * panel_bytes;
    if (!w.packed) pack_panel<D>(w, r / 16, scratch), panel = scratch;
    const __mmask16 rmask = __mmask16((1u << std::min<int64_t>(16, r1 - r)) - 1);
    int64_t t = 0;
    for (; t + C <= T; t += C) {
      const auto* tile = reinterpret_cast<const BlockQ8Act*>(a.prep + size_t(t / C) * size_t(nb) * kTileBlockBytes);
      packed_tile<D, C>(y + t * M + r, M, panel, nb, tile, nullptr, rmask);
    }
    for (; t < T; ++t) packed_tile<D, 1>(y + t * M + r, M, panel, nb, a.xq + t * nb, a.corr + t * nb, rmask);
  }
}

// Scratch: one panel, for weights that were not packed at load.
size_t thread_bytes(DType type, int64_t, int64_t K) {
  return with_layout<Pk>(type, [&](auto pk) { return pk.panel_bytes(K); });
}

void matmul_quant(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  with_layout<Pk>(w.type, [&](auto pk) {
    packed_matmul<decltype(pk)::kType>(y, a, w, r0, r1, scratch);
    return 0;
  });
}

// Keys transposed ([hd, bt]): 16 positions per vector, R heads at a time sharing each key
// load, four partial sums over j mod 4 per head (R·4 independent chains hide the FMA latency).
template <int R>
void scores_rows(float* s, int64_t ss, const float* q, const float* kT, int64_t n, int64_t bt, int64_t hd, float scale) {
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const __mmask16 m = n - p0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - p0)) - 1);
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
    const float* kp = kT + p0;
    int64_t j = 0;
    for (; j + 4 <= hd; j += 4)
      for (int u = 0; u < 4; ++u) {
        const __m512 k = _mm512_maskz_loadu_ps(m, kp + (j + u) * bt);
        for (int r = 0; r < R; ++r) a[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * hd + j + u]), k, a[r][u]);
      }
    for (int u = 0; u < 3; ++u)  // hd % 4 trailing dimensions (constant indices keep a[][] in registers)
      if (j + u < hd) {
        const __m512 k = _mm512_maskz_loadu_ps(m, kp + (j + u) * bt);
        for (int r = 0; r < R; ++r) a[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * hd + j + u]), k, a[r][u]);
      }
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
      _mm512_mask_storeu_ps(s + r * ss + p0, m, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
    }
  }
}

// Heads in groups of 4 (R·4 score accumulators), then one group of the 1-3 left:
// rows(std::integral_constant<int, R>{}, g) for the R heads from head g on.
template <class Rows>
inline void for_score_groups(int64_t G, const Rows& rows) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) rows(std::integral_constant<int, 4>{}, g);
  switch (G - g) {
    case 3: return rows(std::integral_constant<int, 3>{}, g);
    case 2: return rows(std::integral_constant<int, 2>{}, g);
    case 1: return rows(std::integral_constant<int, 1>{}, g);
    default: return;
  }
}

void attn_scores(float* s, int64_t ss, const float* q, int64_t G, const float* kT, int64_t n, int64_t bt, int64_t hd,
                 float scale) {
  for_score_groups(G, [&](auto R, int64_t g) {
    scores_rows<decltype(R)::value>(s + g * ss, ss, q + g * hd, kT, n, bt, hd, scale);
  });
}

// R heads × hd = 16·NV: the R·NV output vectors stay in registers, each value row is loaded
// once for all R heads; per head and vector, one fused multiply-add per position, in order.
template <int NV, int R>
void accumulate_rows(float* out, const float* a, int64_t as, const float* v, int64_t n, int64_t stride) {
  __m512 o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) o[r][i] = _mm512_loadu_ps(out + r * 16 * NV + 16 * i);
  for (int64_t p = 0; p < n; ++p) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) {
      vv[i] = _mm512_loadu_ps(v + p * stride + 16 * i);
      if constexpr (R > 1) asm("" : "+v"(vv[i]));  // one load per row of V, not one per head (GCC folds it)
    }
    for (int r = 0; r < R; ++r) {
      const __m512 ap = _mm512_set1_ps(a[r * as + p]);
      for (int i = 0; i < NV; ++i) o[r][i] = _mm512_fmadd_ps(ap, vv[i], o[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + r * 16 * NV + 16 * i, o[r][i]);
}

// Heads in groups of up to 16/NV, so that a group's R·NV output vectors stay in registers (at
// most 16): rows(std::integral_constant<int, R>{}, g) for the R heads from head g on.
template <int NV, class Rows>
inline void for_head_groups(int64_t G, const Rows& rows) {
  constexpr int RMAX = NV >= 16 ? 1 : 16 / NV;
  int64_t g = 0;
  for (; g + RMAX <= G; g += RMAX) rows(std::integral_constant<int, RMAX>{}, g);
  if constexpr (RMAX >= 3)
    if (G - g >= 3) rows(std::integral_constant<int, 3>{}, g), g += 3;
  if constexpr (RMAX >= 2)
    if (G - g >= 2) rows(std::integral_constant<int, 2>{}, g), g += 2;
  for (; g < G; ++g) rows(std::integral_constant<int, 1>{}, g);
}

template <int NV>
void accumulate_heads(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride) {
  for_head_groups<NV>(G, [&](auto R, int64_t g) {
    accumulate_rows<NV, decltype(R)::value>(out + g * 16 * NV, a + g * as, as, v, n, stride);
  });
}

void attn_accumulate(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride,
                     int64_t hd) {
  switch (hd) {
    case 32: return accumulate_heads<2>(out, a, as, G, v, n, stride);
    case 64: return accumulate_heads<4>(out, a, as, G, v, n, stride);
    case 80: return accumulate_heads<5>(out, a, as, G, v, n, stride);
    case 96: return accumulate_heads<6>(out, a, as, G, v, n, stride);
    case 128: return accumulate_heads<8>(out, a, as, G, v, n, stride);
    default: break;
  }
  for (int64_t g = 0; g < G; ++g, out += hd, a += as)
    for (int64_t j = 0; j < hd; j += 16) {
      const __mmask16 m = hd - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (hd - j)) - 1);
      __m512 o = _mm512_maskz_loadu_ps(m, out + j);
      for (int64_t p = 0; p < n; ++p)
        o = _mm512_fmadd_ps(_mm512_set1_ps(a[p]), _mm512_maskz_loadu_ps(m, v + p * stride + j), o);
      _mm512_mask_storeu_ps(out + j, m, o);
    }
}

// ---- Attention on bf16 KV blocks (layouts in cpu_ops.h): `vdpbf16ps` multiplies the bf16
// pairs of a 32-bit lane and adds both products to an fp32 lane, twice the multiply-adds of
// an fp32 FMA per instruction. These functions also need AVX512_BF16 (cpu_has_avx512bf16).
#define LLMQ_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")))

LLMQ_AVX512BF16 inline __m512 dp_bf16(__m512 acc, __m512i x, __m512i y) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(x), reinterpret_cast<__m512bh&>(y));
}

// fp32 -> bf16, 16 at a time (`vcvtneps2bf16`: nearest even; it flushes denormals to zero).
LLMQ_AVX512BF16 void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i));
    _mm256_mask_storeu_epi16(dst + i, m, reinterpret_cast<const __m256i&>(h));
  }
}

// 16 positions per vector, R heads sharing each K load, two partial sums over pairs i mod 2.
template <int R>
LLMQ_AVX512BF16 void scores_bf16_rows(float* s, int64_t ss, const uint16_t* q, const uint16_t* k, int64_t n, int64_t bt,
                                      int64_t hd, float scale) {
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const __mmask16 m = n - p0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - p0)) - 1);
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd / 2; i += 2)
      for (int u = 0; u < 2 && i + u < hd / 2; ++u) {
        const __m512i kv = _mm512_maskz_loadu_epi32(m, k + ((i + u) * bt + p0) * 2);
        for (int r = 0; r < R; ++r)
          a[r][u] = dp_bf16(a[r][u], kv, _mm512_set1_epi32(int(load_u32(q + r * hd + 2 * (i + u)))));
      }
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(s + r * ss + p0, m, _mm512_mul_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_set1_ps(scale)));
  }
}

LLMQ_AVX512BF16 void attn_scores_bf16(float* s, int64_t ss, const uint16_t* q, int64_t G, const uint16_t* k, int64_t n,
                                      int64_t bt, int64_t hd, float scale) {
  for_score_groups(G, [&](auto R, int64_t g) {
    scores_bf16_rows<decltype(R)::value>(s + g * ss, ss, q + g * hd, k, n, bt, hd, scale);
  });
}

// R heads × hd = 16·NV outputs in registers; per pair of positions one V load per vector.
template <int NV, int R>
LLMQ_AVX512BF16 void accumulate_bf16_rows(float* out, const uint16_t* a, int64_t as, const uint16_t* v, int64_t n) {
  constexpr int64_t hd = 16 * NV;
  __m512 o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) o[r][i] = _mm512_loadu_ps(out + r * hd + 16 * i);
  for (int64_t pp = 0; pp < (n + 1) / 2; ++pp) {
    __m512i vv[NV];
    for (int i = 0; i < NV; ++i) {
      vv[i] = _mm512_loadu_si512(v + (pp * hd + 16 * i) * 2);
      if constexpr (R > 1) asm("" : "+v"(vv[i]));  // one load per pair row of V, not one per head
    }
    for (int r = 0; r < R; ++r) {
      const __m512i ap = _mm512_set1_epi32(int(load_u32(a + r * as + 2 * pp)));
      for (int i = 0; i < NV; ++i) o[r][i] = dp_bf16(o[r][i], vv[i], ap);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + r * hd + 16 * i, o[r][i]);
}

template <int NV>
LLMQ_AVX512BF16 void accumulate_bf16_heads(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n) {
  for_head_groups<NV>(G, [&](auto R, int64_t g) {
    accumulate_bf16_rows<NV, decltype(R)::value>(out + g * 16 * NV, a + g * as, as, v, n);
  });
}

LLMQ_AVX512BF16 void attn_accumulate_bf16(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n,
                                          int64_t hd) {
  switch (hd) {
    case 32: return accumulate_bf16_heads<2>(out, a, as, G, v, n);
    case 64: return accumulate_bf16_heads<4>(out, a, as, G, v, n);
    case 80: return accumulate_bf16_heads<5>(out, a, as, G, v, n);
    case 96: return accumulate_bf16_heads<6>(out, a, as, G, v, n);
    case 128: return accumulate_bf16_heads<8>(out, a, as, G, v, n);
    default: break;
  }
  for (int64_t g = 0; g < G; ++g)  // other head sizes: 16 dimensions at a time, masked tail
    for (int64_t j = 0; j < hd; j += 16) {
      const __mmask16 m = hd - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (hd - j)) - 1);
      __m512 o = _mm512_maskz_loadu_ps(m, out + g * hd + j);
      for (int64_t pp = 0; pp < (n + 1) / 2; ++pp)
        o = dp_bf16(o, _mm512_maskz_loadu_epi32(m, v + (pp * hd + j) * 2),
                    _mm512_set1_epi32(int(load_u32(a + g * as + 2 * pp))));
      _mm512_mask_storeu_ps(out + g * hd + j, m, o);
    }
}

int64_t int8_dot_loop(int64_t rounds) {
  // Twelve accumulators with distinct starting values (else the compiler merges them), each a
  // chain of vpdpbusd; the inputs pass through an empty asm every round so nothing is hoisted.
  __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3);
  __m512i a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7);
  __m512i a8 = _mm512_set1_epi32(8), a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11);
  __m512i u = _mm512_set1_epi32(0x01020304), v = _mm512_set1_epi32(0x05060708);
  for (int64_t r = 0; r < rounds; ++r) {
    asm volatile("" : "+v"(u), "+v"(v));
    a0 = _mm512_dpbusd_epi32(a0, u, v), a1 = _mm512_dpbusd_epi32(a1, u, v), a2 = _mm512_dpbusd_epi32(a2, u, v);
    a3 = _mm512_dpbusd_epi32(a3, u, v), a4 = _mm512_dpbusd_epi32(a4, u, v), a5 = _mm512_dpbusd_epi32(a5, u, v);
    a6 = _mm512_dpbusd_epi32(a6, u, v), a7 = _mm512_dpbusd_epi32(a7, u, v), a8 = _mm512_dpbusd_epi32(a8, u, v);
    a9 = _mm512_dpbusd_epi32(a9, u, v), a10 = _mm512_dpbusd_epi32(a10, u, v), a11 = _mm512_dpbusd_epi32(a11, u, v);
  }
  // Lane-wise sums (they wrap; _mm512_reduce_add_epi32 adds in signed scalar arithmetic, which
  // overflows: undefined behaviour, caught by UBSan), then lane 0: it depends on every chain.
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                               _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
  return _mm_cvtsi128_si32(_mm512_castsi512_si128(s));
}

}  // namespace
}  // namespace avx512

LLMQ_TARGET_END

const Kernels* kernels_avx2() {
  static const Kernels k{"avx2",          avx2::quantize_act,  avx2::matmul_float,
                         avx2::prep_bytes, avx2::prepare_quant, avx2::thread_bytes,
                         avx2::matmul_quant, avx2::dot,         avx2::axpy,
                         avx2::attn_scores, avx2::attn_accumulate, avx2::attn_scores_bf16,
                         avx2::attn_accumulate_bf16, nullptr, avx2::softmax,
                         avx2::swiglu,      avx2::geglu,         avx2::packed_bytes,  avx2::pack_quant,
                         avx2::int8_dot_loop, 8};
  return &k;
}

const Kernels* kernels_avx512() {
  static const Kernels k{"avx512",          avx512::quantize_act,  avx512::matmul_float,
                         avx512::prep_bytes, avx512::prepare_quant, avx512::thread_bytes,
                         avx512::matmul_quant, avx512::dot,         avx512::axpy,
                         avx512::attn_scores, avx512::attn_accumulate,
                         cpu_has_avx512bf16() ? avx512::attn_scores_bf16 : avx2::attn_scores_bf16,
                         cpu_has_avx512bf16() ? avx512::attn_accumulate_bf16 : avx2::attn_accumulate_bf16,
                         cpu_has_avx512bf16() ? avx512::to_bf16 : nullptr, avx512::softmax,
                         avx512::swiglu,    avx512::geglu,       avx512::packed_bytes, avx512::pack_quant,
                         avx512::int8_dot_loop, 16};
  return &k;
}

#endif  // LLMQ_X86

}  // namespace llmq::x86
