// Matrix products on the GPU (engine/cuda/matmul.h): the split weight layout, activation
// quantization, the GEMV kernels of decode and the cuBLAS path of prefill.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>

#include "engine/cuda/act_q8.cuh"
#include "engine/cuda/common.cuh"
#include "engine/cuda/gemv.cuh"
#include "engine/cuda/matmul.h"
#include "engine/cuda/raw_blocks.cuh"
#include "base/env_setting.h"
#include "base/error.h"
#include "base/threadpool.h"

namespace llmq::cuda {

namespace {

bool is_block_type(DType t) { return is_quantized(t) && !is_raw_type(t); }  // the split layout: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K

// Bytes of one row of the q array.
size_t q_row_bytes(DType t, int64_t cols) {
  switch (t) {
    case DType::Q8_0: return size_t(cols);
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: return size_t(cols / 2);
    case DType::F32: return size_t(cols) * 4;
    case DType::F16:
    case DType::BF16: return size_t(cols) * 2;
    default: return row_bytes(t, cols);  // raw types: the file's rows (raw_blocks.cuh)
  }
}

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw CudaError(std::string(what) + ": " + cublasGetStatusString(st));
}

}  // namespace

// ---------------------------------------------------------------- layout

uint64_t split_weight_bytes(DType t, int64_t rows, int64_t cols) { return uint64_t(rows) * cuda_row_bytes(t, cols); }

namespace {

// Q4_K's and Q5_K's super-blocks (formats/quant.h BlockQ4_K, BlockQ5_K: the same header, then
// Q5_K's qh, then qs) between the file layout and the split one (matmul.h DeviceWeight): q in
// Q4_0's nibble order per sub-block (the file's sub-block j is the nibble j % 2 of qs[32 (j / 2),
// + 32)), Q5_K's h word of sub-block j bit l = bit j of qh[l], d the sub-blocks' sc | mn << 8,
// k d and dmin.
void move_q45k(bool five, uint8_t* file, int64_t rows, int64_t cols, uint8_t* split, bool to_split, int64_t r0, int64_t r1) {
  const int64_t nsb = cols / 256, nb = cols / 32;
  const size_t bb = five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K), qs_at = five ? 48 : 16;
  auto* h = reinterpret_cast<uint32_t*>(split + size_t(rows) * size_t(cols / 2));  // Q5_K only
  auto* d = reinterpret_cast<uint16_t*>(h + (five ? size_t(rows * nb) : 0));
  uint16_t* k = d + size_t(rows * nb);
  for (int64_t i = r0 * nsb; i < r1 * nsb; ++i) {  // super-block i: row i / nsb
    uint8_t* blk = file + size_t(i) * bb;
    auto* hdr = reinterpret_cast<BlockQ4_K*>(blk);  // d, dmin, scales: the same in Q5_K
    uint8_t *qs = blk + qs_at, *qh = blk + 16;
    uint16_t* sm = d + 8 * i;
    uint8_t* nib = split + 128 * size_t(i);  // rows are whole super-blocks: q's offset is 128 i
    int sc[8], mn[8];
    if (to_split) {
      k[2 * i] = hdr->d, k[2 * i + 1] = hdr->dmin;
      for (int j = 0; j < 8; ++j) k_quant_scale_min(j, hdr->scales, &sc[j], &mn[j]), sm[j] = uint16_t(sc[j] | mn[j] << 8);
    } else {
      hdr->d = k[2 * i], hdr->dmin = k[2 * i + 1];
      for (int j = 0; j < 8; ++j) sc[j] = sm[j] & 63, mn[j] = (sm[j] >> 8) & 63;
      k_quant_pack_scale_min(sc, mn, hdr->scales);
      std::memset(qs, 0, 128);
      if (five) std::memset(qh, 0, 32);
    }
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < 16; ++l) {  // split byte 16 j + l: weights l (low nibble) and l + 16 of sub-block j
        uint8_t* pair = qs + 32 * (j / 2) + l;
        const int sh = 4 * (j % 2);
        if (to_split) nib[16 * j + l] = uint8_t(((pair[0] >> sh) & 15) | ((pair[16] >> sh) & 15) << 4);
        else pair[0] |= uint8_t((nib[16 * j + l] & 15) << sh), pair[16] |= uint8_t((nib[16 * j + l] >> 4) << sh);
      }
      if (!five) continue;
      uint32_t& word = h[8 * i + j];
      if (to_split) word = 0;
      for (int l = 0; l < 32; ++l) {
        if (to_split) word |= uint32_t((qh[l] >> j) & 1) << l;
        else qh[l] |= uint8_t(((word >> l) & 1) << j);
      }
    }
  }
}

// Q6_K's super-blocks (formats/quant.h BlockQ6_K) between the file layout and the split one:
// weight w's 6-bit quant (the file's ql nibble and qh crumb) to q's nibble in Q4_0's order and
// h's crumb (byte w % 8 of its block's 8, bits 2 (w / 8) within the block), the two int8 scales
// of each 32-weight block to one d word, the super-block's d to k (then a zero half).
void move_q6k(uint8_t* file, int64_t rows, int64_t cols, uint8_t* split, bool to_split, int64_t r0, int64_t r1) {
  const int64_t nsb = cols / 256, nb = cols / 32;
  uint8_t* h = split + size_t(rows) * size_t(cols / 2);
  auto* d = reinterpret_cast<uint16_t*>(h + size_t(rows * nb) * 8);
  uint16_t* k = d + size_t(rows * nb);
  for (int64_t i = r0 * nsb; i < r1 * nsb; ++i) {  // super-block i: q bytes 128 i.., h bytes 64 i.., d words 8 i..
    auto* blk = reinterpret_cast<BlockQ6_K*>(file + size_t(i) * sizeof(BlockQ6_K));
    uint8_t *nib = split + 128 * size_t(i), *hi = h + 64 * size_t(i);
    uint16_t* sc = d + 8 * i;
    if (to_split) {
      k[2 * i] = blk->d, k[2 * i + 1] = 0, std::memset(nib, 0, 128), std::memset(hi, 0, 64);
      for (int b = 0; b < 8; ++b) sc[b] = uint16_t(uint8_t(blk->scales[2 * b]) | uint8_t(blk->scales[2 * b + 1]) << 8);
    } else {
      blk->d = k[2 * i], std::memset(blk->ql, 0, sizeof(blk->ql)), std::memset(blk->qh, 0, sizeof(blk->qh));
      for (int b = 0; b < 8; ++b) blk->scales[2 * b] = int8_t(sc[b] & 0xff), blk->scales[2 * b + 1] = int8_t(sc[b] >> 8);
    }
    for (int w = 0; w < 256; ++w) {
      const int n = w / 128, g = w % 128 / 32, l = w % 32, b = w / 32;  // formats/quant.h: half n, quarter g
      uint8_t& ql = blk->ql[64 * n + 32 * (g % 2) + l];
      uint8_t& qh = blk->qh[32 * n + l];
      uint8_t& sq = nib[16 * b + l % 16];
      uint8_t& sh = hi[8 * b + l % 8];
      if (to_split) {
        sq |= uint8_t(((ql >> (4 * (g / 2))) & 15) << (4 * (l / 16)));
        sh |= uint8_t(((qh >> (2 * g)) & 3) << (2 * (l / 8)));
      } else {
        ql |= uint8_t(((sq >> (4 * (l / 16))) & 15) << (4 * (g / 2)));
        qh |= uint8_t(((sh >> (2 * (l / 8))) & 3) << (2 * g));
      }
    }
  }
}

