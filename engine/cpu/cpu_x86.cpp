// x86-64 SIMD kernels; see cpu_x86.h for the contract and the numerics.
//
// Block-quantized weights (every type of formats/quant.h but the floats), activations quantized
// per block of 32 to int8; the K-quants are taken a 32-weight sub-block at a time (Q6_K's two
// 16-weight halves keep separate integer sums):
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
// its GEMV does the same for Q4_0's q-8, its GEMM uses the nibble with the -8·Σx correction.
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: AVX-512 as above (the 5th and 6th bits kept as bit masks beside
// the nibbles, Q5_0's offset 16 corrected as Q4_0's 8, Q6_K's 32 per half block); AVX2 decodes
// each block in registers (decode_block): its GEMV reads rows in place as Q4_0's does (offsets
// removed before the sign trick), its GEMM builds 8-row panels of the decoded quants.
//
// Float weights (F32/F16/BF16): fp32 activations, tiles of R rows × C tokens with one vector
// accumulator per output along K (F16 by F16C, BF16 by a 16-bit shift), a fixed-order
// horizontal sum at the end; tokens blocked so that their activations stay in L2.
#include "engine/cpu/cpu_x86.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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
inline uint64_t load_u64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

template <DType D>
constexpr size_t block_size() {
  return D == DType::Q8_0 ? sizeof(BlockQ8_0) : D == DType::Q4_0 ? sizeof(BlockQ4_0) : sizeof(BlockQ4_1);
}
// Offset of the quants inside a block.
template <DType D>
constexpr size_t quant_offset() {
  return D == DType::Q4_1 ? 4 : 2;
}
// True for the types whose AVX2 kernels decode blocks in registers (decode_block) and whose
// GEMM panel is build_row_panel's.
constexpr bool is_row_type(DType t) {
  return t == DType::Q5_0 || t == DType::Q5_1 || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K;
}

// AVX2, the types of is_row_type: tokens from which the panel GEMM (rows_gemm) replaces the
// row-by-row kernel, and the bytes of one block of its 8-row panel (quants, then two fp32 rows).
constexpr int64_t kRowGemmMinT = 16;
constexpr size_t kRowPanelBlock = 256 + 64;

// Integer correction factor per block: weights enter the integer dot as u = w + k_off, so
// Σ w·x = Σ u·x + corr_factor·Σx with corr_factor = -k_off.
constexpr int32_t corr_factor(DType t) {
  return t == DType::Q8_0 ? -128 : t == DType::Q4_0 ? -8 : t == DType::Q5_0 ? -16 : 0;
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

// Q6_K's corrections hold the two half-block sums of the quants instead (|Σ| <= 16 · 128, so
// each fits int16): corr[i] = Σ_{j<16} q_j (low 16 bits) | Σ_{j>=16} q_j << 16.
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
inline float f16(uint16_t h) { return _cvtsh_ss(h); }

void quantize_act(const float* x, BlockQ8Act* out, int32_t* sums, int64_t n) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < n / QK; ++b, x += QK) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    const float d = hmax(a) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // nearest-even
    const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), p8);
    out[b].d = d;
    out[b].s = d * float(sum);
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

// ---- Q8_0 / Q4_0 / Q4_1: one block per step, lanes along K.
//
// `_mm256_maddubs_epi16` (u8 × s8, pairs summed to saturating int16) cannot take the unsigned
// w+128 of Q8_0 (2·255·127 overflows int16), so signed weights use the sign trick:
// |w| · (x·sign(w)), at most 2·128·127 = 32512 per pair. Q4_1's nibbles are unsigned already.

// 32 weights of one block as bytes in natural order: signed (Q8_0, Q4_0: q-8) or unsigned (Q4_1).
template <DType D>
inline __m256i block_quants(const uint8_t* blk) {
  if constexpr (D == DType::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quant_offset<D>()));
    const __m256i z = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    const __m256i q = _mm256_and_si256(z, _mm256_set1_epi8(0x0f));
    if constexpr (D == DType::Q4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    else return q;
  }
}

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

// Tokens per pass of the GEMV over a group of rows.
constexpr int kGemvTokens = 4;

// Scratch of the GEMV: for 8 rows, the int32 block dot products of kGemvTokens tokens
// [kGemvTokens][nb][8] (Q6_K: of each half block, twice that), then per block the two fp32
// values of each row (the scale; the minimum or Q6_K's second scale) [nb][8] each (transposed:
// rows are lanes, as in the GEMM).
size_t gemv_scratch_bytes(DType t, int64_t nb) { return size_t(nb) * (kGemvTokens * 32 * (t == DType::Q6_K ? 2 : 1) + 64); }

