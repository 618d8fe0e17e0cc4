#include "engine/cpu/cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "engine/cpu/cpu_x86.h"
#include "base/env_setting.h"
#include "base/error.h"

namespace llmq {

// ---------------------------------------------------------------- instruction-set level

namespace {

std::atomic<int> g_level{-1};  // CpuLevel, -1 until first use

CpuLevel level_from_env() {
  const CpuLevel best = cpu_best_level();
  const char* env = std::getenv("LLMQ_CPU");
  if (!env || !*env || std::strcmp(env, "auto") == 0) return best;
  try {
    const CpuLevel want = cpu_level_from_name(env);
    if (cpu_level_supported(want)) return want;
    std::fprintf(stderr, "llmq: LLMQ_CPU=%s is not supported by this CPU; using %s\n", env, cpu_level_name(best));
  } catch (const std::exception&) {
    std::fprintf(stderr, "llmq: unknown LLMQ_CPU=%s (scalar, avx2, avx512, auto); using %s\n", env, cpu_level_name(best));
  }
  return best;
}

// The SIMD kernel table of the active level, nullptr for the scalar level.
const x86::Kernels* active_kernels() {
  switch (cpu_level()) {
    case CpuLevel::Avx512: return x86::kernels_avx512();
    case CpuLevel::Avx2: return x86::kernels_avx2();
    default: return nullptr;
  }
}

}  // namespace

const char* cpu_level_name(CpuLevel level) {
  switch (level) {
    case CpuLevel::Avx2: return "avx2";
    case CpuLevel::Avx512: return "avx512";
    default: return "scalar";
  }
}

CpuLevel cpu_level_from_name(const char* name) {
  for (CpuLevel l : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512})
    if (std::strcmp(name, cpu_level_name(l)) == 0) return l;
  throw UsageError(std::string("unknown CPU level '") + name + "' (scalar, avx2, avx512)");
}

bool cpu_level_supported(CpuLevel level) {
  switch (level) {
    case CpuLevel::Scalar: return true;
    case CpuLevel::Avx2: return x86::kernels_avx2() && x86::cpu_has_avx2();
    case CpuLevel::Avx512: return x86::kernels_avx512() && x86::cpu_has_avx512();
  }
  return false;
}

CpuLevel cpu_best_level() {
  if (cpu_level_supported(CpuLevel::Avx512)) return CpuLevel::Avx512;
  if (cpu_level_supported(CpuLevel::Avx2)) return CpuLevel::Avx2;
  return CpuLevel::Scalar;
}

CpuLevel cpu_level() {
  int l = g_level.load(std::memory_order_acquire);
  if (l < 0) {
    static const CpuLevel from_env = level_from_env();  // read once, thread-safe
    int expected = -1;
    g_level.compare_exchange_strong(expected, int(from_env), std::memory_order_acq_rel);
    l = g_level.load(std::memory_order_acquire);
  }
  return CpuLevel(l);
}

void set_cpu_level(CpuLevel level) {
  if (!cpu_level_supported(level))
    throw UsageError(std::string("CPU level ") + cpu_level_name(level) + " is not supported on this machine");
  g_level.store(int(level), std::memory_order_release);
}

const char* cpu_kernels_name() { return cpu_level_name(cpu_level()); }

// ---------------------------------------------------------------- activation groups

namespace {

int kquant_group_from_env() {
  const char* env = std::getenv("LLMQ_KQUANT_ACT");
  if (!env || !*env || std::strcmp(env, "32") == 0) return QK;
  if (std::strcmp(env, "256") == 0) return QK_K;
  std::fprintf(stderr, "llmq: unknown LLMQ_KQUANT_ACT=%s (32, 256); using 32\n", env);
  return QK;
}

int float_act_from_env() {
  const char* env = std::getenv("LLMQ_MATMUL_ACT");
  if (!env || !*env || std::strcmp(env, "int8") == 0) return 0;
  if (std::strcmp(env, "f32") == 0) return 1;
  std::fprintf(stderr, "llmq: unknown LLMQ_MATMUL_ACT=%s (int8, f32); using int8\n", env);
  return 0;
}

EnvSetting g_kquant_group(kquant_group_from_env);
EnvSetting g_float_act(float_act_from_env);

// Quantized weights whose matmul takes the fp32 path (dequantized rows) instead of int8 activations.
bool float_path(DType type) { return is_quantized(type) && float_activations(); }

}  // namespace