// Moves rows [r0, r1) of a [rows, cols] block-quantized matrix between the file layout (`file`)
// and the split one (`split`): to_split true copies file -> split, false split -> file.
void move_rows(DType t, uint8_t* file, int64_t rows, int64_t cols, uint8_t* split, bool to_split, int64_t r0, int64_t r1) {
  if (split_k_affine(t)) return move_q45k(t == DType::Q5_K, file, rows, cols, split, to_split, r0, r1);
  if (t == DType::Q6_K) return move_q6k(file, rows, cols, split, to_split, r0, r1);
  const size_t rb = row_bytes(t, cols);
  const int64_t nb = cols / QK;
  const size_t qrow = q_row_bytes(t, cols), bb = dtype_info(t).block_bytes, qb = t == DType::Q8_0 ? QK : QK / 2;
  uint8_t* q = split;
  uint8_t* h = split + size_t(rows) * qrow;                  // [rows, nb] uint32 (Q5_0, Q5_1)
  uint8_t* d = h + (split_has_h(t) ? size_t(rows * nb) * 4 : 0);  // [rows, nb] fp16
  uint8_t* m = d + size_t(rows * nb) * 2;                    // [rows, nb] fp16 (Q4_1, Q5_1)
  auto move = [to_split](uint8_t* in_file, uint8_t* in_split, size_t n) {
    if (to_split) std::memcpy(in_split, in_file, n);
    else std::memcpy(in_file, in_split, n);
  };
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b) {  // a file block: d, then m (Q4_1, Q5_1), qh (Q5), the quants
      uint8_t* blk = file + size_t(r) * rb + size_t(b) * bb;
      const size_t i = size_t(r * nb + b);
      move(blk, d + 2 * i, 2);
      size_t head = 2;
      if (split_has_m(t)) move(blk + head, m + 2 * i, 2), head += 2;
      if (split_has_h(t)) move(blk + head, h + 4 * i, 4), head += 4;
      move(blk + head, q + size_t(r) * qrow + size_t(b) * qb, qb);
    }
}

// Moves every block of a [rows, cols] matrix (move_rows), the rows split over a ThreadPool of up
// to 16 host threads (one per 256 rows): a 7B Q4_K_M file's billions of K-quant weights are
// rebuilt one by one, which took ~5.5 s of a GPU load on one core (bench/RESULTS.md, seventh GPU
// session). Each chunk writes its own rows of every array.
void move_blocks(DType t, uint8_t* file, int64_t rows, int64_t cols, uint8_t* split, bool to_split) {
  if (!is_block_type(t)) {
    const size_t n = size_t(rows) * row_bytes(t, cols);
    if (to_split) std::memcpy(split, file, n);
    else std::memcpy(file, split, n);
    return;
  }
  const int64_t threads = std::min<int64_t>({16, int64_t(std::max(1u, std::thread::hardware_concurrency())), rows / 256});
  if (threads <= 1) return move_rows(t, file, rows, cols, split, to_split, 0, rows);
  ThreadPool pool{int(threads)};
  pool.parallel_for(rows, [&](int64_t r0, int64_t r1, int) { move_rows(t, file, rows, cols, split, to_split, r0, r1); });
}

}  // namespace

void split_weight(DType t, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  move_blocks(t, const_cast<uint8_t*>(src), rows, cols, dst, true);  // reads src only
}

void unsplit_weight(DType t, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  move_blocks(t, dst, rows, cols, const_cast<uint8_t*>(src), false);  // reads src only
}

DeviceWeight split_weight_view(DType t, int64_t rows, int64_t cols, const uint8_t* base) {
  DeviceWeight w;
  w.type = t, w.rows = rows, w.cols = cols, w.q = base;
  if (is_block_type(t)) {
    const int64_t nb = rows * (cols / QK);
    const uint8_t* after_q = base + size_t(rows) * q_row_bytes(t, cols);
    if (split_h_words(t)) w.h = reinterpret_cast<const uint32_t*>(after_q);
    w.d = reinterpret_cast<const uint16_t*>(after_q + 4 * split_h_words(t) * nb);
    if (split_has_m(t)) w.m = w.d + nb;
    if (split_has_k(t)) w.k = w.d + nb;
  }
  return w;
}

DeviceWeight weight_rows(const DeviceWeight& w, int64_t r0, int64_t n) {
  DeviceWeight v = w;
  v.rows = n;
  v.q = w.q + size_t(r0) * q_row_bytes(w.type, w.cols);
  if (w.d) v.d = w.d + r0 * (w.cols / QK);
  if (w.m) v.m = w.m + r0 * (w.cols / QK);
  if (w.h) v.h = w.h + r0 * (w.cols / QK) * split_h_words(w.type);
  if (w.k) v.k = w.k + r0 * (w.cols / 256) * 2;
  return v;
}

// ---------------------------------------------------------------- random weights

namespace {

__device__ __forceinline__ uint32_t hash32(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return uint32_t((x ^ (x >> 31)) >> 16);
}
__device__ __forceinline__ float uniform01(uint64_t seed, uint64_t i) { return float(hash32(seed * 0x100000001b3ull + i) >> 8) * (1.0f / 16777216.0f); }

__global__ void fill_bytes_kernel(uint8_t* p, uint64_t n, uint64_t seed) {
  pdl_begin();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(hash32(seed * 0x100000001b3ull + i));
}

// kind 0: fp32 values, 1: fp16 values, 2: bf16 values (all in ±amp); 3: fp16 values in amp·[0.5, 1.5).
__global__ void fill_values_kernel(void* p, uint64_t n, uint64_t seed, int kind, float amp) {
  pdl_begin();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const float u = uniform01(seed, i);
    if (kind == 0) static_cast<float*>(p)[i] = (2.0f * u - 1.0f) * amp;
    else if (kind == 1) static_cast<__half*>(p)[i] = __float2half((2.0f * u - 1.0f) * amp);
    else if (kind == 2) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16((2.0f * u - 1.0f) * amp);
    else static_cast<__half*>(p)[i] = __float2half((0.5f + u) * amp);
  }
}

__global__ void neg_scaled_kernel(uint16_t* dst, const uint16_t* src, uint64_t n, float k) {  // dst = -k * src (fp16)
  pdl_begin();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = __half_as_ushort(__float2half(-k * fp16_bits_to_float(src[i])));
}

// One fp16 field per block of block_bytes (at byte `off`, 2-byte aligned): amp·[0.5, 1.5).
__global__ void fill_block_half_kernel(uint8_t* p, uint64_t n_blocks, int block_bytes, int off, uint64_t seed, float amp) {
  pdl_begin();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n_blocks; i += uint64_t(gridDim.x) * blockDim.x)
    *reinterpret_cast<uint16_t*>(p + i * block_bytes + off) = __half_as_ushort(__float2half((0.5f + uniform01(seed, i)) * amp));
}

// The two-level scales of the split K-quants: each 32-weight block's word of small scales
// (hash bits & mask: Q4_K's / Q5_K's sc and mn in 0..63, Q6_K's two int8), each super-block's
// pair of fp16 (Q4_K / Q5_K d and dmin, Q6_K d and its zero padding) in amp0·[0.5, 1.5) and
// amp1·[0.5, 1.5).
__global__ void fill_k_scales_kernel(uint16_t* sc, uint16_t* k, uint64_t n_blocks, uint64_t seed, uint16_t mask, float amp0, float amp1) {
  pdl_begin();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n_blocks; i += uint64_t(gridDim.x) * blockDim.x) {
    sc[i] = uint16_t(hash32(seed * 0x100000001b3ull + i) & mask);
    for (int h = 0; h < 2 && i % 8 == 0; ++h)  // amp 0: a zero half (Q6_K's padding)
      k[i / 8 * 2 + h] = __half_as_ushort(__float2half((0.5f + uniform01(seed + 1 + h, i)) * (h ? amp1 : amp0)));
  }
}

constexpr int kFillBlocks = 1024, kFillThreads = 256;