// The block decoders of the types of is_row_type (below).
struct BlockScales {
  float a0, a1, m;
};
template <DType D>
inline __m256i decode_block(const uint8_t* row, int64_t b, BlockScales& s);
template <DType D>
constexpr int quant_zero() {
  return D == DType::Q5_0 ? 16 : D == DType::Q6_K ? 32 : 0;
}
// Whether the GEMV takes the block's quants as signed (sign trick) or unsigned.
template <DType D>
constexpr bool gemv_signed() {
  return D == DType::Q8_0 || D == DType::Q4_0 || quant_zero<D>() != 0;
}
// Whether a block adds a minimum term m·s_x (the types of the form d·q + m).
template <DType D>
constexpr bool has_min() {
  return D == DType::Q4_1 || D == DType::Q5_1 || D == DType::Q4_K || D == DType::Q5_K;
}

// Block b of a row for the GEMV: its quants (signed with the offset removed, or unsigned), and
// the two fp32 values of its row: the scale, and the minimum (Q4_1: m; Q5_1/Q4_K/Q5_K: −m) or
// Q6_K's second scale.
template <DType D>
inline __m256i gemv_block(const uint8_t* row, int64_t b, float& s0, float& s1) {
  if constexpr (is_row_type(D)) {
    BlockScales s;
    __m256i q = decode_block<D>(row, b, s);
    s0 = s.a0, s1 = D == DType::Q6_K ? s.a1 : -s.m;
    if constexpr (quant_zero<D>() != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(quant_zero<D>()));
    return q;
  } else {
    const uint8_t* blk = row + size_t(b) * block_size<D>();
    s0 = f16(load_u16(blk)), s1 = D == DType::Q4_1 ? f16(load_u16(blk + 2)) : 0.0f;
    return block_quants<D>(blk);
  }
}

inline int32_t hsum_i32x4(__m128i s) {
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// Few tokens (below the GEMM's threshold): the weights are read in place, row after row, each
// block decoded once for up to 4 tokens; the exact integer dot product of every block is stored
// transposed, and per 8 rows the fp32 part runs with rows in lanes, the instruction sequence of
// gemm_tile / row_gemm_tile, so that GEMV and GEMM results are bit-identical.
template <DType D>
void gemv(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  constexpr int C = kGemvTokens;
  constexpr bool kHalves = D == DType::Q6_K;
  const int64_t M = w.rows, nb = a.nb, T = a.T;
  const size_t rs = w.row_stride();
  auto* DT = reinterpret_cast<int32_t*>(scratch);  // [C][nb][8], Q6_K: first halves
  int32_t* DT2 = DT + size_t(C) * size_t(nb) * 8;  // Q6_K: second halves
  auto* WT = reinterpret_cast<float*>(scratch + size_t(nb) * C * 32 * (kHalves ? 2 : 1));
  auto* MT = WT + nb * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = r0; g < r1; g += 8) {
    const int n = int(std::min<int64_t>(8, r1 - g));
    for (int64_t t0 = 0; t0 < T; t0 += C) {
      const int nc = int(std::min<int64_t>(C, T - t0));
      if (n < 8) std::memset(scratch, 0, gemv_scratch_bytes(D, nb));
      for (int i = 0; i < n; ++i) {
        const uint8_t* row = w.data + size_t(g + i) * rs;
        for (int64_t b = 0; b < nb; ++b) {
          const __m256i q = gemv_block<D>(row, b, WT[b * 8 + i], MT[b * 8 + i]);
          const __m256i aq = gemv_signed<D>() ? _mm256_sign_epi8(q, q) : q;  // unsigned operand
          for (int c = 0; c < nc; ++c) {
            __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq[(t0 + c) * nb + b].qs));
            if constexpr (gemv_signed<D>()) xv = _mm256_sign_epi8(xv, q);
            const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xv), ones);
            if constexpr (kHalves) {
              DT[(c * nb + b) * 8 + i] = hsum_i32x4(_mm256_castsi256_si128(d));
              DT2[(c * nb + b) * 8 + i] = hsum_i32x4(_mm256_extracti128_si256(d, 1));
            } else {
              DT[(c * nb + b) * 8 + i] = hsum_i32(d);
            }
          }
        }
      }
      for (int c = 0; c < nc; ++c) {
        const BlockQ8Act* xq = a.xq + (t0 + c) * nb;
        __m256 acc = _mm256_setzero_ps();  // as gemm_tile, lanes = rows g .. g+7
        for (int64_t b = 0; b < nb; ++b) {
          const __m256i s32 = _mm256_load_si256(reinterpret_cast<const __m256i*>(DT + (c * nb + b) * 8));
          const __m256 dx = _mm256_set1_ps(xq[b].d);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(_mm256_load_ps(WT + b * 8), dx), acc);
          if constexpr (kHalves) {
            const __m256i h32 = _mm256_load_si256(reinterpret_cast<const __m256i*>(DT2 + (c * nb + b) * 8));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h32), _mm256_mul_ps(_mm256_load_ps(MT + b * 8), dx), acc);
          }
          if constexpr (has_min<D>()) acc = _mm256_fmadd_ps(_mm256_load_ps(MT + b * 8), _mm256_set1_ps(xq[b].s), acc);
        }
        store_rows8<1>(y + (t0 + c) * M + g, M, &acc, n);
      }
    }
  }
}