int kquant_act_group() { return g_kquant_group.get(); }

void set_kquant_act_group(int group) {
  if (group != QK && group != QK_K)
    throw UsageError("the activation group of K-quant matmuls is 32 or 256, not " + std::to_string(group));
  g_kquant_group.set(group);
}

int act_group(DType type) { return dtype_info(type).block == QK_K ? kquant_act_group() : QK; }

bool float_activations() { return g_float_act.get() == 1; }

void set_float_activations(bool on) { g_float_act.set(on ? 1 : 0); }

// ---------------------------------------------------------------- dot products

namespace {

// fp32 dot with 8 independent accumulators (lets the compiler use vector registers without
// -ffast-math, and keeps rounding independent of the thread count).
float dot_f32_acc8(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

inline int32_t dot_i8_32(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
  for (int j = 0; j < QK; ++j) s += int32_t(a[j]) * int32_t(b[j]);
  return s;
}

float dot_q8_0(const BlockQ8_0* w, const BlockQ8Act* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) sum += fp16_to_fp32(w[i].d) * x[i].d * float(dot_i8_32(w[i].qs, x[i].qs));
  return sum;
}

// Unpacks 16 bytes of nibbles into 32 values in 0..15 (low nibbles first, then high).
inline void unpack_nibbles(const uint8_t* qs, int8_t* out) {
  for (int j = 0; j < QK / 2; ++j) {
    out[j] = int8_t(qs[j] & 0x0f);
    out[j + QK / 2] = int8_t(qs[j] >> 4);
  }
}

float dot_q4_0(const BlockQ4_0* w, const BlockQ8Act* x, int64_t nb) {
  float sum = 0.0f;
  int8_t q[QK];
  for (int64_t i = 0; i < nb; ++i) {
    unpack_nibbles(w[i].qs, q);
    for (int j = 0; j < QK; ++j) q[j] = int8_t(q[j] - 8);
    sum += fp16_to_fp32(w[i].d) * x[i].d * float(dot_i8_32(q, x[i].qs));
  }
  return sum;
}

// w = d*q + m, so w·x = d * dx * Σ q*qx + m * Σ x, and Σ x over the block is x.s.
float dot_q4_1(const BlockQ4_1* w, const BlockQ8Act* x, int64_t nb) {
  float sum = 0.0f;
  int8_t q[QK];
  for (int64_t i = 0; i < nb; ++i) {
    unpack_nibbles(w[i].qs, q);
    sum += fp16_to_fp32(w[i].d) * x[i].d * float(dot_i8_32(q, x[i].qs)) + fp16_to_fp32(w[i].m) * x[i].s;
  }
  return sum;
}

// Any other quantized type (Q5_0, Q5_1, Q2_K … Q6_K) through formats/quant.h's QuantBlock:
// per block x.d · (a0 · Σ_{i<16} (q_i − o) q_x,i + a1 · Σ_{i≥16} …) − m · s_x; Q2_K's minimum per
// half: − x.d · (m0 · Σ_{i<16} q_x,i + m1 · Σ_{i≥16} q_x,i).
float dot_quant_blocks(DType t, const uint8_t* row, const BlockQ8Act* x, int64_t nb) {
  float sum = 0.0f;
  QuantBlock qb;
  for (int64_t b = 0; b < nb; ++b) {
    decode_quant_block(t, row, b, qb);
    int32_t half[2] = {0, 0}, xs[2] = {0, 0};
    for (int i = 0; i < QK; ++i) half[i / 16] += (int32_t(qb.q[i]) - qb.offset) * int32_t(x[b].qs[i]), xs[i / 16] += x[b].qs[i];
    sum += x[b].d * (qb.a[0] * float(half[0]) + qb.a[1] * float(half[1]));
    if (t == DType::Q2_K) sum -= x[b].d * (qb.m[0] * float(xs[0]) + qb.m[1] * float(xs[1]));
    else sum -= qb.m[0] * x[b].s;
  }
  return sum;
}


}  // namespace