// The fp16 fields of a raw type's block (formats/quant.h layouts) and their scale of values, for
// random quants (uniform bytes): weights of about 0.01-0.02 in magnitude, as fill_random's others.
struct RawHalves {
  int off_d;
  float d;
  int off_m;  // -1: none
  float m;    // the K-quants' dmin (subtracted)
};
RawHalves raw_halves(DType t) {
  switch (t) {
    case DType::IQ4_NL: return {0, 1.5e-4f, -1, 0};
    case DType::Q2_K: return {80, 1.5e-3f, 82, 1.5e-3f};
    default: return {108, 2e-4f, -1, 0};  // Q3_K
  }
}

}  // namespace

void fill_random(const DeviceWeight& w, uint64_t seed, cudaStream_t s) {
  const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols), nb = n / QK;
  auto* q = const_cast<uint8_t*>(w.q);
  if (is_raw_type(w.type)) {  // the file's blocks: random bytes, then sane fp16 scales over them
    const RawHalves h = raw_halves(w.type);
    const int bb = raw_block_bytes(w.type);
    const uint64_t bytes = uint64_t(w.rows) * row_bytes(w.type, w.cols), blocks = bytes / uint64_t(bb);
    LLMQ_LAUNCH(fill_bytes_kernel, kFillBlocks, kFillThreads, 0, s)(q, bytes, seed);
    LLMQ_LAUNCH(fill_block_half_kernel, kFillBlocks, kFillThreads, 0, s)(q, blocks, bb, h.off_d, seed + 1, h.d);
    if (h.off_m >= 0) LLMQ_LAUNCH(fill_block_half_kernel, kFillBlocks, kFillThreads, 0, s)(q, blocks, bb, h.off_m, seed + 2, h.m);
    check_launch("fill_random");
    return;
  }
  auto* d = const_cast<uint16_t*>(w.d);
  switch (w.type) {
    case DType::F32: LLMQ_LAUNCH(fill_values_kernel, kFillBlocks, kFillThreads, 0, s)(q, n, seed, 0, 0.03f); break;
    case DType::F16: LLMQ_LAUNCH(fill_values_kernel, kFillBlocks, kFillThreads, 0, s)(q, n, seed, 1, 0.03f); break;
    case DType::BF16: LLMQ_LAUNCH(fill_values_kernel, kFillBlocks, kFillThreads, 0, s)(q, n, seed, 2, 0.03f); break;
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1: {
      LLMQ_LAUNCH(fill_bytes_kernel, kFillBlocks, kFillThreads, 0, s)(q, w.type == DType::Q8_0 ? n : n / 2, seed);
      if (w.h) LLMQ_LAUNCH(fill_bytes_kernel, kFillBlocks, kFillThreads, 0, s)(reinterpret_cast<uint8_t*>(const_cast<uint32_t*>(w.h)), 4 * nb, seed + 3);
      // |q| averages ~64 (Q8_0), ~4 (Q4_0 centred on 8) or ~8 (Q5_0 on 16): weights of about 0.01-0.02.
      const float amp = w.type == DType::Q8_0 ? 2.5e-4f : w.h ? 1.5e-3f : 4e-3f;
      LLMQ_LAUNCH(fill_values_kernel, kFillBlocks, kFillThreads, 0, s)(d, nb, seed + 1, 3, amp);
      if (w.m)  // m = -8 d (Q4_1) or -16 d (Q5_1): the weights centred on zero, as Q4_0's and Q5_0's
        LLMQ_LAUNCH(neg_scaled_kernel, kFillBlocks, kFillThreads, 0, s)(const_cast<uint16_t*>(w.m), w.d, nb, w.h ? 16.0f : 8.0f);
      break;
    }
    case DType::Q4_K:  // sc ~ 32 and q ~ 7.5 (Q5_K ~ 15.5) against d 5e-5 (2.5e-5), mn ~ 32 against dmin 2.5e-4: weights of about 0.01
    case DType::Q5_K:
      LLMQ_LAUNCH(fill_bytes_kernel, kFillBlocks, kFillThreads, 0, s)(q, n / 2 + (w.h ? n / 8 : 0), seed);  // q (and h, back to back)
      LLMQ_LAUNCH(fill_k_scales_kernel, kFillBlocks, kFillThreads, 0, s)(d, const_cast<uint16_t*>(w.k), nb, seed + 1, uint16_t(0x3f3f),
                                                                         w.h ? 2.5e-5f : 5e-5f, 2.5e-4f);
      break;
    case DType::Q6_K:  // |sc| ~ 64 and |q - 32| ~ 16 against d 1e-5: weights of about 0.01
      LLMQ_LAUNCH(fill_bytes_kernel, kFillBlocks, kFillThreads, 0, s)(q, n / 2 + n / 4, seed);  // q and h, back to back
      LLMQ_LAUNCH(fill_k_scales_kernel, kFillBlocks, kFillThreads, 0, s)(d, const_cast<uint16_t*>(w.k), nb, seed + 1, uint16_t(0xffff), 1e-5f,
                                                                         0.0f);
      break;
    default: break;  // raw types above
  }
  check_launch("fill_random");
}

// ---------------------------------------------------------------- activation quantization

namespace {

// One warp per block of 32 activations (act_q8.cuh's rule).
__global__ void quantize_act_kernel(const float* __restrict__ x, DeviceActQ8 q, int64_t n_blocks) {
  pdl_begin();
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;  // whole warps leave together
  const float v[1] = {x[b * 32 + lane]};
  quantize_act_block<1>(v, b, lane, true, q);
}

}  // namespace

void quantize_act(const float* x, const DeviceActQ8& out, int64_t T, int64_t cols, cudaStream_t s) {
  const int64_t n_blocks = T * cols / QK;
  if (n_blocks == 0) return;
  const int threads = 256;
  const int64_t grid = (n_blocks * 32 + threads - 1) / threads;
  LLMQ_LAUNCH(quantize_act_kernel, unsigned(grid), threads, 0, s)(x, out, n_blocks);
  check_launch("quantize_act");
}

// ---------------------------------------------------------------- GEMV (decode)

