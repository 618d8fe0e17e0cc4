// Matrix products on the GPU: y [T, rows] = x [T, cols] · Wᵀ for weights in every stored type.
//   decode (T <= kGemvMaxTokens): our GEMV kernels, dequantization fused in registers, wide
//     loads; Q8_0/Q4_0/Q4_1: int8 dot products (dp4a) against activations quantized per block
//     of 32 (as the CPU path and llama.cpp's MMVQ do), as are Q5_0/Q5_1/Q4_K/Q5_K/Q6_K (split
//     layouts); the raw types (Q2_K, Q3_K, IQ4_NL): fp32 activations, one kernel family each
//     (eight lanes per 256-weight super-block, or a lane per 32-weight block);
//   batches (T up to kCudaMmqMaxTokens): MMQ (mmq.cu), int8 tensor cores on the quant blocks,
//     split-K when the grid would be small, for the types where it beat dequantize + cuBLAS;
//   prefill (larger T, or weights MMQ does not take): the weight dequantized to fp16 tiles of
//     rows, then cuBLAS on the tensor cores (fp32 accumulation).
// CPU references: engine/cpu/cpu_ops.h ref_matmul (fp32 activations, fp64 sums) and the block dot
// products of engine/cpu/cpu_ops.cpp; tests/test_cuda.cpp compares every type on odd shapes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/cuda/cuda.h"
#include "engine/cuda_plan.h"
#include "formats/quant.h"