namespace {

void quantize_act_q8_scalar(const float* x, BlockQ8Act* out, int64_t n, int group) {
  const int per = group / QK;  // blocks of 32 sharing one scale
  for (int64_t g = 0; g < n / group; ++g) {
    float amax = 0.0f;
    for (int j = 0; j < group; ++j) amax = std::max(amax, std::fabs(x[g * group + j]));
    const ActScale sc = act_scale(amax, group);
    for (int i = 0; i < per; ++i) {
      BlockQ8Act& o = out[g * per + i];
      const float* xb = x + (g * per + i) * QK;
      int32_t sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int q = int(std::nearbyint(xb[j] * sc.id));
        o.qs[j] = int8_t(q);
        sum += q;
      }
      o.d = sc.d;
      o.s = sc.d * float(sum);
    }
  }
}

// 64-byte aligned pointer into a byte buffer grown to at least n + 64 bytes.
uint8_t* aligned_buffer(std::vector<uint8_t>& v, size_t n) {
  if (v.size() < n + 64) v.resize(n + 64);
  const auto p = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - p % 64) % 64);
}

// A decode matmul (one token) with at most this many weight bytes runs on the calling thread:
// waking the pool's workers costs 10-30 µs on the 2-core VM this was measured on (dev/cpu),
// about what one core needs to stream 1 MiB, so splitting smaller matrices only adds latency.
constexpr size_t kInlineDecodeBytes = size_t(1) << 20;       // pool threads sleep between operations
constexpr size_t kInlineDecodeBytesSpin = size_t(64) << 10;  // pool threads poll (ThreadPool::spins)

// Runs fn(u0, u1, thread) over [0, units), on the pool or (small decode work) inline.
void run_units(ThreadPool& pool, bool inline_work, int64_t units, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (inline_work) fn(0, units, 0);
  else pool.parallel_for(units, fn);
}

// matmul with the SIMD kernels of one level (see cpu_x86.h) for n weights of the same type
// and column count: the activations are quantized once, and the rows of all the weights, in
// units of 16, are split over the threads in one operation. Every output element gets the same
// instructions whatever the split and whichever weights share the call.
void matmul_simd(const x86::Kernels& k, ThreadPool& pool, MatmulScratch& s, const float* x, int64_t T,
                 const MatmulOut* outs, size_t n_outs) {
  const int64_t K = outs[0].w->cols;
  const DType type = outs[0].w->type;
  int64_t units = 0;
  size_t bytes = 0;
  int64_t first_unit[8];  // first unit of each weight (n_outs <= 8)
  for (size_t i = 0; i < n_outs; ++i) {
    first_unit[i] = units;
    units += (outs[i].w->rows + 15) / 16;
    bytes += size_t(outs[i].w->rows) * outs[i].w->row_stride();
  }
  const bool inline_work = T == 1 && bytes <= (pool.spins() ? kInlineDecodeBytesSpin : kInlineDecodeBytes);
  // Units [u0, u1) of the concatenated weights as row ranges of each weight.
  auto for_rows = [&](int64_t u0, int64_t u1, const auto& fn) {
    for (size_t i = 0; i < n_outs; ++i) {
      const int64_t M = outs[i].w->rows, a = std::max(u0, first_unit[i]), b = std::min(u1, first_unit[i] + (M + 15) / 16);
      if (a < b) fn(outs[i], (a - first_unit[i]) * 16, std::min(M, (b - first_unit[i]) * 16));
    }
  };
  if (!is_quantized(type)) {
    run_units(pool, inline_work, units, [&](int64_t u0, int64_t u1, int) {
      for_rows(u0, u1, [&](const MatmulOut& o, int64_t r0, int64_t r1) { k.matmul_float(o.y, x, T, *o.w, r0, r1); });
    });
    return;
  }
  const int64_t nb = K / QK;
  const size_t n = size_t(T * nb);
  if (s.xq.size() < n) s.xq.resize(n);
  if (s.xsum.size() < n) s.xsum.resize(n);
  if (s.corr.size() < n) s.corr.resize(n);
  BlockQ8Act* xq = s.xq.data();
  int32_t* xsum = s.xsum.data();
  x86::QuantActs a;
  a.xq = xq;
  a.T = T;
  a.nb = nb;
  a.corr = s.corr.data();
  uint8_t* prep = aligned_buffer(s.prep, k.prep_bytes(type, T, K));
  a.prep = prep;
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    k.quantize_act(x + t0 * K, xq + t0 * nb, xsum + t0 * nb, (t1 - t0) * K, act_group(type));
    k.prepare_quant(type, a, xsum, t0, t1, s.corr.data(), prep);
  });
  const size_t tb = k.thread_bytes(type, T, K);
  if (s.tbuf.size() < size_t(pool.size())) s.tbuf.resize(size_t(pool.size()));
  for (auto& b : s.tbuf) aligned_buffer(b, tb);
  run_units(pool, inline_work, units, [&](int64_t u0, int64_t u1, int thread) {
    uint8_t* scratch = aligned_buffer(s.tbuf[size_t(thread)], tb);
    for_rows(u0, u1, [&](const MatmulOut& o, int64_t r0, int64_t r1) { k.matmul_quant(o.y, a, *o.w, r0, r1, scratch); });
  });
}

}  // namespace