namespace {


// acc += row r's dot with one token over one quant block (the formulas above gemv_block_kernel):
// w0 (and w1, Q8_0) the block's quant bytes, dw / mw its scale and minimum, hw its fifth bits;
// x0, x1 the token's 32 int8 activations, dx their scale, sx d_x Σ q_x.
template <DType kType, int R>
__device__ __forceinline__ void gemv_block_dot(float& acc, const uint4 (&w0)[R], const uint4 (&w1)[R], const float (&dw)[R],
                                               const float (&mw)[R], const uint32_t (&hw)[R], int r, int4 x0, int4 x1, float dx,
                                               float sx) {
  constexpr bool kQ5 = split_has_h(kType), kMin = split_has_m(kType) || split_k_affine(kType);
  if constexpr (kType == DType::Q8_0) {
    acc += dw[r] * dx * float(dp4a4(w1[r], x1, dp4a4(w0[r], x0, 0)));
  } else if constexpr (kType == DType::Q6_K) {  // w1.x / .y: the crumbs of weights j, j + 8, j + 16, j + 24 in byte j % 8
    const uint4 v = w0[r];
    const uint32_t c0 = w1[r].x, c1 = w1[r].y;
    const uint4 lo = make_uint4(q6_bytes(v.x & 0x0f0f0f0fu, c0), q6_bytes(v.y & 0x0f0f0f0fu, c1), q6_bytes(v.z & 0x0f0f0f0fu, c0 >> 2),
                                q6_bytes(v.w & 0x0f0f0f0fu, c1 >> 2));
    const uint4 hi = make_uint4(q6_bytes((v.x >> 4) & 0x0f0f0f0fu, c0 >> 4), q6_bytes((v.y >> 4) & 0x0f0f0f0fu, c1 >> 4),
                                q6_bytes((v.z >> 4) & 0x0f0f0f0fu, c0 >> 6), q6_bytes((v.w >> 4) & 0x0f0f0f0fu, c1 >> 6));
    acc += dx * (dw[r] * float(dp4a4(lo, x0, 0)) + mw[r] * float(dp4a4(hi, x1, 0)));  // the two halves' scales
  } else {
    const uint4 v = w0[r];
    uint4 lo = make_uint4(v.x & 0x0f0f0f0fu, v.y & 0x0f0f0f0fu, v.z & 0x0f0f0f0fu, v.w & 0x0f0f0f0fu);
    uint4 hi = make_uint4((v.x >> 4) & 0x0f0f0f0fu, (v.y >> 4) & 0x0f0f0f0fu, (v.z >> 4) & 0x0f0f0f0fu, (v.w >> 4) & 0x0f0f0f0fu);
    if constexpr (kQ5) {  // weight j's fifth bit is bit j of the block's word
      const uint32_t e = hw[r];
      lo.x |= fifth_bit_bytes(e), lo.y |= fifth_bit_bytes(e >> 4), lo.z |= fifth_bit_bytes(e >> 8), lo.w |= fifth_bit_bytes(e >> 12);
      hi.x |= fifth_bit_bytes(e >> 16), hi.y |= fifth_bit_bytes(e >> 20), hi.z |= fifth_bit_bytes(e >> 24), hi.w |= fifth_bit_bytes(e >> 28);
    }
    const float s = float(dp4a4(hi, x1, dp4a4(lo, x0, 0)));
    if constexpr (kMin) acc += dw[r] * dx * s + mw[r] * sx;
    else acc += dw[r] * (dx * s - (kQ5 ? 16.0f : 8.0f) * sx);
  }
}

// Block-quantized weights (dev/cuda/gemv.cu's versions 2 and 3; dev/README.md has their
// timings). R rows per group; each lane takes whole quant blocks b = lane, lane + 32 KS, ...:
// Q8_0 two 16-byte loads, Q4 and Q5 one (low nibbles = weights 0..15 of the block, high =
// 16..31; Q5: and the block's word of fifth bits); every load of weights and activations serves
// all R rows and T tokens (registers). KS = 1: one warp per group, W groups per CUDA block; KS =
// W: the block's W warps split the row's blocks between them (more loads in flight for matrices
// with few rows; partial sums added through shared memory in a fixed order). Per block:
// Q8_0  d_w d_x Σ q_w q_x;  Q4_0 / Q5_0  d_w (d_x Σ q_w q_x - 8 s_x / - 16 s_x);
// Q4_1 / Q5_1  d_w d_x Σ q_w q_x + m_w s_x  (s_x = d_x Σ q_x, from quantize_act);
// Q4_K / Q5_K  the same with d_w = d sc, m_w = -dmin mn (d, dmin: the super-block's, from wk);
// Q6_K  d_x (d sc_0 Σ_0..15 (q_w - 32) q_x + d sc_1 Σ_16..31 ...) (sc: the block's two int8 scales).
// Q5 and Q6_K read their h words (one or two a block), the K-quants their k pairs.
template <DType kType, int R, int W, int T, int KS>
__global__ void __launch_bounds__(32 * W) gemv_block_kernel(const uint8_t* __restrict__ wq, const uint16_t* __restrict__ wd,
                                                           const uint16_t* __restrict__ wm, const uint32_t* __restrict__ wh,
                                                           const uint16_t* __restrict__ wk, const int8_t* __restrict__ xq,
                                                           const float* __restrict__ xd, const float* __restrict__ xs,
                                                           float* __restrict__ y, int64_t ldy, int rows, int cols) {
  constexpr int kQB = kType == DType::Q8_0 ? 32 : 16;  // quant bytes per block
  constexpr bool kQ5 = split_has_h(kType), kMin = split_has_m(kType);
  const int nb = cols / 32;
  pdl_begin();
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int row0 = (KS == 1 ? int(blockIdx.x) * W + warp : int(blockIdx.x)) * R;
  if (row0 >= rows) return;  // whole warps (KS == 1) or whole blocks (KS > 1: row0 is the block's)
  const int ks = KS == 1 ? 0 : warp;
  const uint4* w[R];
  const uint16_t* d[R];
  const uint16_t* m[R];
  const uint32_t* h[R];
  const uint16_t* k[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = min(row0 + r, rows - 1);
    w[r] = reinterpret_cast<const uint4*>(wq + row * nb * kQB), d[r] = wd + row * nb, m[r] = kMin ? wm + row * nb : nullptr;
    h[r] = split_h_words(kType) ? wh + row * nb * split_h_words(kType) : nullptr;
    k[r] = split_has_k(kType) ? wk + row * (nb / 8) * 2 : nullptr;
  }
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
#pragma unroll 2
  for (int b = ks * 32 + lane; b < nb; b += 32 * KS) {
    uint4 w0[R], w1[R];
    float dw[R], mw[R];
    uint32_t hw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w0[r] = __ldg(w[r] + (kQB / 16) * b);
      if constexpr (kType == DType::Q8_0) w1[r] = __ldg(w[r] + 2 * b + 1);
      if constexpr (kType == DType::Q6_K) {  // the crumbs; the halves' scales d sc_0, d sc_1
        const uint2 c = __ldg(reinterpret_cast<const uint2*>(h[r]) + b);
        w1[r] = make_uint4(c.x, c.y, 0u, 0u);
        const uint32_t sc = __ldg(d[r] + b);
        const float dk = fp16_bits_to_float(__ldg(k[r] + 2 * (b / 8)));
        dw[r] = dk * float(int8_t(sc & 0xff)), mw[r] = dk * float(int8_t(sc >> 8));
      } else if constexpr (split_k_affine(kType)) {  // sc | mn << 8, and the super-block's d and dmin
        const uint32_t sm = __ldg(d[r] + b), dk = __ldg(reinterpret_cast<const uint32_t*>(k[r]) + b / 8);
        dw[r] = fp16_bits_to_float(uint16_t(dk & 0xffff)) * float(sm & 0xff);
        mw[r] = -fp16_bits_to_float(uint16_t(dk >> 16)) * float(sm >> 8);
      } else {
        dw[r] = fp16_bits_to_float(__ldg(d[r] + b));
        if constexpr (kMin) mw[r] = fp16_bits_to_float(__ldg(m[r] + b));
      }
      if constexpr (kQ5) hw[r] = __ldg(h[r] + b);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int4* xb = reinterpret_cast<const int4*>(xq + int64_t(t) * cols + b * 32);
      const int4 x0 = __ldg(xb), x1 = __ldg(xb + 1);
      const float dx = __ldg(xd + int64_t(t) * nb + b);
      const float sx = kType == DType::Q8_0 ? 0.0f : __ldg(xs + int64_t(t) * nb + b);
#pragma unroll
      for (int r = 0; r < R; ++r) gemv_block_dot<kType, R>(acc[r][t], w0, w1, dw, mw, hw, r, x0, x1, dx, sx);
    }
  }
  gemv_block_store<R, T, KS>(acc, y, ldy, row0, rows, lane, warp);
}

template <DType kType, int R, int W, int T, int KS>
void launch_gemv_block(const DeviceWeight& w, const DeviceActQ8& xq, float* y, int64_t ldy, cudaStream_t s) {
  const int64_t groups = (w.rows + R - 1) / R;
  const unsigned grid = unsigned(KS == 1 ? (groups + W - 1) / W : groups);
  auto* kernel = gemv_block_kernel<kType, R, W, T, KS>;  // a template name's commas would split the macro's arguments
  LLMQ_LAUNCH(kernel, grid, 32 * W, 0, s)(w.q, w.d, w.m, w.h, w.k, xq.q, xq.d, xq.s, y, ldy, int(w.rows), int(w.cols));
}

