// x86-64 SIMD kernels (AVX2 + FMA + F16C, and AVX-512 F/BW/VL/DQ/VNNI) behind one table of
// function pointers per instruction-set level. Every function is compiled for its own target
// (GCC `#pragma GCC target`), so the binary runs on any x86-64; `cpu_ops.cpp` picks a table at
// run time from what the CPU reports. On other architectures the tables are null and only the
// scalar kernels of cpu_ops.cpp exist.
//
// Numerics (identical for any thread count, because each output element is computed by the
// same instruction sequence wherever its row falls in a tile or a thread's range):
// - F32/F16/BF16: fp32 products accumulated in fp32, one vector accumulator per output
//   (16 or 8 independent lanes along K), lanes summed in a fixed order at the end.
// - quantized types: exact int32 dot products of 8-bit activations with the weight quants per
//   block of 32 (per half block for Q6_K), then sum_b d_w[b] * d_x[b] * dot_b (+ m[b] * s_x[b]
//   for the types with a minimum) in fp32, as the scalar path; only the fp32 rounding of those
//   per-block terms differs from it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "engine/cpu/cpu_ops.h"

namespace llmq::x86 {

/// Activations of one block-quantized matmul, prepared once and shared by all threads.
struct QuantActs {
  const BlockQ8Act* xq = nullptr;  // [T, nb] quantized activations (scale d, s = d·Σq, q)
  const int32_t* corr = nullptr;   // [T, nb] integer offset correction per block (see prepare)
  const uint8_t* prep = nullptr;   // kernel-specific layout built by prepare_quant, 64-aligned
  int64_t T = 0, nb = 0;
};

/// The kernels of one instruction-set level.
struct Kernels {
  const char* name;  // "avx2" or "avx512"
  /// Same contract and bit-identical results as llmq::quantize_act_q8 (`group` 32 or 256);
  /// also writes sums[b] = Σ q over block b when sums is not null.
  void (*quantize_act)(const float* x, BlockQ8Act* out, int32_t* sums, int64_t n, int group);
  /// y[t, r] for rows r in [r0, r1) and all T tokens of an F32/F16/BF16 weight (y is [T, w.rows]).
  void (*matmul_float)(float* y, const float* x, int64_t T, const Weight& w, int64_t r0, int64_t r1);
  /// Bytes of `prep` that prepare_quant needs for T tokens of K columns (0 when unused).
  size_t (*prep_bytes)(DType type, int64_t T, int64_t K);
  /// Fills corr (int32 [T, nb], from `sums` [T, nb]) and prep (prep_bytes) for tokens [t0, t1)
  /// of the a.T tokens of a.xq, for weight type `type`; threads may fill disjoint token ranges
  /// at once. The caller then points a.corr and a.prep at them.
  void (*prepare_quant)(DType type, const QuantActs& a, const int32_t* sums, int64_t t0, int64_t t1, int32_t* corr,
                        uint8_t* prep);
  /// Bytes of per-thread scratch (64-aligned by the caller) matmul_quant needs for K columns.
  size_t (*thread_bytes)(DType type, int64_t T, int64_t K);
  /// y[t, r] for rows r in [r0, r1) and all tokens of a quantized weight (any block type).
  void (*matmul_quant)(float* y, const QuantActs& a, const Weight& w, int64_t r0, int64_t r1, uint8_t* scratch);
  /// Σ a[i]·b[i] in fp32 (vector lanes, fixed reduction order).
  float (*dot)(const float* a, const float* b, int64_t n);
  /// y[i] += a · x[i].
  void (*axpy)(float* y, float a, const float* x, int64_t n);
  /// llmq::attn_scores (keys transposed, [hd, bt] per block; same summation order).
  void (*attn_scores)(float* s, int64_t ss, const float* q, int64_t G, const float* kT, int64_t n, int64_t bt, int64_t hd,
                      float scale);
  /// llmq::attn_accumulate (positions in order, one fused multiply-add per term).
  void (*attn_accumulate)(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride,
                          int64_t hd);
  /// llmq::attn_scores_bf16 and llmq::attn_accumulate_bf16: `vdpbf16ps` at the AVX-512 level
  /// when the CPU has AVX512_BF16, else the AVX2 versions (pairs widened by shift and mask, FMAs).
  void (*attn_scores_bf16)(float* s, int64_t ss, const uint16_t* q, int64_t G, const uint16_t* k, int64_t n, int64_t bt,
                           int64_t hd, float scale);
  void (*attn_accumulate_bf16)(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n,
                               int64_t hd);
  /// llmq::to_bf16 (`vcvtneps2bf16`, which flushes denormals to zero); null without AVX512_BF16.
  void (*to_bf16)(uint16_t* dst, const float* src, int64_t n);
  /// llmq::softmax with a vector e^x (about 2 ulp) and an fp32 lane sum.
  float (*softmax)(float* x, int64_t n, float* max_out);
  /// llmq::swiglu with the same vector e^x.
  void (*swiglu)(float* gate, const float* up, int64_t n);
  /// llmq::geglu as g·sigmoid(2·√(2/π)·(g + 0.044715·g³)) (the same function) with that e^x.
  void (*geglu)(float* gate, const float* up, int64_t n);
  /// Bytes of a [rows, cols] weight of `type` in this level's packed layout (0: not packed for
  /// this type). Null when the level has no packed layout.
  size_t (*packed_bytes)(DType type, int64_t rows, int64_t cols);
  /// Writes w (type with packed_bytes > 0) in the packed layout to out (64-byte aligned,
  /// packed_bytes(...) bytes); matmul_quant then reads w.packed instead of w.data.
  void (*pack_quant)(const Weight& w, uint8_t* out);
  /// `rounds` rounds of 12 independent vpdpbusd (zmm: 64 unsigned × signed byte products
  /// added into int32 lanes), the instruction the packed GEMM is built on, with nothing else:
  /// the int8 multiply-add peak of one core is 12 · 64 · rounds / seconds (AVX2: 24 vpmaddubsw ymm
  /// + vpaddw per round, the same product count). Returns a value
  /// that depends on every result. Null when the level has no such loop.
  int64_t (*int8_dot_loop)(int64_t rounds);
  /// Rows per panel of the packed layout (two AVX2 panels make the matmul's 16-row unit).
  int packed_rows;
};

/// True when the CPU (and OS) supports AVX2, FMA and F16C.
bool cpu_has_avx2();
/// True when the CPU (and OS) supports AVX-512 F, BW, VL, DQ and VNNI, plus the AVX2 set.
bool cpu_has_avx512();
/// True when the CPU also has AVX512_BF16 (`vdpbf16ps`, the bf16 KV-cache attention kernels).
bool cpu_has_avx512bf16();
/// The AVX2 kernel table, or nullptr on non-x86 builds. Call only if cpu_has_avx2().
const Kernels* kernels_avx2();
/// The AVX-512 kernel table, or nullptr on non-x86 builds. Call only if cpu_has_avx512().
const Kernels* kernels_avx512();

}  // namespace llmq::x86