uint64_t MatmulScratchPlan::bytes() const {
  return uint64_t(xq) * sizeof(BlockQ8Act) + uint64_t(xsum + corr) * sizeof(int32_t) + prep +
         uint64_t(threads) * (tbuf + rowbuf * sizeof(float));
}

void plan_matmul_scratch(MatmulScratchPlan& p, DType type, int64_t cols, int64_t T, int threads) {
  p.threads = std::max(p.threads, threads);
  const auto n = size_t(T * (cols / QK));
  if (const x86::Kernels* k = active_kernels()) {  // as matmul_simd
    if (!is_quantized(type)) return;
    p.xq = std::max(p.xq, n), p.xsum = std::max(p.xsum, n), p.corr = std::max(p.corr, n);
    for (int64_t t = 1; t <= T; ++t) {  // aligned_buffer() keeps 64 bytes of slack
      p.prep = std::max(p.prep, k->prep_bytes(type, t, cols) + 64);
      p.tbuf = std::max(p.tbuf, k->thread_bytes(type, t, cols) + 64);
    }
    return;
  }
  if (is_quantized(type)) p.xq = std::max(p.xq, n);  // as the scalar matmul
  else if (type != DType::F32) p.rowbuf = std::max(p.rowbuf, size_t(cols));
}

void reserve_matmul_scratch(MatmulScratch& s, const MatmulScratchPlan& p) {
  s.xq.resize(p.xq);
  s.xsum.resize(p.xsum);
  s.corr.resize(p.corr);
  s.prep.resize(p.prep);
  s.tbuf.resize(p.tbuf ? size_t(p.threads) : 0);
  for (auto& b : s.tbuf) b.resize(p.tbuf);
  s.rowbuf.resize(size_t(p.threads));
  for (auto& b : s.rowbuf) b.resize(p.rowbuf);
}

uint64_t matmul_scratch_bytes(const MatmulScratch& s) {
  uint64_t n = uint64_t(s.xq.capacity()) * sizeof(BlockQ8Act) + uint64_t(s.xsum.capacity() + s.corr.capacity()) * sizeof(int32_t) +
               s.prep.capacity();
  for (const auto& b : s.tbuf) n += b.capacity();
  for (const auto& b : s.rowbuf) n += uint64_t(b.capacity()) * sizeof(float);
  return n;
}

namespace {
bool packing_enabled() {
  const char* env = std::getenv("LLMQ_PACK");
  return !(env && std::strcmp(env, "0") == 0);
}
}  // namespace