namespace llmq::cuda {

/// True for the types the device keeps in the file's own block layout ("raw": IQ4_NL, Q2_K,
/// Q3_K; engine/cuda/raw_blocks.cuh decodes them); Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and Q4_K/Q5_K/Q6_K
/// are split.
__host__ __device__ constexpr bool is_raw_type(DType t) { return t == DType::IQ4_NL || t == DType::Q2_K || t == DType::Q3_K; }
/// Split types with an h array of fifth bits (Q5_0, Q5_1, Q5_K), and with an m array of minimums
/// (Q4_1, Q5_1): see DeviceWeight.
__host__ __device__ constexpr bool split_has_h(DType t) { return t == DType::Q5_0 || t == DType::Q5_1 || t == DType::Q5_K; }
__host__ __device__ constexpr bool split_has_m(DType t) { return t == DType::Q4_1 || t == DType::Q5_1; }
/// Split types whose block scales come in two levels (Q4_K, Q5_K, Q6_K): the k array of
/// super-block scales (a 4-byte pair of fp16 per 256 weights) and, in d, each 32-weight block's
/// small integer scales: see DeviceWeight.
__host__ __device__ constexpr bool split_has_k(DType t) { return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K; }
/// The split K-quants of Q4_1's form, w = (d sc) q - dmin mn per 32-weight block (Q4_K, Q5_K).
__host__ __device__ constexpr bool split_k_affine(DType t) { return t == DType::Q4_K || t == DType::Q5_K; }
/// 32-bit words of the h array per 32-weight block: Q5_0 / Q5_1 / Q5_K one (fifth bits), Q6_K
/// two (the high two bits of its 6-bit quants), else none.
__host__ __device__ constexpr int split_h_words(DType t) { return split_has_h(t) ? 1 : t == DType::Q6_K ? 2 : 0; }

/// A weight matrix [rows, cols] on the device in the split layout the kernels read with aligned
/// 16-byte loads: the file's blocks (formats/quant.h) taken apart into arrays. Same bytes in
/// all as the file's tensor (row_bytes(type, cols) · rows), only rearranged (Q4_K, Q5_K: 4 more
/// per 256 weights, Q6_K 2: cuda_row_bytes):
///   Q8_0: q = int8 quants [rows, cols], d = fp16 scales [rows, cols/32]
///   Q4_0: q = nibbles [rows, cols/2] (per block of 32: 16 bytes, weight j in the low nibble of
///         byte j, weight j+16 in the high one, as in the file), d = fp16 scales [rows, cols/32]
///   Q4_1: as Q4_0, plus m = fp16 minimums [rows, cols/32]
///   Q5_0, Q5_1: as Q4_0 / Q4_1, plus h = the fifth bits [rows, cols/32] (bit j of a block's word:
///         weight j, the file's qh), stored between q and d
///   Q4_K: q = nibbles [rows, cols/2] in Q4_0's order per 32-weight sub-block (the file pairs
///         sub-blocks 2c and 2c+1 in the low and high nibbles of 32 bytes), d = each sub-block's
///         6-bit scale sc and minimum mn as bytes [rows, cols/32] (sc | mn << 8, unpacked from the
///         file's 12 scale bytes), k = each super-block's fp16 d and dmin [rows, cols/256, 2]:
///         w = (d sc) q - dmin mn, as Q4_1 with d_w = d sc, m_w = -dmin mn. 4.625 bits a weight
///         (cuda_row_bytes), exact; Q4_1's GEMV, MMQ and dequantization read it
///   Q5_K: as Q4_K, plus h = the fifth bits [rows, cols/32] as Q5_1's (the file's qh: bit j of
///         byte l is weight l of sub-block j), between q and d: 180 bytes a super-block (176)
///   Q6_K: q = the low nibbles of the 6-bit quants [rows, cols/2] in Q4_0's order, h = their high
///         two bits [rows, cols/32, 2 words] (byte j of a block's 8: those of weights j, j + 8,
///         j + 16, j + 24 at bits 0, 2, 4, 6), d = each block's two int8 scales (weights 0..15
///         in the low byte, 16..31 in the high) [rows, cols/32], k = each super-block's fp16 d
///         and a zero [rows, cols/256, 2] (a 4-byte word, as Q4_K's, for cp.async): w = d sc
///         (q - 32). 212 bytes a super-block (the file's 210), exact
///   F32, F16, BF16: q = the elements [rows, cols] (d, m, h, k null)
///   raw types (is_raw_type): q = the file's rows as they are (d, m, h, k null)
struct DeviceWeight {
  DType type = DType::F32;
  int64_t rows = 0, cols = 0;
  const uint8_t* q = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const uint32_t* h = nullptr;
  const uint16_t* k = nullptr;
};

/// Bytes of the split layout of a [rows, cols] matrix of type t: rows · cuda_row_bytes (the
/// file's bytes; Q4_K's 148, Q5_K's 180 and Q6_K's 212 per 256 weights).
uint64_t split_weight_bytes(DType t, int64_t rows, int64_t cols);
/// Rearranges a matrix from the file layout (host memory, rows · row_bytes(t, cols) bytes at
/// src) into the split layout at dst (host memory, split_weight_bytes): q, then h, d, m, k.
void split_weight(DType t, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst);
/// The inverse of split_weight: the split layout at src (host memory) back into the file layout
/// at dst (for tests and tools that read device weights back).
void unsplit_weight(DType t, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst);
/// The view of a split-layout matrix stored at device address `base`.
DeviceWeight split_weight_view(DType t, int64_t rows, int64_t cols, const uint8_t* base);
/// Rows [r0, r0 + n) of w as a matrix of their own (a view).
DeviceWeight weight_rows(const DeviceWeight& w, int64_t r0, int64_t n);

/// Fills a split-layout matrix on the device with random weights (a hash of seed and index):
/// Q types get uniform quants (Q5: and fifth bits) and scales ~ 0.02/|q| (weights of std
/// ~0.01-0.02, as a trained Llama's), float types uniform values in ±0.03; the raw types (file
/// layout) uniform bytes with their fp16 scales (and minimums) set to that scale. For synthetic
/// benchmarks: nothing travels.
void fill_random(const DeviceWeight& w, uint64_t seed, cudaStream_t s);

/// Activations quantized per block of 32 for the integer GEMV, as engine/cpu/cpu_ops.h's
/// BlockQ8Act: d = max|x| / 127, q = round(x / d), s = d · Σq. Arrays [T, cols], [T, cols/32] x2.
struct DeviceActQ8 {
  int8_t* q = nullptr;
  float* d = nullptr;
  float* s = nullptr;
};

/// Most tokens the GEMV kernels take in one call (each weight row is read once for all).
constexpr int kGemvMaxTokens = kCudaGemvMaxTokens;

/// Device scratch and the cuBLAS handle for matmul(), sized once for up to `cap_tokens` tokens
/// and matrices of at most max_cols columns and max_rows rows (0: any), as engine/cuda_plan.h's
/// plan_cuda_matmul says (what llmq-mem reports). The prefill path dequantizes at most tile_rows
/// weight rows at a time into an fp16 tile and runs one cuBLAS GEMM per tile. Throws CudaError
/// when the device is out of memory.
class MatmulContext {
 public:
  MatmulContext(int64_t cap_tokens, int64_t max_cols, cudaStream_t stream, int64_t max_rows = 0);
  ~MatmulContext();
  MatmulContext(const MatmulContext&) = delete;
  MatmulContext& operator=(const MatmulContext&) = delete;

  /// Device bytes held: activation scratch, the dequantization tile, cuBLAS's workspace.
  uint64_t bytes() const;
  cudaStream_t stream() const { return stream_; }