// ---- GEMM (many tokens): 8 rows per panel, one 32-byte vector = 4 quants of each of 8 rows.
// Q8_0 keeps the signed quants and their absolute values (sign trick, int32 per group of 4);
// Q4_0/Q4_1 keep the unsigned nibbles, whose pair products (at most 2·15·127) can be summed in
// int16 over a whole block before one widening `_mm256_madd_epi16`.

// Tokens from which the repacked GEMM beats the in-place GEMV (dev/cpu/bench_matmul on Zen 4:
// the Q8_0 sign trick costs the GEMM more).
constexpr int64_t gemm_min_t(DType t) { return t == DType::Q8_0 ? 32 : is_row_type(t) ? kRowGemmMinT : 16; }

template <DType D>
constexpr size_t panel_block_bytes() {
  return D == DType::Q8_0 ? 8 * 32 * 2 + 32 : 8 * 32 + 64;  // quants (+|quants|), d_w, (m)
}

template <DType D>
void build_panel(uint8_t* panel, const Weight& w, int64_t r, int nrows, int64_t nb) {
  constexpr size_t BS = block_size<D>(), PB = panel_block_bytes<D>();
  alignas(16) uint16_t dh[8], mh[8];
  const size_t rs = w.row_stride();
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* pb = panel + size_t(b) * PB;
    auto* W = reinterpret_cast<uint32_t*>(pb);
    for (int i = 0; i < 8; ++i) {
      if (i >= nrows) {
        for (int j = 0; j < 8; ++j) W[j * 8 + i] = 0;
        dh[i] = mh[i] = 0;
        continue;
      }
      const uint8_t* blk = w.data + size_t(r + i) * rs + size_t(b) * BS;
      dh[i] = load_u16(blk);
      if constexpr (D == DType::Q8_0) {
        for (int j = 0; j < 8; ++j) W[j * 8 + i] = load_u32(blk + 2 + 4 * j);
      } else {
        if constexpr (D == DType::Q4_1) mh[i] = load_u16(blk + 2);
        const uint8_t* qs = blk + quant_offset<D>();
        for (int j = 0; j < 4; ++j) {
          const uint32_t u = load_u32(qs + 4 * j);
          W[j * 8 + i] = u & 0x0f0f0f0fu;
          W[(j + 4) * 8 + i] = (u >> 4) & 0x0f0f0f0fu;
        }
      }
    }
    if constexpr (D == DType::Q8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 32 * j));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + 256 + 32 * j), _mm256_sign_epi8(q, q));
      }
      _mm256_store_ps(reinterpret_cast<float*>(pb + 512), _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh))));
    } else {
      _mm256_store_ps(reinterpret_cast<float*>(pb + 256), _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh))));
      _mm256_store_ps(reinterpret_cast<float*>(pb + 288), _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mh))));
    }
  }
}

template <DType D, int C>
void gemm_tile(float* y, int64_t M, const uint8_t* panel, int64_t nb, const BlockQ8Act* xq, const int32_t* corr, int nrows) {
  constexpr size_t PB = panel_block_bytes<D>();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + size_t(b) * PB;
    const auto* W = reinterpret_cast<const __m256i*>(pb);
    for (int c = 0; c < C; ++c) {
      const BlockQ8Act& xa = xq[c * nb + b];
      __m256i s32;
      if constexpr (D == DType::Q8_0) {
        s32 = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(int(load_u32(xa.qs + 4 * j))), _mm256_load_si256(W + j));
          s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256(W + 8 + j), xs), ones));
        }
      } else {
        __m256i s16 = _mm256_maddubs_epi16(_mm256_load_si256(W), _mm256_set1_epi32(int(load_u32(xa.qs))));
        for (int j = 1; j < 8; ++j)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256(W + j), _mm256_set1_epi32(int(load_u32(xa.qs + 4 * j)))));
        s32 = _mm256_madd_epi16(s16, ones);
        if constexpr (D == DType::Q4_0) s32 = _mm256_add_epi32(s32, _mm256_set1_epi32(corr[c * nb + b]));
      }
      const __m256 dw = _mm256_load_ps(reinterpret_cast<const float*>(pb + (D == DType::Q8_0 ? 512 : 256)));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(dw, _mm256_set1_ps(xa.d)), acc[c]);
      if constexpr (D == DType::Q4_1)
        acc[c] = _mm256_fmadd_ps(_mm256_load_ps(reinterpret_cast<const float*>(pb + 288)), _mm256_set1_ps(xa.s), acc[c]);
    }
  }
  store_rows8<C>(y, M, acc, nrows);
}