int packed_panel_rows() {
  const x86::Kernels* k = active_kernels();
  return k && k->packed_bytes ? k->packed_rows : 0;
}

uint64_t packed_weights_bytes(const std::vector<const Weight*>& ws) {
  const x86::Kernels* k = active_kernels();
  if (!k || !k->packed_bytes || !packing_enabled()) return 0;
  uint64_t n = 0;
  for (const Weight* w : ws) n += k->packed_bytes(w->type, w->rows, w->cols);
  return n;
}

PackedWeights pack_weights(const std::vector<Weight*>& ws, const std::function<void(const Weight&)>& on_packed) {
  PackedWeights out;
  const uint64_t total = packed_weights_bytes(std::vector<const Weight*>(ws.begin(), ws.end()));
  if (total == 0) return out;
  const x86::Kernels* k = active_kernels();
  out = HugeBuffer(total, /*zero=*/false);  // each matrix's part is zeroed just before it is packed: the
  uint8_t* dst = out.data();               // copies become resident one by one as the file's pages go
  constexpr int64_t kChunkRows = 1024;  // whole 16-row panels: a chunk packs to the bytes it has in the whole
  for (Weight* w : ws) {
    const size_t n = k->packed_bytes(w->type, w->rows, w->cols);
    if (n == 0) continue;
    for (int64_t r0 = 0; r0 < w->rows; r0 += kChunkRows) {  // chunks, so a large matrix's file pages go as it is packed
      const Weight part{w->type, w->row(r0), std::min(kChunkRows, w->rows - r0), w->cols};
      uint8_t* at = dst + k->packed_bytes(w->type, r0, w->cols);
      std::memset(at, 0, k->packed_bytes(w->type, part.rows, w->cols));
      k->pack_quant(part, at);
      if (on_packed) on_packed(part);
    }
    w->packed = dst;
    dst += n;  // a multiple of 64: every matrix starts aligned
  }
  return out;
}

Weight weight_rows(const Weight& w, int64_t r0, int64_t n) {
  Weight v{w.type, w.row(r0), n, w.cols};
  const x86::Kernels* k = active_kernels();
  if (w.packed && r0 % 16 == 0 && k && k->packed_bytes)  // panels of 16 rows, each packed_bytes(type, 16, cols)
    v.packed = w.packed + size_t(r0 / 16) * k->packed_bytes(w.type, 16, w.cols);
  return v;
}

void quantize_act_q8(const float* x, BlockQ8Act* out, int64_t n, int group) {
  if (group != QK && group != QK_K) throw UsageError("quantize_act_q8: group must be 32 or 256");
  if (const x86::Kernels* k = active_kernels()) k->quantize_act(x, out, nullptr, n, group);
  else quantize_act_q8_scalar(x, out, n, group);
}

float dot_f32(const float* a, const float* b, int64_t n) {
  if (const x86::Kernels* k = active_kernels()) return k->dot(a, b, n);
  return dot_f32_acc8(a, b, n);
}

void axpy_f32(float* y, float a, const float* x, int64_t n) {
  if (const x86::Kernels* k = active_kernels()) return k->axpy(y, a, x, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void attn_scores(float* s, int64_t ss, const float* q, int64_t G, const float* kT, int64_t n, int64_t bt, int64_t hd,
                 float scale) {
  if (const x86::Kernels* k = active_kernels()) return k->attn_scores(s, ss, q, G, kT, n, bt, hd, scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < n; ++p) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t j = 0; j < hd; ++j) acc[j % 4] += q[g * hd + j] * kT[j * bt + p];
      s[g * ss + p] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * scale;
    }
}

void attn_accumulate(float* out, const float* a, int64_t as, int64_t G, const float* v, int64_t n, int64_t stride,
                     int64_t hd) {
  if (const x86::Kernels* k = active_kernels()) return k->attn_accumulate(out, a, as, G, v, n, stride, hd);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < n; ++p) {
      const float* vp = v + p * stride;
      for (int64_t j = 0; j < hd; ++j) out[g * hd + j] += a[g * as + p] * vp[j];
    }
}