  /// The int8 activation buffers ([cap, max_cols], quantize_act's layout), for kernels that
  /// quantize their output as they write it (ops.h rmsnorm / swiglu with q). After such a
  /// kernel, note_quantized(x, T, cols) tells matmul that these buffers hold x [T, cols]
  /// quantized, so products of x skip quantize_act; the note lasts until matmul quantizes
  /// another input (which overwrites the buffers) or clear_note(). Host-side bookkeeping at
  /// enqueue time (a captured CUDA graph replays what was enqueued).
  DeviceActQ8 act() const { return {act_q_.as<int8_t>(), act_d_.as<float>(), act_s_.as<float>()}; }
  /// The buffers a producer of the input of the product with `next` (T rows of `cols`) should
  /// quantize its output into — when that product takes int8 inputs (matmul_quantizes) and
  /// cols is whole blocks — else null. After writing them, note_quantized.
  const DeviceActQ8* fusable(const DeviceWeight& next, int64_t T, int64_t cols);
  void note_quantized(const float* x, int64_t T, int64_t cols) { note_ = {x, T, cols}; }
  void clear_note() { note_ = {}; }
  /// Between hold_input(x) and release_input(), the products of x that take 16-bit inputs
  /// (dequantize + cuBLAS) convert x once, not once per matrix: the caller promises not to
  /// write x in between (CudaSession::matmul_cols: Q, K and V, or gate and up, of one input).
  /// Host-side bookkeeping at enqueue time, as note_quantized.
  void hold_input(const float* x) { held_ = x, half_ = {}; }
  void release_input() { held_ = nullptr, half_ = {}; }