// The panel GEMM of 8 rows for type D: Q8_0/Q4_0/Q4_1 (build_panel, gemm_tile) or the types of
// is_row_type (build_row_panel, row_gemm_tile, defined below).
template <DType D, int C>
void row_gemm_tile(float* y, int64_t M, const uint8_t* panel, int64_t nb, const BlockQ8Act* xq, const int32_t* corr, int nrows);
template <DType D>
void build_row_panel(uint8_t* panel, const Weight& w, int64_t r, int nrows, int64_t nb);

template <DType D>
void gemm(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* panel) {
  constexpr int C = 4;
  const int64_t M = w.rows, T = a.T, nb = a.nb;
  for (int64_t r = r0; r < r1; r += 8) {
    const int nrows = int(std::min<int64_t>(8, r1 - r));
    if constexpr (is_row_type(D)) build_row_panel<D>(panel, w, r, nrows, nb);
    else build_panel<D>(panel, w, r, nrows, nb);
    const auto tile = [&](auto cc, int64_t t) {
      constexpr int CC = decltype(cc)::value;
      if constexpr (is_row_type(D)) row_gemm_tile<D, CC>(y + t * M + r, M, panel, nb, a.xq + t * nb, a.corr + t * nb, nrows);
      else gemm_tile<D, CC>(y + t * M + r, M, panel, nb, a.xq + t * nb, a.corr + t * nb, nrows);
    };
    int64_t t = 0;
    for (; t + C <= T; t += C) tile(std::integral_constant<int, C>{}, t);
    for (; t < T; ++t) tile(std::integral_constant<int, 1>{}, t);
  }
}

size_t prep_bytes(DType, int64_t, int64_t) { return 0; }
void prepare_quant(DType type, const QuantActs& a, const int32_t* sums, int64_t t0, int64_t t1, int32_t* corr, uint8_t*) {
  if (type == DType::Q6_K) fill_corr_halves(a.xq + t0 * a.nb, (t1 - t0) * a.nb, corr + t0 * a.nb);
  else fill_corr(type, sums + t0 * a.nb, (t1 - t0) * a.nb, corr + t0 * a.nb);
}
size_t thread_bytes(DType type, int64_t T, int64_t K) {
  if (T < gemm_min_t(type)) return gemv_scratch_bytes(type, K / QK);
  if (is_row_type(type)) return size_t(K / QK) * kRowPanelBlock;
  return size_t(K / QK) * (type == DType::Q8_0 ? panel_block_bytes<DType::Q8_0>() : panel_block_bytes<DType::Q4_1>());
}

// ---- Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K: each 32-weight block decoded in registers, row by row.
//
// A block decodes to 32 unsigned quants and the scales of formats/quant.h's QuantBlock
// (w = a_h·(q − o) − m, h the half). The offset is removed first (q − o fits int8), so the
// dot product takes the sign trick as Q8_0's and needs no correction; the int32 lanes of
// `_mm256_madd_epi16` hold elements 4l..4l+3, so lanes 0-3 are the first half (scale a0) and
// lanes 4-7 the second (a1): one fp32 vector of scales serves Q6_K's 16-weight sub-blocks.
// Every output is computed by the same instruction sequence whatever T, r0 and r1 are.

// Byte i of the result is 0x10 when bit i of x is set, else 0.
inline __m256i bits_to_0x10(uint32_t x) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(x)), _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}
// 16 bytes of nibbles as 32 values: low nibbles (weights 0..15), then high nibbles (16..31).
inline __m256i nibbles_32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                          _mm256_set1_epi8(0x0f));
}
// 32 bytes at p shifted right by `shift` bits, masked: one field of packed K-quant bytes.
inline __m256i field_32(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), shift),
                          _mm256_set1_epi8(char(mask)));
}