void attn_scores_bf16(float* s, int64_t ss, const uint16_t* q, int64_t G, const uint16_t* k, int64_t n, int64_t bt,
                      int64_t hd, float scale) {
  if (const x86::Kernels* kk = active_kernels(); kk && kk->attn_scores_bf16)
    return kk->attn_scores_bf16(s, ss, q, G, k, n, bt, hd, scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < n; ++p) {
      float acc = 0.0f;
      for (int64_t i = 0; i < hd / 2; ++i) {
        const uint16_t* kp = k + (i * bt + p) * 2;
        acc += bf16_to_fp32(q[g * hd + 2 * i]) * bf16_to_fp32(kp[0]) + bf16_to_fp32(q[g * hd + 2 * i + 1]) * bf16_to_fp32(kp[1]);
      }
      s[g * ss + p] = acc * scale;
    }
}

void attn_accumulate_bf16(float* out, const uint16_t* a, int64_t as, int64_t G, const uint16_t* v, int64_t n, int64_t hd) {
  if (const x86::Kernels* kk = active_kernels(); kk && kk->attn_accumulate_bf16)
    return kk->attn_accumulate_bf16(out, a, as, G, v, n, hd);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < (n + 1) / 2; ++i) {
      const float a0 = bf16_to_fp32(a[g * as + 2 * i]), a1 = bf16_to_fp32(a[g * as + 2 * i + 1]);
      const uint16_t* vp = v + i * hd * 2;
      for (int64_t j = 0; j < hd; ++j) out[g * hd + j] += a0 * bf16_to_fp32(vp[2 * j]) + a1 * bf16_to_fp32(vp[2 * j + 1]);
    }
}

void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (const x86::Kernels* k = active_kernels(); k && k->to_bf16) return k->to_bf16(dst, src, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_bf16(src[i]);
}

// ---------------------------------------------------------------- matmul

uint64_t int8_dot_peak_loop(int64_t rounds) {
  const x86::Kernels* k = active_kernels();
  if (!k || !k->int8_dot_loop) return 0;
  static std::atomic<int64_t> sink{0};
  sink.fetch_add(k->int8_dot_loop(rounds), std::memory_order_relaxed);
  return uint64_t(rounds) * 12 * 64;
}

void matmul_many(ThreadPool& pool, MatmulScratch& s, const float* x, int64_t T, std::initializer_list<MatmulOut> outs) {
  const x86::Kernels* k = active_kernels();
  bool shared = k && outs.size() <= 8 && !float_path(outs.begin()->w->type);
  for (const MatmulOut& o : outs)
    shared = shared && o.w->type == outs.begin()->w->type && o.w->cols == outs.begin()->w->cols;
  if (shared) return matmul_simd(*k, pool, s, x, T, outs.begin(), outs.size());
  for (const MatmulOut& o : outs) matmul(pool, s, o.y, x, T, *o.w);
}

void matmul(ThreadPool& pool, MatmulScratch& s, float* y, const float* x, int64_t T, const Weight& w) {
  if (const x86::Kernels* k = active_kernels(); k && !float_path(w.type)) {
    const MatmulOut out{y, &w};
    return matmul_simd(*k, pool, s, x, T, &out, 1);
  }
  const int64_t M = w.rows, K = w.cols;
  if (is_quantized(w.type) && !float_path(w.type)) {
    const int64_t nb = K / QK;
    if (s.xq.size() < size_t(T * nb)) s.xq.resize(size_t(T * nb));
    BlockQ8Act* xq = s.xq.data();
    pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) quantize_act_q8_scalar(x + t * K, xq + t * nb, K, act_group(w.type));
    });
    pool.parallel_for(M, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.row(r);
        for (int64_t t = 0; t < T; ++t) {
          const BlockQ8Act* xt = xq + t * nb;
          float v = 0.0f;
          switch (w.type) {
            case DType::Q8_0: v = dot_q8_0(reinterpret_cast<const BlockQ8_0*>(row), xt, nb); break;
            case DType::Q4_0: v = dot_q4_0(reinterpret_cast<const BlockQ4_0*>(row), xt, nb); break;
            case DType::Q4_1: v = dot_q4_1(reinterpret_cast<const BlockQ4_1*>(row), xt, nb); break;
            default: v = dot_quant_blocks(w.type, row, xt, nb); break;
          }
          y[t * M + r] = v;
        }
      }
    });
    return;
  }
  if (s.rowbuf.size() < size_t(pool.size())) s.rowbuf.resize(size_t(pool.size()));
  pool.parallel_for(M, [&](int64_t r0, int64_t r1, int thread) {
    std::vector<float>& buf = s.rowbuf[size_t(thread)];
    if (w.type != DType::F32 && buf.size() < size_t(K)) buf.resize(size_t(K));
    for (int64_t r = r0; r < r1; ++r) {
      const float* wr;
      if (w.type == DType::F32) {
        wr = reinterpret_cast<const float*>(w.row(r));
      } else {
        dequantize_row(w.type, w.row(r), buf.data(), K);
        wr = buf.data();
      }
      for (int64_t t = 0; t < T; ++t) y[t * M + r] = dot_f32_acc8(wr, x + t * K, K);
    }
  });
}