// The version per type and token count, from the lab's timings on an H200 (bench/RESULTS.md):
// one token: the K split over 4 warps (Q4: 4 rows per block, Q8_0: 2); more tokens: 4 rows per
// warp, 4 warps per block (each weight load serves 4 x T products).
template <DType kType>
void gemv_block(const DeviceWeight& w, const DeviceActQ8& xq, float* y, int64_t ldy, int T, cudaStream_t s) {
  constexpr int kR1 = kType == DType::Q8_0 ? 2 : 4;
  switch (T) {
    case 1: return launch_gemv_block<kType, kR1, 4, 1, 4>(w, xq, y, ldy, s);
    case 2: return launch_gemv_block<kType, 4, 4, 2, 1>(w, xq, y, ldy, s);
    case 3: return launch_gemv_block<kType, 4, 4, 3, 1>(w, xq, y, ldy, s);
    case 4: return launch_gemv_block<kType, 4, 4, 4, 1>(w, xq, y, ldy, s);
    case 5: return launch_gemv_block<kType, 4, 4, 5, 1>(w, xq, y, ldy, s);
    case 6: return launch_gemv_block<kType, 4, 4, 6, 1>(w, xq, y, ldy, s);
    case 7: return launch_gemv_block<kType, 4, 4, 7, 1>(w, xq, y, ldy, s);
    default: return launch_gemv_block<kType, 4, 4, 8, 1>(w, xq, y, ldy, s);
  }
}
static_assert(kGemvMaxTokens == 8, "gemv_block instantiates T = 1 .. 8");

// 16 bytes of weights as floats: 4 (F32) or 8 (F16, BF16).
template <class E>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  if constexpr (std::is_same_v<E, float>) {
    out[0] = __uint_as_float(raw.x), out[1] = __uint_as_float(raw.y), out[2] = __uint_as_float(raw.z), out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<E, __half>) {
        out[2 * i] = fp16_bits_to_float(uint16_t(u[i] & 0xffff)), out[2 * i + 1] = fp16_bits_to_float(uint16_t(u[i] >> 16));
      } else {
        out[2 * i] = __uint_as_float(u[i] << 16), out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    }
  }
}

template <class E>
__device__ __forceinline__ float load1(const E* p) {
  if constexpr (std::is_same_v<E, float>) return __ldg(p);
  else if constexpr (std::is_same_v<E, __half>) return fp16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
  else return bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
}

// F32 / F16 / BF16 weights against fp32 activations: a warp per row, kGemvWarps rows per block;
// 16-byte loads when the rows are 16-byte aligned (cols a multiple of 16 / sizeof(E)), else one
// element per lane and step; every load serves all T tokens (acc[t]), so the weights are read once.
template <class E>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_float_kernel(const E* __restrict__ wq, const float* __restrict__ x,
                                                                    float* __restrict__ y, int64_t ldy, int64_t rows, int64_t cols, int T) {
  pdl_begin();
  const int64_t row = int64_t(blockIdx.x) * kGemvWarps + threadIdx.y;
  if (row >= rows) return;
  constexpr int kVec = 16 / sizeof(E);
  const E* w = wq + row * cols;
  float acc[kGemvMaxTokens] = {};
  if (cols % kVec == 0) {
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < cols / kVec; c += 32) {
      float wf[kVec];
      unpack16<E>(__ldg(w4 + c), wf);
#pragma unroll
      for (int t = 0; t < kGemvMaxTokens; ++t)
        if (t < T) {
          const float* xr = x + t * cols + c * kVec;
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[t] += wf[j] * xr[j];
        }
    }
  } else {
    for (int64_t k = threadIdx.x; k < cols; k += 32) {
      const float wv = load1<E>(w + k);
#pragma unroll
      for (int t = 0; t < kGemvMaxTokens; ++t)
        if (t < T) acc[t] += wv * x[t * cols + k];
    }
  }
  store_rows(acc, y, ldy, row, T);
}

// Raw-layout weights (raw_blocks.cuh) against fp32 activations: one warp per row, each lane
// decodes whole blocks b = lane, lane + 32, ... byte by byte. Not tuned: every raw type has its
// kernel below (Q4_K's and Q6_K's were 6.3x faster on an H100, bench/RESULTS.md, second GPU
// session); this one runs only when weights or activations lack the alignment those need
// (raw_gemv_kernel).
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_raw_kernel(DType type, const uint8_t* __restrict__ wq, size_t rb,
                                                                  const float* __restrict__ x, float* __restrict__ y, int64_t ldy,
                                                                  int64_t rows, int64_t cols, int T) {
  pdl_begin();
  const int64_t row = int64_t(blockIdx.x) * kGemvWarps + threadIdx.y;
  if (row >= rows) return;
  float acc[kGemvMaxTokens] = {};
  for (int64_t b = threadIdx.x; b < cols / 32; b += 32) {
    float wf[32];
    raw_block(type, wq + row * rb, b, wf);
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
        const float* xr = x + t * cols + b * 32;
        for (int j = 0; j < 32; ++j) acc[t] += wf[j] * xr[j];
      }
  }
  store_rows(acc, y, ldy, row, T);
}

// Q2_K and Q3_K (the Q2_K / Q3_K_M mixes) against fp32 activations, laid out as the raw Q4_K /
// Q6_K GEMVs were (dev/cuda/gemv_k.cu keeps those): eight lanes per super-block, R rows per warp. Their 2-bit quants are crumbs:
// weight l of sub-block j is bits 2 (j % 4) of qs[32 (j / 4) + l] (k_crumb), Q3_K's third bit is
// bit j of hmask[l]. Lane k takes half n = k / 4 and positions l0 .. l0 + 7 (l0 = 8 (k % 4)) of its
// four sub-blocks j = 4n + s, so one 8-byte load of qs[32n + l0, + 8) (and of hmask[l0, + 8)) holds
// all its 32 quants; the 16-weight scale of those positions is scale 2j + l0 / 16.
//   Q2_K  w = d sc q - dmin mn:  Σ w x = d sc Σ q x - dmin mn Σ x  (sc, mn: the scale byte's nibbles)
//   Q3_K  w = d (sc - 32) (q - 4), q = crumb | hbit << 2  (q3_k_scale)
// Q2_K rows are 4-byte aligned (84-byte super-blocks), Q3_K rows 2-byte (110): ld_words2.
template <int R, bool kQ3>
__global__ void __launch_bounds__(32 * kGemvWarps, 5) gemv_q23k_kernel(const uint8_t* __restrict__ wq, size_t rb, const float* __restrict__ x,
                                                                     float* __restrict__ y, int64_t ldy, int64_t rows, int64_t cols, int T) {
  pdl_begin();
  constexpr int kBlockBytes = raw_block_bytes(kQ3 ? DType::Q3_K : DType::Q2_K), kQs = kQ3 ? 32 : 16;
  const int64_t row0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.y) * R;
  if (row0 >= rows) return;
  const int k = int(threadIdx.x % 8), n = k / 4, l0 = 8 * (k % 4), half = l0 / 16;
  float acc[R][kGemvMaxTokens] = {};
  for (int64_t sb = threadIdx.x / 8; sb < cols / 256; sb += 4) {
    uint32_t qw[R][2], hw[R][2];  // qs[32n + l0, + 8); Q3_K: hmask[l0, + 8) shifted to bit 4n
    float a[R][4], m[R][4];       // per sub-block 4n + s: scale and (Q2_K) minimum
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wq + (row0 + r < rows ? row0 + r : rows - 1) * rb + sb * kBlockBytes;
      ld_words2<2>(blk + kQs + 32 * n + l0, qw[r]);
      if constexpr (kQ3) {
        ld_words2<2>(blk + l0, hw[r]);
        hw[r][0] >>= 4 * n, hw[r][1] >>= 4 * n;
        const float d = half_at(blk + 108);
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) a[r][s4] = d * float(q3_k_scale(blk + 96, 2 * (4 * n + s4) + half) - 32), m[r][s4] = 0.0f;
      } else {
        const float d = half_at(blk + 80), dmin = half_at(blk + 82);
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
          const int sc = __ldg(blk + 2 * (4 * n + s4) + half);
          a[r][s4] = d * float(sc & 15), m[r][s4] = dmin * float(sc >> 4);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
        const float* xr = x + t * cols + sb * 256 + 128 * n + l0;
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
          const float4 v0 = __ldg(reinterpret_cast<const float4*>(xr + 32 * s4)), v1 = __ldg(reinterpret_cast<const float4*>(xr + 32 * s4) + 1);
          const float xv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
          const float sx = ((v0.x + v0.y) + (v0.z + v0.w)) + ((v1.x + v1.y) + (v1.z + v1.w));
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float sq = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              int q = int((qw[r][i / 4] >> (8 * (i % 4) + 2 * s4)) & 3);
              if constexpr (kQ3) q += int((hw[r][i / 4] >> (8 * (i % 4) + s4)) & 1) * 4 - 4;
              sq += float(q) * xv[i];
            }
            acc[r][t] += kQ3 ? a[r][s4] * sq : a[r][s4] * sq - m[r][s4] * sx;
          }
        }
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < rows) store_rows(acc[r], y, ldy, row0 + r, T);
}