// Block b (of 32 weights) of a row: its quants q (0 ≤ q < 64) and scales.
template <DType D>
inline __m256i decode_block(const uint8_t* row, int64_t b, BlockScales& s) {
  if constexpr (D == DType::Q5_0 || D == DType::Q5_1) {
    constexpr size_t BS = D == DType::Q5_0 ? sizeof(BlockQ5_0) : sizeof(BlockQ5_1), H = D == DType::Q5_0 ? 2 : 4;
    const uint8_t* blk = row + size_t(b) * BS;
    s.a0 = s.a1 = f16(load_u16(blk));
    s.m = D == DType::Q5_1 ? -f16(load_u16(blk + 2)) : 0.0f;
    return _mm256_or_si256(nibbles_32(blk + H + 4), bits_to_0x10(load_u32(blk + H)));
  } else if constexpr (D == DType::Q4_K || D == DType::Q5_K) {
    constexpr bool five = D == DType::Q5_K;
    const uint8_t* blk = row + size_t(b / 8) * (five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
    const int j = int(b % 8);
    int scale, min;
    k_quant_scale_min(j, blk + 4, &scale, &min);
    s.a0 = s.a1 = f16(load_u16(blk)) * float(scale);
    s.m = f16(load_u16(blk + 2)) * float(min);
    const __m256i q = field_32(blk + (five ? 48 : 16) + 32 * (j / 2), 4 * (j % 2), 0x0f);
    if constexpr (!five) return q;
    else return _mm256_or_si256(q, _mm256_slli_epi16(field_32(blk + 16, j, 1), 4));
  } else {  // Q6_K: weights 32j .. 32j+31 of the super-block (formats/quant.h's bit layout)
    const uint8_t* blk = row + size_t(b / 8) * sizeof(BlockQ6_K);
    const int j = int(b % 8), h = j / 4, jj = j % 4;
    const float d = f16(load_u16(blk + 208));
    const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
    s.a0 = d * float(scales[2 * j]), s.a1 = d * float(scales[2 * j + 1]), s.m = 0.0f;
    const __m256i lo = field_32(blk + 64 * h + 32 * (jj % 2), 4 * (jj / 2), 0x0f);
    return _mm256_or_si256(lo, _mm256_slli_epi16(field_32(blk + 128 + 32 * h, 2 * jj, 3), 4));
  }
}

// Many tokens: 8 rows per panel built per call from the decoded blocks, as the Q4 GEMM's panels:
// per block 8 vectors (vector j, lane i = quants 4j..4j+3 of row i, unsigned), then a0 of the 8
// rows and their second value (Q6_K: a1; the types with a minimum: −m) as fp32. The unsigned
// pair products fit int16 over 8 vectors (Q4_K: 8·2·15·127), 4 (5-bit: 31496) or 2 (Q6_K:
// 32004); Q5_0's offset comes back as the −16·Σx correction, Q6_K's as −32 per half.
template <DType D>
void build_row_panel(uint8_t* panel, const Weight& w, int64_t r, int nrows, int64_t nb) {
  alignas(32) uint8_t tmp[32];
  const size_t rs = w.row_stride();
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* pb = panel + size_t(b) * kRowPanelBlock;
    auto* W = reinterpret_cast<uint32_t*>(pb);
    auto* sc = reinterpret_cast<float*>(pb + 256);
    for (int i = 0; i < 8; ++i) {
      BlockScales s{0, 0, 0};
      if (i < nrows) _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), decode_block<D>(w.data + size_t(r + i) * rs, b, s));
      else std::memset(tmp, 0, sizeof tmp);
      for (int j = 0; j < 8; ++j) W[j * 8 + i] = load_u32(tmp + 4 * j);
      sc[i] = s.a0, sc[8 + i] = D == DType::Q6_K ? s.a1 : -s.m;
    }
  }
}