void ref_matmul(float* y, const float* x, int64_t T, const Weight& w) {
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.row(r), row.data(), w.cols);
    for (int64_t t = 0; t < T; ++t) {
      double acc = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) acc += double(row[size_t(k)]) * double(x[t * w.cols + k]);
      y[t * w.rows + r] = float(acc);
    }
  }
}

// ---------------------------------------------------------------- element-wise ops

void rmsnorm(float* out, const float* x, const float* w, int64_t n, float eps) {
  // Σx² in fp64 over 8 interleaved partial sums (i mod 8), added in a fixed order: 8 independent
  // chains instead of one long one (the sum was a visible part of prefill), same at every level.
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8)
    for (int k = 0; k < 8; ++k) part[k] += double(x[i0 + k]) * double(x[i0 + k]);
  for (int k = 0; i0 + k < n; ++k) part[k] += double(x[i0 + k]) * double(x[i0 + k]);
  const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void rope_angles(float* cs, int64_t head_dim, int64_t pos, const double* freqs) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = double(pos) * freqs[i];
    cs[i] = float(std::cos(angle));
    cs[half + i] = float(std::sin(angle));
  }
}

void rope_rotate(float* v, int64_t n_heads, int64_t head_dim, const float* cs, RopeLayout layout) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[i], s = cs[half + i];
    const int64_t a = layout == RopeLayout::Interleaved ? 2 * i : i;
    const int64_t b = layout == RopeLayout::Interleaved ? 2 * i + 1 : i + half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* p = v + h * head_dim;
      const float x0 = p[a], x1 = p[b];
      p[a] = x0 * c - x1 * s;
      p[b] = x0 * s + x1 * c;
    }
  }
}

float softmax(float* x, int64_t n, float* max_out) {
  if (const x86::Kernels* k = active_kernels()) return k->softmax(x, n, max_out);
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  if (max_out) *max_out = mx;
  return float(sum);
}

void swiglu(float* gate, const float* up, int64_t n) {
  if (const x86::Kernels* k = active_kernels()) return k->swiglu(gate, up, n);
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void geglu(float* gate, const float* up, int64_t n) {
  if (const x86::Kernels* k = active_kernels()) return k->geglu(gate, up, n);
  constexpr float k2Sqrt2OverPi = 2.0f * 0.7978845608028654f;  // 0.5·(1 + tanh y) = 1 / (1 + e^(−2y))
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-k2Sqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
  }
}

void gated_act(Activation act, float* gate, const float* up, int64_t n) {
  if (act == Activation::GeGLU) geglu(gate, up, n);
  else swiglu(gate, up, n);
}

void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void add_bias(float* x, const float* bias, int64_t rows, int64_t n) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < n; ++j) x[t * n + j] += bias[j];
}

void embedding_row(float* out, const Weight& emb, int64_t token) {
  dequantize_row(emb.type, emb.row(token), out, emb.cols);
}

}  // namespace llmq
