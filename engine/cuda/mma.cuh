// Tensor-core and asynchronous-copy primitives (sm_80 and later) for the kernel files, with
// their CPU definitions in the emulator's build (engine/cuda/emu/emu.h).
//   cp_async16 / cp_async8 / cp_async4: global -> shared copies that run while the thread goes
//     on (PTX ISA 8, "cp.async"); commit groups them, wait<N> blocks until at most N of the
//     newest groups are still in flight. The emulator copies at once.
//   mma_s8 / mma_u8s8: one warp-wide D = A B + D of int8 tiles, A [16 x 32], B [32 x 8], D
//     [16 x 8] int32 ("mma.sync.aligned.m16n8k32", PTX ISA, section "Matrix Fragments for
//     mma.m16n8k32"). Fragments, with g = lane / 4 and c = lane % 4:
//       a[0]: A row g, k 4c..4c+3     a[1]: row g + 8, k 4c..4c+3
//       a[2]: A row g, k 16+4c..+3    a[3]: row g + 8, k 16+4c..+3
//       b[0]: B column g, k 4c..4c+3  b[1]: column g, k 16+4c..+3
//       d[0], d[1]: D row g, columns 2c, 2c+1;  d[2], d[3]: row g + 8, the same columns
//     (four bytes per register, the lowest k in the lowest byte).
//   mma_f16: D [16 x 8] fp32 += A [16 x 16] fp16 · B [16 x 8] fp16 ("mma.sync.aligned.m16n8k16",
//     "Matrix Fragments for mma.m16n8k16 with floating point type"), two halves per register,
//     the lower column (A) or k (B) in the low half:
//       a[0]: A row g, k 2c, 2c+1     a[1]: row g + 8, k 2c, 2c+1
//       a[2]: A row g, k 8+2c, +1     a[3]: row g + 8, k 8+2c, +1
//       b[0]: B k 2c, 2c+1, column g  b[1]: k 8+2c, 8+2c+1, column g;  d as for mma_s8.
//   ldmatrix_x4_trans: four 8 x 8 fp16 matrices from shared memory, transposed ("ldmatrix ...
//     .trans"): lanes 8m .. 8m+7 give the addresses of matrix m's 8 rows (16 bytes each); lane L
//     receives in r[m] the elements (row 2 (L % 4), column L / 4) and (row 2 (L % 4) + 1,
//     column L / 4) of matrix m: a B fragment of mma_f16 from a row-major [k][n] tile.
//   ldmatrix_x4: the same four matrices untransposed: lane L receives in r[m] the elements (row
//     L / 4, columns 2 (L % 4), 2 (L % 4) + 1) of matrix m: a B fragment of mma_f16 from a
//     row-major [n][k] tile (one token's activations a row).
#pragma once
#include <cstdint>
#include <cstring>

#include "engine/cuda/common.cuh"

namespace llmq::cuda {

#ifdef LLMQ_CUDA_EMU

template <int kBytes>
inline void cp_async(void* smem, const void* gmem, int src_bytes) {
  std::memcpy(smem, gmem, size_t(src_bytes));
  if (src_bytes < kBytes) std::memset(static_cast<char*>(smem) + src_bytes, 0, size_t(kBytes - src_bytes));
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

// Every lane leaves its fragments in the warp's exchange area, then computes its own four
// results from all 32 lanes' (the layout above).
template <bool kUnsignedA>
inline void mma_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint64_t* x = emu::warp_exchange();  // [32][8]
  const int lane = emu::lane();
  std::memcpy(x + lane * 8, a, 16);
  std::memcpy(x + lane * 8 + 2, b, 8);
  emu::sync_warp();
  auto A = [&](int row, int k) {  // element (row, k) of A: lane (row % 8) * 4 + (k % 16) / 4
    const int l = (row % 8) * 4 + (k % 16) / 4, reg = (row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0);
    const uint8_t byte = reinterpret_cast<const uint8_t*>(x + l * 8)[reg * 4 + k % 4];
    return kUnsignedA ? int(byte) : int(int8_t(byte));
  };
  auto B = [&](int k, int col) {
    const int l = col * 4 + (k % 16) / 4, reg = k >= 16 ? 1 : 0;
    return int(int8_t(reinterpret_cast<const uint8_t*>(x + l * 8 + 2)[reg * 4 + k % 4]));
  };
  const int g = lane / 4, c = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
    int s = 0;
    for (int k = 0; k < 32; ++k) s += A(row, k) * B(k, col);
    d[i] += s;
  }
  emu::sync_warp();  // every lane has read before the area is written again
}

inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint64_t* x = emu::warp_exchange();  // [32][8]
  const int lane = emu::lane();
  std::memcpy(x + lane * 8, a, 16);
  std::memcpy(x + lane * 8 + 2, b, 8);
  emu::sync_warp();
  auto half_at = [&](int l, int reg, int hi) {  // half `hi` of register `reg` (a: 0..3, b: 4..5) of lane l
    uint32_t w;
    std::memcpy(&w, reinterpret_cast<const uint8_t*>(x + l * 8) + reg * 4, 4);
    return __half2float(__ushort_as_half(uint16_t(hi ? w >> 16 : w & 0xffffu)));
  };
  auto A = [&](int row, int k) { return half_at((row % 8) * 4 + (k % 8) / 2, (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k % 2); };
  auto B = [&](int k, int col) { return half_at(col * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k % 2); };
  const int g = lane / 4, c = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
    d[i] += s;
  }
  emu::sync_warp();
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) {
  uint64_t* x = emu::warp_exchange();
  const int lane = emu::lane();
  std::memcpy(x + lane * 8, &addr, sizeof addr);
  emu::sync_warp();
  for (int m = 0; m < 4; ++m) {
    uint16_t e[2];
    for (int k = 0; k < 2; ++k) {
      const void* row;
      std::memcpy(&row, x + (8 * m + 2 * (lane % 4) + k) * 8, sizeof row);
      std::memcpy(&e[k], static_cast<const uint8_t*>(row) + 2 * (lane / 4), 2);
    }
    r[m] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
  }
  emu::sync_warp();
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* addr) {
  uint64_t* x = emu::warp_exchange();
  const int lane = emu::lane();
  std::memcpy(x + lane * 8, &addr, sizeof addr);
  emu::sync_warp();
  for (int m = 0; m < 4; ++m) {
    const void* row;
    std::memcpy(&row, x + (8 * m + lane / 4) * 8, sizeof row);
    std::memcpy(&r[m], static_cast<const uint8_t*>(row) + 4 * (lane % 4), 4);
  }
  emu::sync_warp();
}

#else

template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int src_bytes) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(kBytes), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool kUnsignedA>
__device__ __forceinline__ void mma_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (kUnsignedA)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* addr) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

#endif

/// Two floats as fp16 in one register, lo in the low half (round to nearest).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  return uint32_t(__half_as_ushort(__float2half(lo))) | (uint32_t(__half_as_ushort(__float2half(hi))) << 16);
}

/// 16 bytes (cp.async.cg), or 8 / 4 (cp.async.ca); src_bytes < size: the rest zero-filled.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes = 16) { cp_async<16>(smem, gmem, src_bytes); }
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, int src_bytes = 8) { cp_async<8>(smem, gmem, src_bytes); }
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes = 4) { cp_async<4>(smem, gmem, src_bytes); }
/// int8 A (signed), int8 B.
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_16832<false>(d, a, b); }
/// uint8 A (e.g. 4-bit quants 0..15), int8 B.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_16832<true>(d, a, b); }

}  // namespace llmq::cuda