template <DType D, int C>
void row_gemm_tile(float* y, int64_t M, const uint8_t* panel, int64_t nb, const BlockQ8Act* xq, const int32_t* corr, int nrows) {
  constexpr int G = D == DType::Q4_K ? 8 : D == DType::Q6_K ? 2 : 4;  // vectors summed in int16
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + size_t(b) * kRowPanelBlock;
    const auto* W = reinterpret_cast<const __m256i*>(pb);
    const __m256 a0 = _mm256_load_ps(reinterpret_cast<const float*>(pb + 256));
    const __m256 a1 = _mm256_load_ps(reinterpret_cast<const float*>(pb + 288));
    for (int c = 0; c < C; ++c) {
      const BlockQ8Act& xa = xq[c * nb + b];
      __m256i part[8 / G];
      for (int g = 0; g < 8 / G; ++g) {
        __m256i s16 = _mm256_setzero_si256();
        for (int j = g * G; j < g * G + G; ++j)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256(W + j), _mm256_set1_epi32(int(load_u32(xa.qs + 4 * j)))));
        part[g] = _mm256_madd_epi16(s16, ones);
      }
      const __m256 dx = _mm256_set1_ps(xa.d);
      if constexpr (D == DType::Q6_K) {
        const auto k = uint32_t(corr[c * nb + b]);
        const __m256i lo = _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]), _mm256_set1_epi32(-32 * int32_t(int16_t(k & 0xffffu))));
        const __m256i hi = _mm256_add_epi32(_mm256_add_epi32(part[2], part[3]), _mm256_set1_epi32(-32 * int32_t(int16_t(k >> 16))));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(a0, dx), acc[c]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(a1, dx), acc[c]);
      } else {
        __m256i s32 = part[0];
        for (int g = 1; g < 8 / G; ++g) s32 = _mm256_add_epi32(s32, part[g]);
        if constexpr (D == DType::Q5_0) s32 = _mm256_add_epi32(s32, _mm256_set1_epi32(corr[c * nb + b]));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(a0, dx), acc[c]);
        if constexpr (D != DType::Q5_0) acc[c] = _mm256_fmadd_ps(a1, _mm256_set1_ps(xa.s), acc[c]);
      }
    }
  }
  store_rows8<C>(y, M, acc, nrows);
}

template <DType D>
void gemv_or_gemm(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  if (a.T < gemm_min_t(D)) gemv<D>(y, a, w, r0, r1, scratch);
  else gemm<D>(y, a, w, r0, r1, scratch);
}

void matmul_quant(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  switch (w.type) {
    case DType::Q8_0: gemv_or_gemm<DType::Q8_0>(y, a, w, r0, r1, scratch); break;
    case DType::Q4_0: gemv_or_gemm<DType::Q4_0>(y, a, w, r0, r1, scratch); break;
    case DType::Q4_1: gemv_or_gemm<DType::Q4_1>(y, a, w, r0, r1, scratch); break;
    case DType::Q5_0: gemv_or_gemm<DType::Q5_0>(y, a, w, r0, r1, scratch); break;
    case DType::Q5_1: gemv_or_gemm<DType::Q5_1>(y, a, w, r0, r1, scratch); break;
    case DType::Q4_K: gemv_or_gemm<DType::Q4_K>(y, a, w, r0, r1, scratch); break;
    case DType::Q5_K: gemv_or_gemm<DType::Q5_K>(y, a, w, r0, r1, scratch); break;
    default: gemv_or_gemm<DType::Q6_K>(y, a, w, r0, r1, scratch); break;
  }
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

void quantize_act(const float* x, BlockQ8Act* out, int32_t* sums, int64_t n) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < n / QK; ++b, x += QK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));  // round to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs + 16), _mm512_cvtsepi32_epi8(q1));
    // The sum of the int8 values as stored (saturated): equal to q0 + q1 for finite inputs, and
    // no int32 overflow when NaN/Inf activations turn into INT_MIN (UBSan, fuzz/llmq_file).
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    const __m512i s0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi), s1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
    out[b].d = d;
    out[b].s = d * float(sum);
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
  if (type == DType::Q6_K) fill_corr_halves(a.xq + t0 * nb, (t1 - t0) * nb, corr + t0 * nb);
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
//           4j..4j+3 of row r, in its high nibbles those of elements 16+4j..16+4j+3 (for Q4_0
//           and Q4_1 these are the file's quant bytes 4j..4j+3).
// high bits (formats/quant.h's QuantBlock q ≥ 16): one 64-bit mask per quant vector and bit,
//   bit 4r+k = that bit of the element in byte k of lane r: Q5_0/Q5_1/Q5_K 8 masks of bit 4
//   (4 for the low nibbles, then 4 for the high ones; 64 bytes); Q6_K those of bit 4, then of
//   bit 5 (128 bytes).
// scales of the 16 rows: Q8_0/Q4_0/Q5_0 d as fp16 (32 bytes); Q4_1/Q5_1 d, then m, as fp16
//   (64); Q4_K/Q5_K a = d·sc, then the added minimum −dmin·m, as fp32 (128; both exact
//   products of the file's fields); Q6_K the two half-block scales d·sc as fp32 (128).
// A pair is a multiple of 64 bytes, so every load is aligned: Q4_0 576 (= 16 rows × 2 blocks
// × 18: the file's bytes), Q4_1 640, Q5_0 704 (the file's), Q5_1 768, Q8_0 1088, Q4_K 768 and
// Q5_K 896 (the file's 576 and 704 plus the scales widened to fp32), Q6_K 1024 (file: 840).
// One panel is one sequential stream, which decode reads at the DRAM bandwidth (16 rows read in
// place, 16 streams, lost up to half of it: dev/README.md #5, #14); prefill reuses
// each panel (up to 27 KiB for K = 1536 at Q4_0) from L1/L2 for every tile of 8 tokens.
template <DType D>
struct Pk {
  static constexpr DType kType = D;
  static constexpr bool kF32Scales = D == DType::Q4_K || D == DType::Q5_K || D == DType::Q6_K;
  static constexpr bool kMin = D == DType::Q4_1 || D == DType::Q5_1 || D == DType::Q4_K || D == DType::Q5_K;
  static constexpr bool kTwoScales = D == DType::Q6_K;  // one per half block (16 weights)
  static constexpr int kHighBits = D == DType::Q6_K ? 2 : (D == DType::Q5_0 || D == DType::Q5_1 || D == DType::Q5_K) ? 1 : 0;
  static constexpr size_t QB = D == DType::Q8_0 ? 512 : 256;
  static constexpr size_t HB = 64 * size_t(kHighBits);
  static constexpr size_t SB = kF32Scales ? 128 : kMin ? 64 : 32;
  static constexpr size_t PAIR = 2 * (QB + HB + SB);
  static size_t panel_bytes(int64_t K) { return size_t((K / QK + 1) / 2) * PAIR; }
};