 private:
  friend void matmul(MatmulContext&, const DeviceWeight&, const float*, float*, int64_t, int64_t);
  cudaStream_t stream_;
  int64_t cap_, max_cols_;
  CudaMatmulPlan plan_;
  void* cublas_ = nullptr;  // cublasHandle_t
  DeviceBuffer act_q_, act_d_, act_s_;  // DeviceActQ8 for [cap, max_cols]
  DeviceBuffer act_h_;                  // [cap, max_cols] fp16 / bf16 activations (prefill)
  DeviceBuffer tile_;                   // [tile_rows, max_cols] fp16 dequantized weights (prefill)
  DeviceBuffer cublas_ws_;
  DeviceBuffer mmq_split_;              // MMQ's split-K partial sums
  struct Note {
    const float* x = nullptr;
    int64_t T = 0, cols = 0;
  } note_;             // what act_ holds (note_quantized)
  const float* held_ = nullptr;  // hold_input's x
  Note half_;                    // what act_h_ holds while held_ (bf16_half_: as bf16)
  bool bf16_half_ = false;
  DeviceActQ8 act_view_;  // act(), for fusable's callers
  // The activation buffers for x [T, cols]: quantized now, unless the note says they hold it.
  DeviceActQ8 quantized(const float* x, int64_t T, int64_t cols);
  // act_h_ holding x [T, cols] as fp16 (bf16: as bf16): converted now, unless held and done.
  const uint16_t* half(const float* x, int64_t T, int64_t cols, bool bf16);
};

/// y [T, w.rows] = x [T, w.cols] · wᵀ on ctx's stream (asynchronous); row t of y starts at
/// y + t · ldy (ldy = 0: w.rows), so several matrices can fill column ranges of one output.
/// T <= kGemvMaxTokens: GEMV kernels (captured into CUDA graphs: no allocation, no cuBLAS);
/// larger T: cuBLAS. Throws UsageError (base/error.h) for T > the context's capacity or
/// w.cols > max_cols.
void matmul(MatmulContext& ctx, const DeviceWeight& w, const float* x, float* y, int64_t T, int64_t ldy = 0);

/// Whether matmul quantizes its input (quantize_act) for w at T tokens: the weights gemv_reads_int8
/// names on the GEMV path (T <= kGemvMaxTokens), and those it sends to MMQ. Producers of that input can then quantize
/// it themselves (MatmulContext::note_quantized).
bool matmul_quantizes(const DeviceWeight& w, int64_t T);
/// Whether gemv reads w's activations as int8 (xq): the split types (Q8_0, Q4_0, Q4_1, Q5_0,
/// Q5_1, Q4_K, Q5_K, Q6_K).
bool gemv_reads_int8(const DeviceWeight& w);

/// cuBLAS's bf16 GEMM rate on this GPU (FLOP/s, best of `reps`): C [m, n] fp32 = A [m, k] ·
/// B [k, n], bf16 inputs (random, ±0.03), fp32 accumulation: the reference for the prefill target.
double measure_cublas_bf16_flops(int64_t m, int64_t n, int64_t k, int reps = 10);

/// The kernels behind matmul, exposed for the parity tests and the dev lab.
void quantize_act(const float* x, const DeviceActQ8& out, int64_t T, int64_t cols, cudaStream_t s);
/// GEMV: y [T, w.rows] (row t at y + t · ldy; ldy = 0: w.rows) = x [T, w.cols] · wᵀ, 1 <= T <=
/// kGemvMaxTokens. Weights for which gemv_reads_int8 holds read xq (quantize_act of x), every
/// other type reads x (fp32; the raw types' tuned kernels
/// want x 16-byte aligned, else a byte-wise kernel runs).
void gemv(const DeviceWeight& w, const float* x, const DeviceActQ8& xq, float* y, int64_t T, int64_t ldy, cudaStream_t s);
/// MMQ (engine/cuda/mmq.cu): y [T, w.rows] (row t at y + t · ldy; ldy = 0: w.rows) = the
/// int8 activations xq [T, w.cols] (quantize_act) · wᵀ on the tensor cores, for weights whose
/// column count is a multiple of 64: the split types (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K)
/// and IQ4_NL/Q2_K/Q3_K (mmq_supported). tile_tokens: tokens per CUDA
/// block (16, 32, 64 or 128; 0: mmq_tile_tokens(T)). split / split_bytes: scratch for
/// split-K (partial sums of column ranges, added in a fixed order by a second kernel), used when
/// the grid would otherwise leave most of the GPU idle (few rows, few tokens); null: no split.
/// tune: the kernel lab's overrides (dev/cuda/mmq.cu --sweep), 0 for the engine's choice: the K
/// splits (at most cols / 64, within split_bytes), the pipeline depth (stages of 64 columns in
/// flight; 3 is the engine's, 4, 6 and 8 are built for Q4_0 and Q8_0 at 16 or 32 tokens per block)
/// or, at 3 stages, the blocks per SM the kernel's registers must allow (min_blocks 3 or 4, built
/// for the same; the engine's kernel takes 128 registers there, 2 blocks per SM).
/// Throws UsageError for other weights and for overrides that do not fit.
struct MmqTuning {
  int splits = 0, stages = 0, min_blocks = 0;
};
void mmq(const DeviceWeight& w, const DeviceActQ8& xq, float* y, int64_t T, int64_t ldy, cudaStream_t s, int tile_tokens = 0,
         float* split = nullptr, uint64_t split_bytes = 0, MmqTuning tune = {});
/// MMQ on fp16 tiles (engine/cuda/mmq.cu, "MMQ on fp16 tiles"): y [T, rows] (row t at y + t ·
/// ldy; ldy 0: rows) = xh · wᵀ for Q4_0 / Q8_0 weights w (split layout, cols % 64 == 0) and fp16
/// activations xh [T, cols]: each weight dequantized to fp16 once per tile of tile_tokens (16,
/// 32 or 64; 0: mmq's pick up to 64), fp16 mma with fp32 sums. splits: K splits into the
/// scratch (0: mmq_splits's count, 1 without scratch). Throws UsageError for other types,
/// widths, tiles or splits that do not fit. The lab times it against mmq (dev/cuda/mmq.cu);
/// matmul() takes it for MMQ's batches under LLMQ_CUDA_MMQ_F16=1.
void mmq_h(const DeviceWeight& w, const uint16_t* xh, float* y, int64_t T, int64_t ldy, cudaStream_t s, int tile_tokens = 0,
           float* split = nullptr, uint64_t split_bytes = 0, int splits = 0);
bool mmq_h_supported(const DeviceWeight& w);
/// Whether matmul() runs MMQ's Q4_0 / Q8_0 batches (9..64 tokens) on mmq_h rather than the int8
/// kernel (default off, or LLMQ_CUDA_MMQ_F16=1). Process-wide; set it before products are
/// enqueued (a captured CUDA graph keeps the kernels it recorded).
void set_mmq_f16(bool on);
/// The K splits mmq uses for w at T tokens with split_bytes of scratch (1: none).
int mmq_splits(const DeviceWeight& w, int64_t T, uint64_t split_bytes);
bool mmq_supported(const DeviceWeight& w);
/// Raises every MMQ kernel's shared-memory limit (once per process); MatmulContext calls it, so a
/// CUDA graph captured later contains no such call.
void mmq_prepare();
/// The tile width mmq picks for T tokens.
int mmq_tile_tokens(int64_t T);

/// Rows [r0, r0 + n) of a quantized matrix w (split or raw layout) dequantized to fp16
/// [n, w.cols] at out (F16 and BF16 weights go to cuBLAS as they are; other types: UsageError).
void dequantize_rows_f16(const DeviceWeight& w, int64_t r0, int64_t n, uint16_t* out, cudaStream_t s);

}  // namespace llmq::cuda