// IQ4_NL against fp32 activations: a lane per 32-weight block (b = lane, lane + 32, ...: a warp
// reads consecutive blocks), R rows per warp, the block read as 16-bit words (its rows are only
// 2-byte aligned: 18-byte blocks), the 32 activations as eight float4. qs byte i holds weight i
// (low nibble) and i + 16 (high); w = d · level(q).
template <int R>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_iq4nl_kernel(const uint8_t* __restrict__ wq, size_t rb, const float* __restrict__ x,
                                                                    float* __restrict__ y, int64_t ldy, int64_t rows, int64_t cols, int T) {
  pdl_begin();
  constexpr int kBlockBytes = raw_block_bytes(DType::IQ4_NL);
  const int64_t row0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.y) * R;
  if (row0 >= rows) return;
  float acc[R][kGemvMaxTokens] = {};
  for (int64_t b = threadIdx.x; b < cols / 32; b += 32) {
    uint32_t qw[R][4];
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wq + (row0 + r < rows ? row0 + r : rows - 1) * rb + b * kBlockBytes;
      d[r] = fp16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(blk)));
      ld_words2<4>(blk + kIQ4NLQs, qw[r]);
    }
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
        const float4* xr = reinterpret_cast<const float4*>(x + t * cols + b * 32);
        float sq[R] = {};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 lo = __ldg(xr + c), hi = __ldg(xr + 4 + c);  // weights 4c .. 4c + 3 and 16 + 4c ..
          const float xl[4] = {lo.x, lo.y, lo.z, lo.w}, xh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              sq[r] += float(iq4_nl_level((qw[r][c] >> (8 * i)) & 15)) * xl[i] + float(iq4_nl_level((qw[r][c] >> (8 * i + 4)) & 15)) * xh[i];
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][t] += d[r] * sq[r];
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < rows) store_rows(acc[r], y, ldy, row0 + r, T);
}

constexpr int kGemvKRows = 2;  // rows per warp of the raw types' kernels

// The raw types' GEMV kernels above (one signature).
using RawGemvKernel = void (*)(const uint8_t*, size_t, const float*, float*, int64_t, int64_t, int64_t, int);

// The tuned GEMV of raw type t, or nullptr when the weights at wq are not aligned as its loads
// need (every row then is: a row's bytes are a multiple of that alignment) or the activations at x
// are not 16-byte aligned; gemv_raw_kernel runs then.
RawGemvKernel raw_gemv_kernel(DType t, const void* wq, const float* x) {
  const int align = t == DType::Q2_K ? 4 : 2;
  if (reinterpret_cast<uintptr_t>(wq) % align != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return nullptr;
  switch (t) {
    case DType::Q2_K: return gemv_q23k_kernel<kGemvKRows, false>;
    case DType::Q3_K: return gemv_q23k_kernel<kGemvKRows, true>;
    case DType::IQ4_NL: return gemv_iq4nl_kernel<kGemvKRows>;
    default: return nullptr;
  }
}

}  // namespace

bool gemv_reads_int8(const DeviceWeight& w) { return is_block_type(w.type); }

void gemv(const DeviceWeight& w, const float* x, const DeviceActQ8& xq, float* y, int64_t T, int64_t ldy, cudaStream_t s) {
  if (T < 1 || T > kGemvMaxTokens) throw UsageError("gemv: T must be 1.." + std::to_string(kGemvMaxTokens));
  if (w.rows == 0) return;
  const dim3 block(32, kGemvWarps);
  const unsigned grid = unsigned((w.rows + kGemvWarps - 1) / kGemvWarps);
  const int nt = int(T);
  if (ldy == 0) ldy = w.rows;
  switch (w.type) {
    case DType::Q8_0: gemv_block<DType::Q8_0>(w, xq, y, ldy, nt, s); break;
    case DType::Q4_0: gemv_block<DType::Q4_0>(w, xq, y, ldy, nt, s); break;
    case DType::Q4_1: gemv_block<DType::Q4_1>(w, xq, y, ldy, nt, s); break;
    case DType::Q5_0: gemv_block<DType::Q5_0>(w, xq, y, ldy, nt, s); break;
    case DType::Q5_1: gemv_block<DType::Q5_1>(w, xq, y, ldy, nt, s); break;
    case DType::Q4_K: gemv_block<DType::Q4_K>(w, xq, y, ldy, nt, s); break;
    case DType::Q5_K: gemv_block<DType::Q5_K>(w, xq, y, ldy, nt, s); break;
    case DType::Q6_K: gemv_block<DType::Q6_K>(w, xq, y, ldy, nt, s); break;
    case DType::F32:
      LLMQ_LAUNCH(gemv_float_kernel<float>, grid, block, 0, s)(reinterpret_cast<const float*>(w.q), x, y, ldy, w.rows, w.cols, nt);
      break;
    case DType::F16:
      LLMQ_LAUNCH(gemv_float_kernel<__half>, grid, block, 0, s)(reinterpret_cast<const __half*>(w.q), x, y, ldy, w.rows, w.cols, nt);
      break;
    case DType::BF16:
      LLMQ_LAUNCH(gemv_float_kernel<__nv_bfloat16>, grid, block, 0, s)(reinterpret_cast<const __nv_bfloat16*>(w.q), x, y, ldy, w.rows, w.cols, nt);
      break;
    default:
      if (RawGemvKernel k = raw_gemv_kernel(w.type, w.q, x)) {
        const unsigned kgrid = unsigned((w.rows + kGemvWarps * kGemvKRows - 1) / (kGemvWarps * kGemvKRows));
        LLMQ_LAUNCH(k, kgrid, block, 0, s)(w.q, row_bytes(w.type, w.cols), x, y, ldy, w.rows, w.cols, nt);
        break;
      }
      LLMQ_LAUNCH(gemv_raw_kernel, grid, block, 0, s)(w.type, w.q, row_bytes(w.type, w.cols), x, y, ldy, w.rows, w.cols, nt);
      break;
  }
  check_launch("gemv");
}

// ---------------------------------------------------------------- prefill: dequantize + cuBLAS