// The packed layout of a type, by value: dispatch on a run-time DType once.
template <class F>
auto with_packed_type(DType t, F&& f) {
  switch (t) {
    case DType::Q8_0: return f(Pk<DType::Q8_0>{});
    case DType::Q4_0: return f(Pk<DType::Q4_0>{});
    case DType::Q4_1: return f(Pk<DType::Q4_1>{});
    case DType::Q5_0: return f(Pk<DType::Q5_0>{});
    case DType::Q5_1: return f(Pk<DType::Q5_1>{});
    case DType::Q4_K: return f(Pk<DType::Q4_K>{});
    case DType::Q5_K: return f(Pk<DType::Q5_K>{});
    default: return f(Pk<DType::Q6_K>{});
  }
}

size_t packed_bytes(DType type, int64_t rows, int64_t cols) {
  if (!is_quantized(type)) return 0;
  return with_packed_type(type, [&](auto pk) { return size_t((rows + 15) / 16) * pk.panel_bytes(cols); });
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

// The other types from their decoded block (formats/quant.h decode_quant_block).
template <DType D>
void pack_block_decoded(const QuantBlock& qb, int i, uint8_t* q, uint8_t* hb, uint8_t* sc) {
  auto* masks = reinterpret_cast<uint64_t*>(hb);  // 64-aligned
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) {
      const uint8_t lo = qb.q[4 * j + k], hi = qb.q[16 + 4 * j + k];
      q[64 * j + 4 * i + k] = uint8_t((lo & 15) | (hi & 15) << 4);
      const int bit = 4 * i + k;
      for (int h = 0; h < Pk<D>::kHighBits; ++h) {
        masks[8 * h + j] |= uint64_t((lo >> (4 + h)) & 1) << bit;
        masks[8 * h + 4 + j] |= uint64_t((hi >> (4 + h)) & 1) << bit;
      }
    }
  if constexpr (Pk<D>::kF32Scales) {
    auto* f = reinterpret_cast<float*>(sc);
    f[i] = qb.a[0];
    f[16 + i] = Pk<D>::kTwoScales ? qb.a[1] : -qb.m;
  } else {
    const uint16_t d = fp32_to_fp16(qb.a[0]), m = fp32_to_fp16(-qb.m);  // exact: they were fp16
    std::memcpy(sc + 2 * i, &d, 2);
    if constexpr (Pk<D>::kMin) std::memcpy(sc + 32 + 2 * i, &m, 2);
  }
}

// Rows 16p .. 16p+15 of w as one packed panel at out (Pk::panel_bytes; rows past the matrix zero).
template <DType D>
void pack_panel(const Weight& w, int64_t p, uint8_t* out) {
  using P = Pk<D>;
  const int64_t nb = w.cols / QK, nrows = std::min<int64_t>(16, w.rows - p * 16);
  if (nrows < 16 || nb % 2 || P::kHighBits) std::memset(out, 0, P::panel_bytes(w.cols));  // padding; masks are OR-ed
  QuantBlock qb;
  for (int i = 0; i < nrows; ++i) {
    const uint8_t* row = w.row(p * 16 + i);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* pair = out + size_t(b / 2) * P::PAIR;
      uint8_t* q = pair + size_t(b % 2) * P::QB;
      uint8_t* hb = pair + 2 * P::QB + size_t(b % 2) * P::HB;
      uint8_t* sc = pair + 2 * (P::QB + P::HB) + size_t(b % 2) * P::SB;
      if constexpr (D == DType::Q8_0 || D == DType::Q4_0 || D == DType::Q4_1) {
        pack_block_bytes<D>(row + size_t(b) * block_size<D>(), i, q, sc);
      } else {
        decode_quant_block(D, row, b, qb);
        pack_block_decoded<D>(qb, i, q, hb, sc);
      }
    }
  }
}

