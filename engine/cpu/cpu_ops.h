// CPU kernels of the forward pass. Each has a plain reference (`ref_*`, used by the tests as
// ground truth) where the fast version differs from the obvious loop.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include "base/buffer.h"
#include "base/threadpool.h"
#include "formats/quant.h"
#include "models/config.h"

namespace llmq {

/// A weight matrix in the mapped file: W [rows, cols], row-major, each row
/// `row_bytes(type, cols)` bytes.
struct Weight {
  DType type = DType::F32;
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;
  /// The same matrix in the active CPU level's packed layout (pack_weights), or null. When set,
  /// the AVX-512 matmul reads only this copy (engine/cpu/cpu_x86.cpp, "Packed weights").
  const uint8_t* packed = nullptr;

  size_t row_stride() const { return row_bytes(type, cols); }
  const uint8_t* row(int64_t r) const { return data + size_t(r) * row_stride(); }
};

/// Activations quantized on the fly for integer dot products against the quantized weight types:
/// 32 values = fp32 scale d + int8 q, plus s = d * sum(q) (needed by the minimum term of Q4_1,
/// Q5_1, Q4_K and Q5_K).
struct BlockQ8Act {
  float d;
  float s;
  int8_t qs[QK];
};

/// The scale shared by one group of activations: dequantized value = d·q, q = round-to-nearest-
/// even(x·id), both 0 when the group's max |x| is 0.
///  - group 32 (llmq's rule): d = amax/127, id = 1/d;
///  - group 256 (llama.cpp's Q8_K rule, ggml-quants.c quantize_row_q8_K_ref): id = 127/amax,
///    d = 1/id (llama.cpp negates both when the largest value is negative; d·q is the same).
struct ActScale {
  float d, id;
};
inline ActScale act_scale(float amax, int group) {
  if (group == QK) {
    const float d = amax / 127.0f;
    return d != 0.0f ? ActScale{d, 1.0f / d} : ActScale{0.0f, 0.0f};  // (a denormal amax can give d = 0)
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  return id != 0.0f && id < 3.0e38f ? ActScale{1.0f / id, id} : ActScale{0.0f, 0.0f};  // (and an infinite id)
}

/// Values per activation scale in matmuls against K-quant weights (Q2_K … Q6_K): 32 (the
/// default: the rule of every other type, and the more accurate) or 256 (one scale per
/// super-block, the granularity of llama.cpp's Q8_K activations: with it llmq's error against
/// the exact model equals llama.cpp's, bench/RESULTS.md "Gemma-3-270M against llama.cpp, taken
/// apart"). The first call reads LLMQ_KQUANT_ACT (32 | 256; anything else: a warning and 32).
/// Blocks of 32 are stored either way (BlockQ8Act), so the kernels are the same.
int kquant_act_group();
/// Sets kquant_act_group() (32 or 256, else UsageError). Not while kernels run.
void set_kquant_act_group(int group);
/// The activation group matmul uses for a weight of `type`: kquant_act_group() for the
/// K-quants, 32 for every other type.
int act_group(DType type);
/// Whether matmuls against quantized weights keep the activations in fp32: each weight row is
/// dequantized and dotted with the fp32 activations (the exact model of the file, as a converter
/// to F32 would give it, at the speed of the scalar float path) instead of quantizing them to
/// int8 per 32 (the default). A fidelity check, not a speed mode: llama.cpp's distance from the
/// exact model is then all that separates the two (bench/RESULTS.md, "Gemma-3-270M against
/// llama.cpp, taken apart"). The first call reads LLMQ_MATMUL_ACT (int8 | f32; anything else: a
/// warning and int8).
bool float_activations();
/// Sets float_activations(). Not while kernels run.
void set_float_activations(bool on);

/// Reusable buffers for matmul (sized on first use, never shrunk).
struct MatmulScratch {
  std::vector<BlockQ8Act> xq;               // [T, cols/32] quantized activations
  std::vector<std::vector<float>> rowbuf;   // per thread: one dequantized weight row [cols]
  std::vector<int32_t> xsum, corr;          // SIMD: [T, cols/32] Σq per block, integer corrections
  std::vector<uint8_t> prep;                // SIMD: activations in the kernel's layout (+64 to align)
  std::vector<std::vector<uint8_t>> tbuf;   // SIMD: per thread kernel scratch, e.g. a repacked panel
};

/// What the MatmulScratch buffers grow to (the memory plan of engine/mem_plan.h reserves it up
/// front, so matmul never allocates). Counts are elements of each vector as declared above.
struct MatmulScratchPlan {
  size_t xq = 0, xsum = 0, corr = 0;  ///< elements: max over matmuls of T · cols/32
  size_t prep = 0;                    ///< bytes: max prep layout + 64 alignment slack (SIMD only)
  size_t tbuf = 0;                    ///< bytes per thread: max kernel scratch + 64 (SIMD only)
  size_t rowbuf = 0;                  ///< floats per thread: one F16/BF16 row (scalar level only)
  int threads = 0;                    ///< entries of tbuf and rowbuf (ThreadPool::size())
  /// Bytes of all the buffers: xq·sizeof(BlockQ8Act) + (xsum + corr)·4 + prep
  /// + threads·(tbuf + rowbuf·4).
  uint64_t bytes() const;
};

/// Widens `p` to cover matmul(pool, s, y, x, T', w) for every T' in [1, T] and a weight of
/// `type` with `cols` columns, at the active CPU level (cpu_level()) with `threads` threads;
/// mirrors the growth rules inside matmul exactly.
void plan_matmul_scratch(MatmulScratchPlan& p, DType type, int64_t cols, int64_t T, int threads);
/// Allocates every buffer of `s` to the sizes of `p` (from empty vectors, so capacity == size).
void reserve_matmul_scratch(MatmulScratch& s, const MatmulScratchPlan& p);
/// Bytes held by the buffers of `s` (vector capacities, element bytes only).
uint64_t matmul_scratch_bytes(const MatmulScratch& s);

/// Instruction-set level of the CPU kernels. Scalar is plain C++ (any CPU); Avx2 needs
/// AVX2 + FMA + F16C; Avx512 needs AVX-512 F/BW/VL/DQ/VNNI. The SIMD levels exist on x86-64 only.
enum class CpuLevel { Scalar = 0, Avx2 = 1, Avx512 = 2 };

/// "scalar", "avx2" or "avx512".
const char* cpu_level_name(CpuLevel level);
/// Parses a level name ("scalar", "avx2", "avx512"); throws UsageError for anything else.
CpuLevel cpu_level_from_name(const char* name);
/// True when this CPU and build can run `level` (Scalar always can).
bool cpu_level_supported(CpuLevel level);
/// The best level this CPU supports.
CpuLevel cpu_best_level();
/// The level that matmul, quantize_act_q8, dot_f32 and axpy_f32 use. The first call reads the
/// environment variable LLMQ_CPU (scalar | avx2 | avx512 | auto): unset or "auto" means
/// cpu_best_level(); an unknown name or a level this CPU lacks falls back to the best level
/// with a warning on stderr.
CpuLevel cpu_level();
/// Forces the level (tests, benchmarks); throws UsageError if !cpu_level_supported(level).
/// Must not be called while kernels run on other threads.
void set_cpu_level(CpuLevel level);
/// Name of the active level, cpu_level_name(cpu_level()), for tools to print ("avx512", ...).
const char* cpu_kernels_name();

/// Weights repacked by pack_weights: one allocation (huge pages) holding every packed matrix;
/// bytes() == 0 when nothing was packed.
using PackedWeights = HugeBuffer;

/// Bytes pack_weights would allocate for `ws` at the active level (0 when the level has no
/// packed layout, or LLMQ_PACK=0).
uint64_t packed_weights_bytes(const std::vector<const Weight*>& ws);
/// Rows per panel of the active level's packed layout (AVX2 8, AVX-512 16); 0 without one.
int packed_panel_rows();

/// Repacks every weight of `ws` whose type has a packed layout at the active CPU level and points
/// its `packed` at the copy (engine/cpu/cpu_x86.cpp): AVX-512 packs every quantized type into
/// 16-row panels, AVX2 into 8-row panels (two per 16 rows), the file's bytes rearranged so that
/// one panel is one sequential stream (AVX-512 widens the K-quants' scales to fp32; AVX2 keeps
/// them as bytes). Other weights and the scalar level are left alone. The environment variable
/// LLMQ_PACK=0 turns packing off (the kernels then pack each panel per call: for measurements
/// only). Results of matmul are bit-identical with and without packing. The weights' `data`
/// stays valid (the scalar level reads it). Each matrix is packed in chunks of 1024 rows;
/// `on_packed`, when given, is called with each chunk (a view of those rows) right after its
/// copy is written (Model::load releases the file's pages of it there, so that a matrix's file
/// pages and its copy are not resident together). Throws std::bad_alloc if the copy
/// does not fit.
PackedWeights pack_weights(const std::vector<Weight*>& ws, const std::function<void(const Weight&)>& on_packed = {});

/// Rows [r0, r0 + n) of w as a weight of their own (a view: data and, when w is packed and r0
/// is a multiple of 16, packed point into w's buffers; otherwise packed is null).
Weight weight_rows(const Weight& w, int64_t r0, int64_t n);

/// y [T, W.rows] = x [T, W.cols] · Wᵀ, in W's stored type, split over the pool's threads by
/// rows of W (every weight row is read once for all T tokens: batched prefill).
/// F32/F16/BF16 weights use fp32 activations; the quantized types use activations quantized
/// to 8 bits per block of 32 (as llama.cpp does; it uses blocks of 256 for the K-quants) and
/// integer dot products per 32-weight (sub-)block.
void matmul(ThreadPool& pool, MatmulScratch& s, float* y, const float* x, int64_t T, const Weight& w);

/// One product of matmul_many: y [T, w->rows].
struct MatmulOut {
  float* y;
  const Weight* w;
};

/// y_i = x [T, cols] · W_iᵀ for up to 8 weights that read the same activations (Q, K and V;
/// the FFN's gate and up): when they share type and column count, the activations are quantized
/// once and the rows of all of them are split over the threads in one operation, else it is
/// one matmul per weight. Results are bit-identical with separate matmul calls.
void matmul_many(ThreadPool& pool, MatmulScratch& s, const float* x, int64_t T, std::initializer_list<MatmulOut> outs);

/// Reference for matmul: every weight row dequantized to fp32, fp64 accumulation, fp32 activations.
void ref_matmul(float* y, const float* x, int64_t T, const Weight& w);

/// Runs `rounds` rounds of the active level's int8 peak loop (12 independent `vpdpbusd` per
/// round at the AVX-512 level, 24 `vpmaddubsw` + `vpaddw` at AVX2: engine/cpu/cpu_x86.h,
/// Kernels::int8_dot_loop) on the calling thread
/// and returns the multiply-adds done (12 · 64 · rounds); 0 when the level has no such loop.
uint64_t int8_dot_peak_loop(int64_t rounds);

/// Quantizes n activations (n a multiple of `group`, 32 or 256) into n/32 BlockQ8Act: each
/// group of `group` values shares one scale (act_scale of its max |x|), q = round-to-nearest-
/// even(x·id), and each block of 32 gets s = d·Σq. Every level gives bit-identical results.
void quantize_act_q8(const float* x, BlockQ8Act* out, int64_t n, int group = QK);

/// Σ a[i]·b[i] in fp32 at the active level (several vector accumulators, fixed order; the
/// scalar level uses 8 accumulators). For attention scores.
float dot_f32(const float* a, const float* b, int64_t n);

/// y[i] += a·x[i] for i < n, at the active level.
void axpy_f32(float* y, float a, const float* x, int64_t n);

/// Attention scores (scaled dot-product attention, Vaswani et al. 2017) of G query heads
/// q [G, hd] (consecutive) against n <= bt keys of one KV-cache block, whose keys are stored
/// transposed: kT [hd, bt], kT[j·bt + p] = dimension j of position p (engine/kv_cache.h):
///   s[g·ss + p] = scale · Σ_j q[g·hd + j]·kT[j·bt + p]   for g < G, p < n.
/// Every level sums j in the same order: four partial sums over j ≡ 0, 1, 2, 3 (mod 4),
/// added as (s0 + s1) + (s2 + s3) (fused multiply-adds at the SIMD levels, vectorized along p),
/// so a head's scores do not depend on G (decode and batched prefill agree bit for bit).
void attn_scores(float* s, int64_t ss, const float* q, int64_t G, const float* kT, int64_t n, int64_t bt, int64_t hd,
                 float scale);

/// Attention's weighted sum of values for G heads: out[g·hd + j] += Σ_p a[g·as + p]·v[p·stride + j]
/// for g < G, j < hd, the positions p < n added in order (fused multiply-add at the SIMD levels,
/// vectorized along j; a head's result does not depend on G). v is [n, stride] (V is stored
/// position-major).
void attn_accumulate(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride,
                     int64_t hd);

/// bf16 KV-cache blocks (KvType::BF16 in engine/kv_cache.h) pair their values for `vdpbf16ps`:
/// K [hd/2, bt, 2]: element (j, p) at ((j/2)·bt + p)·2 + j%2 (dimensions 2i, 2i+1 of a
/// position side by side); V [bt/2, hd, 2]: element (p, j) at ((p/2)·hd + j)·2 + p%2
/// (positions 2i, 2i+1 of a dimension side by side).
/// attn_scores on bf16 operands: q [G, hd] in bf16, k one bf16 K block;
///   s[g·ss + p] = scale · Σ_j q[g·hd + j]·k(j, p)   for g < G, p < n,
/// products exact in fp32 (bf16 × bf16), sums in fp32 (at the AVX-512 level `vdpbf16ps` where
/// the CPU has AVX512_BF16, two partial sums over pairs i mod 2). Relative error about 2^-8 from
/// rounding q and k to bf16; hd even.
void attn_scores_bf16(float* s, int64_t ss, const uint16_t* q, int64_t G, const uint16_t* k, int64_t n, int64_t bt,
                      int64_t hd, float scale);
/// attn_accumulate on bf16 operands: out[g·hd + j] += Σ_{p<n} a[g·as + p]·v(p, j), a the softmax
/// weights rounded to bf16, v one bf16 V block; positions in pairs (2i, 2i+1) in order, so when
/// n is odd a[g·as + n] must be 0 (and v(n, j) finite).
void attn_accumulate_bf16(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n, int64_t hd);

/// dst[i] = src[i] rounded to bf16 (nearest even; formats/quant.h fp32_to_bf16) for i < n. The
/// AVX-512 level (`vcvtneps2bf16`) flushes denormal inputs to zero.
void to_bf16(uint16_t* dst, const float* src, int64_t n);

/// out[n] = x[n] / sqrt(mean(x²) + eps) * w[n]   (RMSNorm, Zhang & Sennrich 2019).
void rmsnorm(float* out, const float* x, const float* w, int64_t n, float eps);

/// Rotary embedding (Su et al. 2021), in two steps so that a batch computes each token's angles
/// once for every layer, q and k. rope_angles: the angles at position `pos`,
/// cs[i] = cos(pos·freqs[i]), cs[head_dim/2 + i] = its sine, i < head_dim/2 (fp64, rounded to
/// fp32); freqs [head_dim/2] from ModelConfig::rope_freqs (θ^(-2i/head_dim), maybe scaled).
void rope_angles(float* cs, int64_t head_dim, int64_t pos, const double* freqs);
/// Rotates n_heads vectors of head_dim in place by the angles cs (rope_angles): pair i turns by
/// angle i. Interleaved pairs are (2i, 2i+1); rotate-half pairs are (i, i + head_dim/2).
void rope_rotate(float* v, int64_t n_heads, int64_t head_dim, const float* cs, RopeLayout layout);

/// In-place softmax over x[n] (max-subtracted). The SIMD levels use a vector e^x (about 2 ulp)
/// and fp32 lane sums; the scalar level std::exp and an fp64 sum.
/// Returns l = Σ_i e^(x_i - m) (before normalizing) and, if max_out, stores m = max_i x_i: what
/// merging the softmaxes of several ranges of positions needs (split decode attention).
float softmax(float* x, int64_t n, float* max_out = nullptr);

/// SwiGLU (Shazeer 2020): gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g)
/// (vector e^x at the SIMD levels, as softmax).
void swiglu(float* gate, const float* up, int64_t n);
/// GeGLU (Shazeer 2020; Gemma): gate[i] = gelu(gate[i]) * up[i], gelu by its tanh approximation
/// 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))) (Hendrycks & Gimpel 2016; PyTorch's
/// gelu(approximate="tanh"), which Gemma's `gelu_pytorch_tanh` is), computed at every level as the
/// same function g / (1 + e^(−2·√(2/π)·(g + 0.044715·g³))) (SIMD levels: their vector e^x): the
/// tanh form cancels in 1 + tanh for negative g (up to 7% relative error in fp32, p99 9e-4,
/// against 2e-6 max for the sigmoid form; measured over 4M N(0, 2) inputs against fp64).
void geglu(float* gate, const float* up, int64_t n);
/// The gated activation of `act` (models/config.h): swiglu or geglu.
void gated_act(Activation act, float* gate, const float* up, int64_t n);
/// Logit soft-capping (Gemma 2): x[i] = cap · tanh(x[i] / cap), cap > 0.
void softcap(float* x, int64_t n, float cap);
/// x[t, j] += bias[j] for a row-major x [rows, n] (a linear layer's bias, e.g. Qwen2's q/k/v).
void add_bias(float* x, const float* bias, int64_t rows, int64_t n);

/// Row `token` of an embedding matrix [vocab, dim] dequantized into out[dim].
void embedding_row(float* out, const Weight& emb, int64_t token);

}  // namespace llmq
