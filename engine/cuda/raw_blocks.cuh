// Weights of the types the device keeps in the file's own block layout ("raw": IQ4_NL, Q2_K,
// Q3_K; formats/quant.h has the layouts), decoded one 32-weight block at a time. (Q4_K, Q5_K and
// Q6_K have split layouts, engine/cuda/matmul.h; raw_block_bytes still sizes their file blocks
// for the gemv_k lab.)
// The CPU reference is formats/quant.h's decode_quant_block / dequantize_row: the same
// w = a·(q − o) − m per weight (the device may fuse the multiply and subtract into an FMA).
// Bytes are read one at a time, so a row needs no alignment.
#pragma once
#include "engine/cuda/common.cuh"
#include "engine/cuda/matmul.h"
#include "formats/quant.h"

namespace llmq::cuda {

/// Bytes of one block of raw type t: 32 weights (IQ4_NL) or a 256-weight super-block (the
/// K-quants); formats/quant.h's sizeof(Block...), usable in device code and constant expressions.
__host__ __device__ constexpr int raw_block_bytes(DType t) {
  return t == DType::IQ4_NL ? 18 : t == DType::Q2_K ? 84 : t == DType::Q3_K ? 110 : t == DType::Q4_K ? 144 : t == DType::Q5_K ? 176 : 210;
}
/// Weights per block of raw type t.
__host__ __device__ constexpr int raw_block_weights(DType t) { return t == DType::IQ4_NL ? 32 : 256; }

/// Bytes of a row of `cols` weights of raw type t (formats/quant.h's row_bytes, on either side).
__host__ __device__ constexpr int64_t raw_row_bytes(DType t, int64_t cols) { return cols / raw_block_weights(t) * raw_block_bytes(t); }

/// Byte offset of the nibbles qs in an IQ4_NL block (after its fp16 d).
constexpr int kIQ4NLQs = 2;

/// 2n bytes at a 2-byte-aligned address p as n little-endian words (Q3_K, Q6_K and IQ4_NL rows
/// are only 2-byte aligned: their blocks are 110, 210 and 18 bytes).
template <int N>
__device__ __forceinline__ void ld_words2(const uint8_t* p, uint32_t* out) {
  const auto* v = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = uint32_t(__ldg(v + 2 * i)) | uint32_t(__ldg(v + 2 * i + 1)) << 16;
}

__device__ __forceinline__ float half_at(const uint8_t* p) { return fp16_bits_to_float(uint16_t(p[0] | (p[1] << 8))); }

// IQ4_NL's levels 0-7 and 8-15 as bytes of two words, computed on the host from formats/quant.h's
// kIQ4NLValues (integral constants, which device code may read; the array it may not).
constexpr uint64_t kIQ4NLWordLo = iq4_nl_levels_word(0), kIQ4NLWordHi = iq4_nl_levels_word(1);

/// IQ4_NL's level i, 0 <= i < 16, looked up in registers.
__device__ __forceinline__ int iq4_nl_level(uint32_t i) { return int(int8_t(((i & 8) ? kIQ4NLWordHi : kIQ4NLWordLo) >> (8 * (i & 7)))); }
/// The low nibbles of v's four bytes as their IQ4_NL levels, one int8 per byte (for dp4a / mma).
__device__ __forceinline__ uint32_t iq4_nl_level_bytes(uint32_t v) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) out |= uint32_t(uint8_t(iq4_nl_level((v >> (8 * i)) & 15))) << (8 * i);
  return out;
}

/// The 32 weights of block b (weights 32b .. 32b+31) of a row of raw type t, as fp32 into w[32].
__device__ inline void raw_block(DType t, const uint8_t* row, int64_t b, float* w) {
  if (t == DType::IQ4_NL) {
    const uint8_t* blk = row + b * raw_block_bytes(DType::IQ4_NL);
    const float d = half_at(blk);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * float(iq4_nl_level(blk[kIQ4NLQs + i] & 15));
      w[i + 16] = d * float(iq4_nl_level(blk[kIQ4NLQs + i] >> 4));
    }
  } else if (t == DType::Q2_K) {
    const uint8_t* blk = row + (b / 8) * raw_block_bytes(t);
    const int j = int(b % 8);
    const float d = half_at(blk + 80), dmin = half_at(blk + 82);
    const float a0 = d * float(blk[2 * j] & 15), a1 = d * float(blk[2 * j + 1] & 15);
    const float m0 = dmin * float(blk[2 * j] >> 4), m1 = dmin * float(blk[2 * j + 1] >> 4);
    for (int l = 0; l < 32; ++l) {
      const int q = k_crumb(blk + 16, j, l);
      w[l] = l < 16 ? a0 * float(q) - m0 : a1 * float(q) - m1;
    }
  } else {  // Q3_K
    const uint8_t* blk = row + (b / 8) * raw_block_bytes(t);
    const int j = int(b % 8);
    const float d = half_at(blk + 108);
    const float a0 = d * float(q3_k_scale(blk + 96, 2 * j) - 32), a1 = d * float(q3_k_scale(blk + 96, 2 * j + 1) - 32);
    for (int l = 0; l < 32; ++l) {
      const int q = k_crumb(blk + 32, j, l) | ((blk[l] >> j) & 1) << 2;
      w[l] = (l < 16 ? a0 : a1) * float(q - 4);
    }
  }
}

}  // namespace llmq::cuda