namespace {

// One thread per 8 weights (a quarter of a block), written as one 16-byte store: a warp writes
// 512 contiguous bytes. (A thread per block writing 4 x 16 bytes 64 bytes apart ran at ~2 TB/s
// on an H200; dev/cuda/mmq.cu times this kernel as "dequant + cublas".) Quarter k of a block:
// Q8_0 quants 8k..8k+7; Q4 / Q5 nibbles of bytes 8 (k % 2) .. +7, low ones for k < 2 (weights
// 0..15), high ones for k >= 2, so weights 8k .. 8k + 7 (Q5: with bits 8k .. of the block's word).
// Q4_K / Q5_K: Q4_1's / Q5_1's with d = d_sb sc and m = -dmin_sb mn. Q6_K: d_sb sc (q - 32), q's low nibble as
// Q4's and its high crumb from byte j of the block's 8 h bytes (bits 2k), sc the quarter's half's.
template <DType kType>
__global__ void dequantize_f16_kernel(const uint8_t* __restrict__ wq, const uint16_t* __restrict__ wd, const uint16_t* __restrict__ wm,
                                      const uint32_t* __restrict__ wh, const uint16_t* __restrict__ wk, uint4* __restrict__ out,
                                      int64_t n_quarters) {
  pdl_begin();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_quarters) return;
  const int64_t b = i / 4;
  const int k = int(i % 4);
  const uint16_t* dk = split_has_k(kType) ? wk + b / 8 * 2 : nullptr;  // d (and Q4_K's dmin)
  const float d = split_k_affine(kType) ? fp16_bits_to_float(dk[0]) * float(wd[b] & 0xff)
                : kType == DType::Q6_K ? fp16_bits_to_float(dk[0]) * float(int8_t(wd[b] >> (8 * (k / 2))))  // the quarter's half
                                       : fp16_bits_to_float(wd[b]);
  float f[8];
  if constexpr (kType == DType::Q6_K) {  // weights 8k + j: nibble k / 2 of q byte 8 (k % 2) + j, crumb 2 k of h byte j
    const uint2 raw = *reinterpret_cast<const uint2*>(wq + b * 16 + 8 * (k % 2));
    const uint2 hc = *reinterpret_cast<const uint2*>(wh + 2 * b);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t nib = ((j < 4 ? raw.x : raw.y) >> (8 * (j % 4) + 4 * (k / 2))) & 15;
      const uint32_t crumb = ((j < 4 ? hc.x : hc.y) >> (8 * (j % 4) + 2 * k)) & 3;
      f[j] = d * float(int(nib | crumb << 4) - 32);
    }
  } else if constexpr (kType == DType::Q8_0) {
    const uint2 raw = *reinterpret_cast<const uint2*>(wq + b * 32 + 8 * k);
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = d * float(int8_t(raw.x >> (8 * j))), f[4 + j] = d * float(int8_t(raw.y >> (8 * j)));
  } else {
    const float m = split_has_k(kType)   ? -fp16_bits_to_float(dk[1]) * float(wd[b] >> 8)
                    : split_has_m(kType) ? fp16_bits_to_float(wm[b])
                                         : (split_has_h(kType) ? -16.0f : -8.0f) * d;
    const uint2 raw = *reinterpret_cast<const uint2*>(wq + b * 16 + 8 * (k % 2));
    const uint32_t e = split_has_h(kType) ? wh[b] >> (8 * k) : 0u;  // fifth bits of weights 8k ..
    const int sh = k < 2 ? 0 : 4;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      f[j] = d * float(((raw.x >> (8 * j + sh)) & 0x0f) | ((e >> j) & 1) << 4) + m,
      f[4 + j] = d * float(((raw.y >> (8 * j + sh)) & 0x0f) | ((e >> (4 + j)) & 1) << 4) + m;
  }
  uint32_t h[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    h[j] = uint32_t(__half_as_ushort(__float2half(f[2 * j]))) | (uint32_t(__half_as_ushort(__float2half(f[2 * j + 1]))) << 16);
  out[i] = make_uint4(h[0], h[1], h[2], h[3]);
}

// Raw-layout weights: one thread per block of 32, four 16-byte stores.
__global__ void dequantize_raw_f16_kernel(DType type, const uint8_t* __restrict__ wq, int64_t nb_row, size_t rb,
                                          uint4* __restrict__ out, int64_t n_blocks) {
  pdl_begin();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_blocks) return;
  float f[32];
  raw_block(type, wq + (i / nb_row) * rb, i % nb_row, f);
  for (int k = 0; k < 4; ++k) {
    uint32_t h[4];
    for (int j = 0; j < 4; ++j)
      h[j] = uint32_t(__half_as_ushort(__float2half(f[8 * k + 2 * j]))) |
             (uint32_t(__half_as_ushort(__float2half(f[8 * k + 2 * j + 1]))) << 16);
    out[4 * i + k] = make_uint4(h[0], h[1], h[2], h[3]);
  }
}

// fp32 → fp16 (bf16 = false) or bf16.
__global__ void convert_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n, bool bf16) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16(x[i])) : __half_as_ushort(__float2half(x[i]));
}

}  // namespace

void dequantize_rows_f16(const DeviceWeight& w, int64_t r0, int64_t n, uint16_t* out, cudaStream_t s) {
  const DeviceWeight v = weight_rows(w, r0, n);
  const int64_t n_blocks = n * w.cols / QK;
  if (n_blocks == 0) return;
  const unsigned grid = unsigned((4 * n_blocks + 255) / 256);
  auto* o = reinterpret_cast<uint4*>(out);
  switch (w.type) {
    case DType::Q8_0: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q8_0>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q4_0: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q4_0>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q4_1: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q4_1>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q5_0: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q5_0>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q5_1: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q5_1>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q4_K: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q4_K>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q5_K: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q5_K>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    case DType::Q6_K: LLMQ_LAUNCH(dequantize_f16_kernel<DType::Q6_K>, grid, 256, 0, s)(v.q, v.d, v.m, v.h, v.k, o, 4 * n_blocks); break;
    default:
      if (!is_raw_type(w.type)) throw UsageError(std::string("dequantize_rows_f16: no fp16 path for ") + dtype_name(w.type));
      LLMQ_LAUNCH(dequantize_raw_f16_kernel, unsigned((n_blocks + 127) / 128), 128, 0, s)(w.type, v.q, w.cols / QK,
                                                                                      row_bytes(w.type, w.cols), o, n_blocks);
      break;
  }
  check_launch("dequantize_rows_f16");
}

namespace {

// Rows per dequantized tile of w: tiles of equal height (a multiple of 128), two GEMMs of 11008
// rows, not 11008 + 11008 - 64.
int64_t tile_step(const DeviceWeight& w, int64_t tile_rows) {
  const int64_t n_tiles = (w.rows + tile_rows - 1) / tile_rows;
  return ((w.rows + n_tiles - 1) / n_tiles + 127) / 128 * 128;
}

}  // namespace

MatmulContext::MatmulContext(int64_t cap_tokens, int64_t max_cols, cudaStream_t stream, int64_t max_rows)
    : stream_(stream), cap_(cap_tokens), max_cols_(max_cols), plan_(plan_cuda_matmul(cap_tokens, max_cols, max_rows)) {
  act_q_ = DeviceBuffer(plan_.act_q);
  act_d_ = DeviceBuffer(plan_.act_d);
  act_s_ = DeviceBuffer(plan_.act_s);
  if (cap_tokens > kGemvMaxTokens) {
    act_h_ = DeviceBuffer(plan_.act_h);
    tile_ = DeviceBuffer(plan_.tile);
    cublas_ws_ = DeviceBuffer(plan_.cublas_workspace);
    mmq_split_ = DeviceBuffer(plan_.mmq_split);
    mmq_prepare();
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "cublasCreate");
    cublas_ = h;
    check_cublas(cublasSetStream(h, stream), "cublasSetStream");
    check_cublas(cublasSetWorkspace(h, cublas_ws_.get(), cublas_ws_.bytes()), "cublasSetWorkspace");
  }
}