void pack_quant(const Weight& w, uint8_t* out) {
  if (!is_quantized(w.type)) return;
  with_packed_type(w.type, [&](auto pk) {
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
// (j: its index 0..3) added back from the masks.
template <DType D>
inline __m512i nibbles_with_high_bits(__m512i v, const uint8_t* hb, int j, int h) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512i n = h ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4) : _mm512_and_si512(v, low4);
  if constexpr (Pk<D>::kHighBits > 0) {
    const __mmask64 m4 = _cvtu64_mask64(load_u64(hb + 8 * (4 * h + j)));
    n = _mm512_mask_add_epi8(n, m4, n, _mm512_set1_epi8(0x10));
  }
  if constexpr (Pk<D>::kHighBits > 1) {
    const __mmask64 m5 = _cvtu64_mask64(load_u64(hb + 64 + 8 * (4 * h + j)));
    n = _mm512_mask_add_epi8(n, m5, n, _mm512_set1_epi8(0x20));
  }
  return n;
}

// The integer corrections of a token's block, for the first and second half accumulators:
// Q6_K's corr holds the two half sums of q_x as int16 (fill_corr_halves), the others the whole
// block's correction.
template <DType D>
inline void block_corr(int32_t c, int32_t& lo, int32_t& hi) {
  if constexpr (Pk<D>::kTwoScales) {
    lo = -32 * int32_t(int16_t(uint32_t(c) & 0xffffu)), hi = -32 * int32_t(int16_t(uint32_t(c) >> 16));
  } else {
    lo = c, hi = 0;
  }
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
  // Integer accumulators per token: with one token, two chains (even and odd quant vectors)
  // halve the vpdpbusd dependency chain; with 8 tokens there are 8 chains already (and more
  // accumulators would spill). Q6_K keeps its halves apart.
  constexpr int NS = C >= 4 && !P::kTwoScales ? 1 : 2;
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
        const __m512i v = _mm512_load_si512(q + 64 * j);
        const __m512i lo = nibbles_with_high_bits<D>(v, hb, j, 0), hi = nibbles_with_high_bits<D>(v, hb, j, 1);
        for (int c = 0; c < C; ++c) {
          const int8_t* x = tile_act<C>(xq, nb, c, b).qs;
          s[c][0] = _mm512_dpbusd_epi32(s[c][0], lo, _mm512_set1_epi32(int(load_u32(x + 4 * j))));
          s[c][NS - 1] = _mm512_dpbusd_epi32(s[c][NS - 1], hi, _mm512_set1_epi32(int(load_u32(x + 16 + 4 * j))));
        }
      }
    }
    __m512 dw, dw2 = _mm512_setzero_ps(), mw = _mm512_setzero_ps();
    if constexpr (P::kF32Scales) {
      dw = _mm512_load_ps(reinterpret_cast<const float*>(sc));
      (P::kTwoScales ? dw2 : mw) = _mm512_load_ps(reinterpret_cast<const float*>(sc + 64));
    } else {
      dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc)));
      if constexpr (P::kMin) mw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    }
    for (int c = 0; c < C; ++c) {
      const BlockQ8Act& xa = tile_act<C>(xq, nb, c, b);
      const __m512 dx = _mm512_set1_ps(xa.d);
      if constexpr (P::kTwoScales) {
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[c][0]), _mm512_mul_ps(dw, dx), acc[c]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[c][1]), _mm512_mul_ps(dw2, dx), acc[c]);
      } else {
        const __m512i dot = NS > 1 ? _mm512_add_epi32(s[c][0], s[c][NS - 1]) : s[c][0];
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc[c]);
      }
      if constexpr (P::kMin) acc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xa.s), acc[c]);
    }
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
  return with_packed_type(type, [&](auto pk) { return pk.panel_bytes(K); });
}

void matmul_quant(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch) {
  with_packed_type(w.type, [&](auto pk) {
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
                         avx2::swiglu,      nullptr,             nullptr,
                         nullptr};
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
                         avx512::swiglu,    avx512::packed_bytes, avx512::pack_quant,
                         avx512::int8_dot_loop};
  return &k;
}

#endif  // LLMQ_X86

}  // namespace llmq::x86