MatmulContext::~MatmulContext() {
  if (cublas_) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
}

uint64_t MatmulContext::bytes() const {
  return act_q_.bytes() + act_d_.bytes() + act_s_.bytes() + act_h_.bytes() + tile_.bytes() + cublas_ws_.bytes() + mmq_split_.bytes();
}

DeviceActQ8 MatmulContext::quantized(const float* x, int64_t T, int64_t cols) {
  if (note_.x != x || note_.T != T || note_.cols != cols) {
    quantize_act(x, act(), T, cols, stream_);
    note_ = {};  // the buffers now hold an input nobody noted
  }
  return act();
}

// The most tokens at which a type's MMQ beats dequantize + cuBLAS on an H200 (dev/cuda/mmq.cu on
// llama-2-7b's matrices; bench/RESULTS.md, seventh GPU session): Q4_0 and Q8_0 win up to 64
// tokens (0.57-0.91x its time at 64). The affine and split types (Q4_1, Q5_0, Q5_1 and the
// K-quants Q4_K, Q5_K, Q6_K in their split layouts) win up to 32 (0.50-0.96x) and mostly lose
// at 64 (0.87-1.62x). IQ4_NL, Q2_K and Q3_K (16-bit loads, no cp.async) tie or lose at 16
// already (0.98-2.07x), so their batches dequantize. 0: never MMQ.
static int64_t mmq_max_tokens(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q8_0: return kCudaMmqMaxTokens;
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: return 32;
    default: return 0;
  }
}

// Batches of quantized weights (9 .. mmq_max_tokens tokens): MMQ, unless LLMQ_CUDA_MMQ=0
// (dequantize + cuBLAS, for comparison). LLMQ_CUDA_MMQ=1: MMQ for any T and every type it takes
// (for comparisons).
static bool use_mmq(const DeviceWeight& w, int64_t T) {
  static const int mode = [] {
    const char* e = std::getenv("LLMQ_CUDA_MMQ");
    return e ? std::atoi(e) : -1;
  }();
  return mode != 0 && T > kGemvMaxTokens && (mode == 1 || T <= mmq_max_tokens(w.type)) && mmq_supported(w);
}

// MMQ's batches of Q4_0 / Q8_0 (up to 64 tokens) on fp16 tiles (mmq_h): off by default, an
// experiment until a GPU times it against the int8 kernel (dev/cuda/mmq.cu); LLMQ_CUDA_MMQ_F16=1
// or set_mmq_f16(true) turns it on.
static EnvSetting g_mmq_f16([] {
  const char* e = std::getenv("LLMQ_CUDA_MMQ_F16");
  return e && std::atoi(e) == 1 ? 1 : 0;
});

void set_mmq_f16(bool on) { g_mmq_f16.set(on ? 1 : 0); }

static bool use_mmq_h(const DeviceWeight& w, int64_t T) { return g_mmq_f16.get() != 0 && T <= 64 && use_mmq(w, T) && mmq_h_supported(w); }

bool matmul_quantizes(const DeviceWeight& w, int64_t T) {
  return (T <= kGemvMaxTokens && gemv_reads_int8(w)) || (use_mmq(w, T) && !use_mmq_h(w, T));
}

const uint16_t* MatmulContext::half(const float* x, int64_t T, int64_t cols, bool bf16) {
  auto* xh = act_h_.as<uint16_t>();
  if (held_ == x && half_.x == x && half_.T == T && half_.cols == cols && bf16_half_ == bf16) return xh;
  const int64_t n = T * cols;
  LLMQ_LAUNCH(convert_kernel, unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream_)(x, xh, n, bf16);
  check_launch("convert");
  half_ = held_ == x ? Note{x, T, cols} : Note{};
  bf16_half_ = bf16;
  return xh;
}

const DeviceActQ8* MatmulContext::fusable(const DeviceWeight& next, int64_t T, int64_t cols) {
  if (!matmul_quantizes(next, T) || cols % 32 != 0) return nullptr;
  act_view_ = act();
  return &act_view_;
}

void matmul(MatmulContext& c, const DeviceWeight& w, const float* x, float* y, int64_t T, int64_t ldy) {
  if (T < 1 || T > c.cap_) throw UsageError("CUDA matmul: " + std::to_string(T) + " tokens (capacity " + std::to_string(c.cap_) + ")");
  if (w.cols > c.max_cols_) throw UsageError("CUDA matmul: matrix wider than the planned scratch");
  cudaStream_t s = c.stream_;
  if (T <= kGemvMaxTokens) {
    const DeviceActQ8 xq = gemv_reads_int8(w) ? c.quantized(x, T, w.cols) : c.act();
    gemv(w, x, xq, y, T, ldy, s);
    return;
  }
  if (use_mmq_h(w, T)) {
    mmq_h(w, c.half(x, T, w.cols, false), y, T, ldy, s, 0, c.mmq_split_.as<float>(), c.mmq_split_.bytes());
    return;
  }
  if (use_mmq(w, T)) {  // block-quantized weights on the tensor cores, no fp16 copy of the matrix
    mmq(w, c.quantized(x, T, w.cols), y, T, ldy, s, 0, c.mmq_split_.as<float>(), c.mmq_split_.bytes());
    return;
  }
  // Row-major y [T, rows] is column-major [rows, T]: C = op(A) B with A = W (column-major
  // [cols, rows], transposed), B = x (column-major [cols, T]).
  auto h = static_cast<cublasHandle_t>(c.cublas_);
  const float one = 1.0f, zero = 0.0f;
  const int m = int(w.rows), n = int(T), k = int(w.cols), ldc = int(ldy ? ldy : w.rows);
  if (w.type == DType::F32) {
    check_cublas(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, reinterpret_cast<const float*>(w.q), k, x, k, &zero, y, ldc),
                 "cublasSgemm");
    return;
  }
  const bool bf16 = w.type == DType::BF16;
  const cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const uint16_t* xh = c.half(x, T, w.cols, bf16);
  if (w.type == DType::F16 || bf16) {
    check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w.q, ab, k, xh, ab, k, &zero, y, CUDA_R_32F, ldc,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
    return;
  }
  const int64_t step = tile_step(w, c.plan_.tile_rows);
  for (int64_t r0 = 0; r0 < w.rows; r0 += step) {
    const int64_t nr = std::min(step, w.rows - r0);
    dequantize_rows_f16(w, r0, nr, c.tile_.as<uint16_t>(), s);
    check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(nr), n, k, &one, c.tile_.get(), CUDA_R_16F, k, xh, CUDA_R_16F, k, &zero,
                              y + r0, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }
}

double measure_cublas_bf16_flops(int64_t m, int64_t n, int64_t k, int reps) {
  DeviceBuffer a(size_t(m * k) * 2), b(size_t(k * n) * 2), c(size_t(m * n) * 4), ws(plan_cuda_matmul(9, 32).cublas_workspace);
  // Random operands: a product of constants runs faster than real data (METHOD: 13% on an H200).
  fill_random(split_weight_view(DType::BF16, m, k, a.as<uint8_t>()), 11, nullptr);
  fill_random(split_weight_view(DType::BF16, n, k, b.as<uint8_t>()), 12, nullptr);
  cublasHandle_t h = nullptr;
  check_cublas(cublasCreate(&h), "cublasCreate");
  check_cublas(cublasSetWorkspace(h, ws.get(), ws.bytes()), "cublasSetWorkspace");
  const float one = 1.0f, zero = 0.0f;
  const double ms = best_time_ms(reps, [&] {
    check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k), &one, a.get(), CUDA_R_16BF, int(k), b.get(), CUDA_R_16BF,
                              int(k), &zero, c.get(), CUDA_R_32F, int(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  });
  cublasDestroy(h);
  return 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3);
}

}  // namespace llmq::cuda
