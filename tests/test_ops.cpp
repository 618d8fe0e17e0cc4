// The op-parity harness, in the manner of ggml's test-backend-ops: every op of the forward pass
// × every weight type × every backend present — the CPU's scalar, AVX2 and AVX-512 levels (those
// this CPU has), the CUDA backend (the emulator in CI: llmq-tests-cuda-emu; a GPU when there is
// one) — on fresh random inputs, against an fp64 reference written here, with a stated bound per
// op, type and backend kind. A new type is one entry in an op's `types`; a new op one row of
// ops(). Backends that lack an op say so (SKIPPED) instead of failing.
//
// Built twice: as Catch2 cases ("[ops]") and as the tool `llmq-ops` (LLMQ_OPS_MAIN):
//   llmq-ops [--perf [--peer-shapes]] [--op NAME] [--backend NAME]
// prints one line per case (error and bound), or with --perf its time, GB/s moved and, for
// matmul, tok/s, per backend; --peer-shapes: only the cases of llama.cpp's `test-backend-ops perf
// -o MUL_MAT` table (Q4_0, Q8_0, Q4_K, Q6_K, F16 at 4096 x 14336, n = 1, 8, 512), for a
// side-by-side on one GPU (scripts/gpu_check.sh: `peer` runs llama.cpp's side, `ops` this one).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/threadpool.h"
#include "engine/cpu/cpu_ops.h"
#include "formats/quant.h"
#include "models/config.h"
#include "test_util.h"

#ifdef LLMQ_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/attention.h"
#include "engine/cuda/cuda.h"
#include "engine/cuda/matmul.h"
#include "engine/cuda/ops.h"
#endif

namespace llmq::ops {

using Floats = std::vector<float>;
using Shape = std::vector<int64_t>;

/// One op prepared on one backend: `run` computes it on data already where the backend keeps it
/// (what --perf times), `result` brings the output back to the host.
struct Prepared {
  std::function<void()> run;
  std::function<Floats()> result;
};

using HostWeight = test::RandomWeight;  // a weight [rows, cols] of type t in the file's layout

/// Causal GQA attention inputs: q [T, heads·hd] at positions pos [T] over a cache k, v
/// [ctx, kv·hd] (fp16-rounded values, so a backend with an fp16 cache reads them exactly);
/// window > 0: a sliding window, token t sees positions max(0, pos + 1 - window) .. pos.
struct AttnInputs {
  int64_t heads, kv, hd, ctx, splits;
  Floats q, k, v;
  std::vector<int32_t> pos;
  float scale;
  int64_t window = 0;
};

/// What a backend computes. Each method prepares one op on host inputs; an op the backend does
/// not have returns an empty Prepared (the case is SKIPPED for it).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual bool gpu() const { return false; }
  /// y [T, rows] = x [T, cols] · Wᵀ
  virtual Prepared matmul(const Weight& w, const Floats& x, int64_t T) = 0;
  /// y [T, n] = RMSNorm(x [T, n]) · w [n]
  virtual Prepared rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t n) = 0;
  /// RoPE on qkv [T, (heads + 2·kv)·hd]: the heads + kv q and k heads rotated, v untouched.
  virtual Prepared rope(const Floats& qkv, const std::vector<int32_t>& pos, int64_t heads, int64_t kv, int64_t hd,
                        const std::vector<double>& freqs, RopeLayout layout) = 0;
  /// out [T, H] = act(h[:, :H]) ⊙ h[:, H:] for h [T, 2H]
  virtual Prepared gated(Activation act, const Floats& h, int64_t T, int64_t H) = 0;
  /// softmax of each row of x [rows, n]
  virtual Prepared softmax(const Floats& /*x*/, int64_t /*rows*/, int64_t /*n*/) { return {}; }
  /// out [T, heads·hd]: causal attention, under a sliding window when a.window > 0 (AttnInputs)
  virtual Prepared attention(const AttnInputs& a) = 0;
  /// out [T, cols] = rows tok of the table
  virtual Prepared embedding(const Weight& table, const std::vector<int32_t>& tok) = 0;
  /// x [n] = cap·tanh(x / cap)
  virtual Prepared softcap(const Floats& x, float cap) = 0;
  /// x [T, heads·hd]: each head replaced by its RMSNorm with w [hd]
  virtual Prepared head_rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t heads, int64_t hd) = 0;
};

constexpr float kEps = 1e-5f;

// ------------------------------------------------------------------------------- the CPU

/// The CPU kernels at one instruction-set level (set_cpu_level while the op runs).
class CpuBackend : public Backend {
 public:
  explicit CpuBackend(CpuLevel level) : level_(level), pool_(2) {}
  std::string name() const override { return std::string("cpu:") + cpu_level_name(level_); }

  /// The weight packed once for this level first, as Model::load does (pack_weights), so that
  /// --perf times the kernels and not a repack per call (test_kernels checks that packed and
  /// unpacked weights give the same bits).
  Prepared matmul(const Weight& w, const Floats& x, int64_t T) override {
    auto y = std::make_shared<Floats>(size_t(T * w.rows));
    auto sc = std::make_shared<MatmulScratch>();
    auto pw = std::make_shared<Weight>(w);
    auto packed = std::make_shared<PackedWeights>();
    with_level(level_, [&] { *packed = pack_weights({pw.get()}); });
    return at_level([=, this] { llmq::matmul(pool_, *sc, y->data(), x.data(), T, *pw); (void)packed; }, y);
  }
  Prepared rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t n) override {
    auto y = std::make_shared<Floats>(x.size());
    return at_level([=] { for (int64_t t = 0; t < T; ++t) llmq::rmsnorm(y->data() + t * n, x.data() + t * n, w.data(), n, kEps); }, y);
  }
  Prepared rope(const Floats& qkv, const std::vector<int32_t>& pos, int64_t heads, int64_t kv, int64_t hd, const std::vector<double>& freqs,
                RopeLayout layout) override {
    auto y = std::make_shared<Floats>();
    const int64_t ld = (heads + 2 * kv) * hd;
    return at_level([=] {
      *y = qkv;
      Floats cs(static_cast<size_t>(hd));
      for (size_t t = 0; t < pos.size(); ++t) {
        rope_angles(cs.data(), hd, pos[t], freqs.data());
        rope_rotate(y->data() + int64_t(t) * ld, heads + kv, hd, cs.data(), layout);
      }
    }, y);
  }
  Prepared gated(Activation act, const Floats& h, int64_t T, int64_t H) override {
    auto y = std::make_shared<Floats>(size_t(T * H));
    return at_level([=] {
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(h.begin() + t * 2 * H, H, y->begin() + t * H);
        gated_act(act, y->data() + t * H, h.data() + t * 2 * H + H, H);
      }
    }, y);
  }
  Prepared softmax(const Floats& x, int64_t rows, int64_t n) override {
    auto y = std::make_shared<Floats>();
    return at_level([=] {
      *y = x;
      for (int64_t r = 0; r < rows; ++r) llmq::softmax(y->data() + r * n, n);
    }, y);
  }
  // The engine's attention kernels over one KV block holding the whole context (keys
  // transposed [hd, ctx] per KV head, values [ctx, kv·hd]), the G heads of a group at once.
  Prepared attention(const AttnInputs& a) override {
    auto y = std::make_shared<Floats>(a.q.size());
    const int64_t KV = a.kv * a.hd, G = a.heads / a.kv;
    auto kT = std::make_shared<Floats>(size_t(a.kv * a.hd * a.ctx));
    for (int64_t h = 0; h < a.kv; ++h)
      for (int64_t j = 0; j < a.hd; ++j)
        for (int64_t p = 0; p < a.ctx; ++p) (*kT)[size_t((h * a.hd + j) * a.ctx + p)] = a.k[size_t(p * KV + h * a.hd + j)];
    return at_level([=] {
      std::fill(y->begin(), y->end(), 0.0f);
      Floats s(size_t(G * a.ctx));
      for (size_t t = 0; t < a.pos.size(); ++t)
        for (int64_t g = 0; g < a.kv; ++g) {  // positions first .. pos (the engine's window_start)
          const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.pos[t] + 1 - a.window) : 0, n = a.pos[t] + 1 - first;
          const float* q = a.q.data() + int64_t(t) * a.heads * a.hd + g * G * a.hd;
          attn_scores(s.data(), a.ctx, q, G, kT->data() + g * a.hd * a.ctx + first, n, a.ctx, a.hd, a.scale);
          for (int64_t i = 0; i < G; ++i) llmq::softmax(s.data() + i * a.ctx, n);
          attn_accumulate(y->data() + int64_t(t) * a.heads * a.hd + g * G * a.hd, s.data(), a.ctx, G, a.v.data() + first * KV + g * a.hd, n,
                          KV, a.hd);
        }
    }, y);
  }
  Prepared embedding(const Weight& table, const std::vector<int32_t>& tok) override {
    auto y = std::make_shared<Floats>(tok.size() * size_t(table.cols));
    return at_level([=] { for (size_t t = 0; t < tok.size(); ++t) embedding_row(y->data() + int64_t(t) * table.cols, table, tok[t]); }, y);
  }
  Prepared softcap(const Floats& x, float cap) override {
    auto y = std::make_shared<Floats>();
    return at_level([=] { *y = x, llmq::softcap(y->data(), int64_t(y->size()), cap); }, y);
  }
  Prepared head_rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t heads, int64_t hd) override {
    auto y = std::make_shared<Floats>(x.size());
    return at_level([=] { for (int64_t i = 0; i < T * heads; ++i) llmq::rmsnorm(y->data() + i * hd, x.data() + i * hd, w.data(), hd, kEps); }, y);
  }

 private:
  // `fn` run with this level active (the previous one restored after), output in *y.
  /// Runs fn with `level` active.
  static void with_level(CpuLevel level, const std::function<void()>& fn) {
    const CpuLevel before = cpu_level();
    set_cpu_level(level);
    fn();
    set_cpu_level(before);
  }
  Prepared at_level(std::function<void()> fn, std::shared_ptr<Floats> y) {
    const CpuLevel level = level_;
    return {[fn, level] { with_level(level, fn); }, [y] { return *y; }};
  }
  CpuLevel level_;
  ThreadPool pool_;
};

// ------------------------------------------------------------------------------- CUDA

#ifdef LLMQ_HAVE_CUDA
/// The CUDA backend on GPU 0 (or the emulator): inputs uploaded at prepare, outputs downloaded
/// by result(); run() ends with a device synchronisation.
class CudaBackend : public Backend {
 public:
  std::string name() const override { return "cuda"; }
  bool gpu() const override { return true; }

  Prepared matmul(const Weight& w, const Floats& x, int64_t T) override {
    std::vector<uint8_t> split(cuda::split_weight_bytes(w.type, w.rows, w.cols));
    cuda::split_weight(w.type, w.data, w.rows, w.cols, split.data());
    auto wd = up(split);
    auto view = std::make_shared<cuda::DeviceWeight>(cuda::split_weight_view(w.type, w.rows, w.cols, wd->as<uint8_t>()));
    auto ctx = std::make_shared<cuda::MatmulContext>(std::max<int64_t>(T, 1), w.cols, nullptr, 128);
    // y [T, ldy], ldy = rows + 3: the columns past rows must keep their 7s (else the result is NaN).
    const int64_t ldy = w.rows + 3;
    auto xd = up(x), yd = up(Floats(size_t(T * ldy), 7.0f));
    return {[=] {
              cuda::matmul(*ctx, *view, xd->as<float>(), yd->as<float>(), T, ldy);
              cuda::check(cudaDeviceSynchronize(), "matmul");
              (void)wd;
            },
            [=] {
              Floats all(size_t(T * ldy)), y(size_t(T * w.rows));
              yd->download(all.data(), all.size() * 4);
              for (int64_t t = 0; t < T; ++t)
                for (int64_t r = 0; r < ldy; ++r) {
                  if (r < w.rows) y[size_t(t * w.rows + r)] = all[size_t(t * ldy + r)];
                  else if (all[size_t(t * ldy + r)] != 7.0f) y[0] = NAN;
                }
              return y;
            }};
  }
  Prepared rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t n) override {
    auto xd = up(x), wd = up(w);
    auto yd = std::make_shared<cuda::DeviceBuffer>(x.size() * 4);
    return done([=] { cuda::rmsnorm(yd->as<float>(), xd->as<float>(), wd->as<float>(), T, n, kEps, nullptr); }, yd, x.size());
  }
  Prepared rope(const Floats& qkv, const std::vector<int32_t>& pos, int64_t heads, int64_t kv, int64_t hd, const std::vector<double>& freqs,
                RopeLayout layout) override {
    auto xd = up(qkv), pd = up(pos), fd = up(freqs);
    const int64_t T = int64_t(pos.size()), ld = (heads + 2 * kv) * hd;
    return done([=] {
      xd->upload(qkv.data(), qkv.size() * 4);  // in place: each run from the inputs
      cuda::rope_store_kv(xd->as<float>(), ld, pd->as<int32_t>(), nullptr, T, heads, kv, hd, fd->as<double>(), layout, nullptr, nullptr, nullptr);
    }, xd, qkv.size());
  }
  Prepared gated(Activation act, const Floats& h, int64_t T, int64_t H) override {
    auto hd = up(h);
    auto yd = std::make_shared<cuda::DeviceBuffer>(size_t(T * H) * 4);
    return done([=] { cuda::gated_act(act, yd->as<float>(), hd->as<float>(), T, H, nullptr); }, yd, size_t(T * H));
  }
  Prepared attention(const AttnInputs& a) override {
    std::vector<uint16_t> k16(a.k.size()), v16(a.v.size());
    for (size_t i = 0; i < k16.size(); ++i) k16[i] = fp32_to_fp16(a.k[i]), v16[i] = fp32_to_fp16(a.v[i]);
    auto qd = up(a.q), kd = up(k16), vd = up(v16), pd = up(a.pos);
    const int64_t T = int64_t(a.pos.size()), Q = a.heads * a.hd;
    const int64_t part_len = a.splits == 1 ? (a.ctx + 31) / 32 * 32 : (a.ctx + a.splits - 1) / a.splits / 32 * 32 + 32;
    auto part = std::make_shared<cuda::DeviceBuffer>(size_t(T * a.heads * a.splits * (a.hd + 2)) * 4);
    auto yd = std::make_shared<cuda::DeviceBuffer>(a.q.size() * 4);
    cuda::attention_prepare(a.heads, a.kv, a.hd);
    return done([=] {
      cuda::attention(qd->as<float>(), Q, kd->as<uint16_t>(), vd->as<uint16_t>(), pd->as<int32_t>(), T, a.heads, a.kv, a.hd, a.scale, a.splits,
                      part_len, part->as<float>(), yd->as<float>(), Q, nullptr, {}, {}, {}, nullptr, a.window);
    }, yd, a.q.size());
  }
  Prepared embedding(const Weight& table, const std::vector<int32_t>& tok) override {
    std::vector<uint8_t> split(cuda::split_weight_bytes(table.type, table.rows, table.cols));
    cuda::split_weight(table.type, table.data, table.rows, table.cols, split.data());
    auto wd = up(split), td = up(tok);
    auto view = std::make_shared<cuda::DeviceWeight>(cuda::split_weight_view(table.type, table.rows, table.cols, wd->as<uint8_t>()));
    auto yd = std::make_shared<cuda::DeviceBuffer>(tok.size() * size_t(table.cols) * 4);
    return done([=] { cuda::embedding(yd->as<float>(), *view, td->as<int32_t>(), int64_t(tok.size()), nullptr); (void)wd; }, yd,
                tok.size() * size_t(table.cols));
  }
  Prepared softcap(const Floats& x, float cap) override {
    auto xd = up(x);
    return done([=] {
      xd->upload(x.data(), x.size() * 4);
      cuda::softcap(xd->as<float>(), int64_t(x.size()), cap, nullptr);
    }, xd, x.size());
  }
  Prepared head_rmsnorm(const Floats& x, const Floats& w, int64_t T, int64_t heads, int64_t hd) override {
    auto xd = up(x), wd = up(w);
    return done([=] {
      xd->upload(x.data(), x.size() * 4);
      cuda::head_rmsnorm(xd->as<float>(), heads * hd, T, heads, 0, hd, wd->as<float>(), wd->as<float>(), kEps, nullptr);
    }, xd, x.size());
  }

 private:
  template <class T>
  static std::shared_ptr<cuda::DeviceBuffer> up(const std::vector<T>& v) {
    auto b = std::make_shared<cuda::DeviceBuffer>(std::max<size_t>(v.size(), 1) * sizeof(T));
    if (!v.empty()) b->upload(v.data(), v.size() * sizeof(T));
    return b;
  }
  static Prepared done(std::function<void()> fn, std::shared_ptr<cuda::DeviceBuffer> out, size_t n) {
    return {[fn] {
              fn();
              cuda::check(cudaDeviceSynchronize(), "op");
            },
            [out, n] {
              Floats y(n);
              out->download(y.data(), n * 4);
              return y;
            }};
  }
};
#endif

// ------------------------------------------------------------------------------- the ops

/// One case of an op: its output on a backend and the fp64 reference, plus what --perf reports.
struct CaseRun {
  Prepared prepared;
  std::vector<double> ref;
  double bytes = 0;   // bytes the op must move (weights, inputs, outputs)
  double tokens = 0;  // tokens it processes (tok/s; 0: not reported)
  /// The part of the output `ref` holds, when the reference covers only some of it (a model-sized
  /// case too costly in fp64); null: all of it.
  std::function<Floats(const Floats&)> checked = {};
};

/// One row of the harness: an op, the weight types it takes (F32 alone when none), its shapes,
/// the case maker (inputs from the seed, the reference, the backend's run) and its bound.
struct Op {
  std::string name;
  std::vector<DType> types;
  std::vector<Shape> shapes;
  std::function<CaseRun(Backend&, DType, const Shape&, std::mt19937_64&)> make;
  std::function<double(DType, const Backend&, const Shape&)> bound;
  /// Whether the shape is a case of this type (a weight's rows must be whole blocks); default all.
  std::function<bool(DType, const Shape&)> valid = {};
  /// The shapes --perf times (model-sized); empty: `shapes`.
  std::vector<Shape> perf_shapes = {};
  /// --perf --peer-shapes: the shapes and types llama.cpp's test-backend-ops times for this op
  /// (empty: the op is not in that table).
  std::vector<Shape> peer_shapes = {};
  std::vector<DType> peer_types = {};
};

// Every weight type, for the ops that take weights.
const std::vector<DType>& kAllTypes = all_dtypes();

// For ops whose shape[1] is a weight's columns.
bool whole_blocks(DType t, const Shape& s) { return s[1] % int64_t(dtype_info(t).block) == 0; }

std::vector<double> as_double(const Floats& v) { return std::vector<double>(v.begin(), v.end()); }

double rel_err(const Floats& got, const std::vector<double>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) e += (got[i] - ref[i]) * (got[i] - ref[i]), r += ref[i] * ref[i];
  return std::sqrt(e / std::max(r, 1e-300));
}

std::vector<double> ref_rmsnorm(const float* x, const float* w, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const double s = 1.0 / std::sqrt(ss / double(n) + kEps);
  std::vector<double> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[size_t(i)] = x[i] * s * w[i];
  return y;
}

Op matmul_op() {
  // (rows, cols, T): awkward sizes for the float types; the block types' cols are whole blocks.
  // T = 1 is decode (GEMV), 5 and 8 the GPU's GEMV batches, 17 and 64 MMQ or cuBLAS; 21 x 1280:
  // five 256-weight super-blocks (the K-quant GEMVs' groups of eight lanes take four at a time)
  // and an odd row count (their warps take two rows).
  return {"matmul",
          kAllTypes,
          {{37, 64, 1}, {130, 96, 5}, {33, 160, 8}, {129, 256, 17}, {64, 512, 64}, {7, 33, 3}, {65, 172, 17}, {19, 256, 1},
           {40, 768, 6}, {21, 1280, 3}},
          [](Backend& b, DType t, const Shape& s, std::mt19937_64& rng) {
            const int64_t rows = s[0], cols = s[1], T = s[2];
            auto w = std::make_shared<HostWeight>(t, rows, cols, rng);
            const Floats x = test::gaussian(size_t(T * cols), rng);
            // The reference: every row, or the first 64 of a model-sized case (over 2^31 products).
            const int64_t ref_rows = rows * cols * T > (int64_t(1) << 31) ? std::min<int64_t>(rows, 64) : rows;
            std::vector<double> ref(size_t(T * ref_rows));
            Floats row(static_cast<size_t>(cols));
            for (int64_t r = 0; r < ref_rows; ++r) {
              dequantize_row(t, w->w.row(r), row.data(), cols);
              for (int64_t i = 0; i < T; ++i) {
                double a = 0;
                for (int64_t k = 0; k < cols; ++k) a += double(row[size_t(k)]) * x[size_t(i * cols + k)];
                ref[size_t(i * ref_rows + r)] = a;
              }
            }
            CaseRun c{b.matmul(w->w, x, T), ref, double(w->bytes.size()) + double(x.size() + T * rows) * 4, double(T)};
            if (ref_rows < rows)
              c.checked = [rows, ref_rows, T](const Floats& y) {
                Floats part(size_t(T * ref_rows));
                for (int64_t i = 0; i < T; ++i) std::copy_n(y.begin() + i * rows, ref_rows, part.begin() + i * ref_rows);
                return part;
              };
            auto keep = c.prepared.run;
            c.prepared.run = [keep, w] { keep(); };  // the weight lives as long as the case
            return c;
          },
          [](DType t, const Backend& b, const Shape& s) {
            // The GPU's GEMVs (T <= 8) take fp32 activations for every type but the split ones
            // (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: cuda::gemv_reads_int8), that is
            // for the raw Q2_K, Q3_K and IQ4_NL.
            const bool int8_act = t != DType::Q2_K && t != DType::Q3_K && t != DType::IQ4_NL;
            if (dtype_info(t).block > 1 && b.gpu() && s[2] <= 8 && !int8_act) return 1e-5;
            if (dtype_info(t).block > 1) return 2e-2;  // activations quantized to int8 per block of 32
            if (t == DType::F32 || !b.gpu() || s[2] <= 8) return 1e-5;
            return t == DType::BF16 ? 8e-3 : 2e-3;  // the GPU's cuBLAS path rounds activations to bf16 / fp16
          },
          whole_blocks,
          {{4096, 4096, 1}, {4096, 4096, 8}, {2048, 2048, 128}},  // --perf: decode, a batch, a prefill chunk
          // test-backend-ops perf -o MUL_MAT, m = 4096, k = 14336, n = 1 / 8 / 512 (scripts/gpu_check.sh peer, ops)
          {{4096, 14336, 1}, {4096, 14336, 8}, {4096, 14336, 512}},
          {DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::F16}};
}

/// matmul under a process-wide CPU setting: `set(true)` before each run of a case, `set(false)`
/// after it; types and shapes as given, no --perf shapes.
Op matmul_with(const char* name, std::vector<DType> types, std::vector<Shape> shapes, void (*set)(bool)) {
  Op m = matmul_op();
  m.name = name, m.types = std::move(types), m.shapes = std::move(shapes);
  m.perf_shapes.clear(), m.peer_shapes.clear(), m.peer_types.clear();
  auto make = m.make;
  m.make = [make, set](Backend& b, DType t, const Shape& s, std::mt19937_64& rng) {
    CaseRun c = make(b, t, s, rng);
    if (auto keep = c.prepared.run)
      c.prepared.run = [keep, set] {
        set(true);
        keep();
        set(false);
      };
    return c;
  };
  return m;
}

/// matmul against the K-quants with one activation scale per 256 values (set_kquant_act_group,
/// llama.cpp's Q8_K rule), the CPU levels' only other activation rule; the CUDA backend ignores
/// it (its K-quant GEMVs take int8 activations per 32, or fp32 for the raw Q2_K/Q3_K).
Op matmul_k256_op() {
  return matmul_with("matmul_k256", {DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K},
                     {{19, 256, 1}, {40, 768, 6}, {21, 1280, 3}, {33, 512, 17}}, [](bool on) { set_kquant_act_group(on ? 256 : 32); });
}

/// matmul with the activations kept in fp32 (set_float_activations: every quantized weight's rows
/// dequantized, fp32 dot products), the exact model of the file: 1e-5 of fp64 on the CPU for
/// every quantized type; the CUDA backend ignores the setting (the matmul bounds above).
Op matmul_f32act_op() {
  std::vector<DType> quantized;
  for (DType t : kAllTypes)
    if (is_quantized(t)) quantized.push_back(t);
  Op m = matmul_with("matmul_f32act", quantized, {{37, 64, 1}, {19, 256, 1}, {40, 768, 6}, {33, 512, 17}}, set_float_activations);
  auto bound = m.bound;
  m.bound = [bound](DType t, const Backend& b, const Shape& s) { return b.gpu() ? bound(t, b, s) : 1e-5; };
  return m;
}

/// matmul's batches of 9..64 tokens on the CUDA backend's fp16-tile MMQ (set_mmq_f16) for Q4_0
/// and Q8_0: activations rounded to fp16 rather than int8, so 2e-3 of fp64 on the GPU; the CPU
/// backends ignore the setting (their matmul bound).
Op matmul_mmq_h_op() {
  void (*set)(bool) = [](bool on) {
#ifdef LLMQ_HAVE_CUDA
    cuda::set_mmq_f16(on);
#else
    (void)on;
#endif
  };
  Op m = matmul_with("matmul_mmq_h", {DType::Q4_0, DType::Q8_0}, {{129, 256, 17}, {64, 512, 64}, {65, 192, 33}, {300, 128, 9}}, set);
  auto bound = m.bound;
  m.bound = [bound](DType t, const Backend& b, const Shape& s) { return b.gpu() ? 2e-3 : bound(t, b, s); };
  return m;
}

Op rmsnorm_op() {
  return {"rmsnorm", {DType::F32}, {{5, 8}, {3, 300}, {2, 4096}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            const int64_t T = s[0], n = s[1];
            const Floats x = test::gaussian(size_t(T * n), rng), w = test::gaussian(size_t(n), rng);
            std::vector<double> ref;
            for (int64_t t = 0; t < T; ++t) {
              const auto y = ref_rmsnorm(x.data() + t * n, w.data(), n);
              ref.insert(ref.end(), y.begin(), y.end());
            }
            return CaseRun{b.rmsnorm(x, w, T, n), ref, double(x.size() * 8 + w.size() * 4), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

Op rope_op() {
  // (T, heads, kv, hd, layout): positions up to 399, both pair layouts.
  return {"rope", {DType::F32}, {{5, 6, 2, 8, 0}, {5, 6, 2, 64, 1}, {3, 4, 4, 128, 0}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            const int64_t T = s[0], heads = s[1], kv = s[2], hd = s[3], ld = (heads + 2 * kv) * hd;
            const RopeLayout layout = s[4] ? RopeLayout::RotateHalf : RopeLayout::Interleaved;
            const Floats x = test::gaussian(size_t(T * ld), rng);
            std::vector<int32_t> pos;
            for (int64_t t = 0; t < T; ++t) pos.push_back(int32_t(rng() % 400));
            const std::vector<double> f = test::rope_freqs(hd, 10000.0);
            std::vector<double> ref = as_double(x);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t h = 0; h < heads + kv; ++h)
                for (int64_t i = 0; i < hd / 2; ++i) {  // the complex rotation of pair i by pos · f[i]
                  const int64_t a = layout == RopeLayout::Interleaved ? 2 * i : i, c = layout == RopeLayout::Interleaved ? 2 * i + 1 : i + hd / 2;
                  double* p = ref.data() + t * ld + h * hd;
                  const double ang = double(pos[size_t(t)]) * f[size_t(i)], x0 = p[a], x1 = p[c];
                  p[a] = x0 * std::cos(ang) - x1 * std::sin(ang), p[c] = x0 * std::sin(ang) + x1 * std::cos(ang);
                }
            return CaseRun{b.rope(x, pos, heads, kv, hd, f, layout), ref, double(x.size() * 8), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

Op gated_op(Activation act) {
  return {act == Activation::GeGLU ? "geglu" : "swiglu", {DType::F32}, {{3, 7}, {3, 1000}, {2, 96}},
          [act](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            const int64_t T = s[0], H = s[1];
            Floats h = test::gaussian(size_t(T * 2 * H), rng);
            for (float& v : h) v *= 3.0f;  // well into both tails of the activation
            std::vector<double> ref(size_t(T * H));
            for (int64_t t = 0; t < T; ++t)
              for (int64_t i = 0; i < H; ++i) {
                const double g = h[size_t(t * 2 * H + i)], u = h[size_t(t * 2 * H + H + i)];
                const double a = act == Activation::GeGLU ? 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)))
                                                          : g / (1 + std::exp(-g));
                ref[size_t(t * H + i)] = a * u;
              }
            return CaseRun{b.gated(act, h, T, H), ref, double(h.size() * 4 + ref.size() * 4), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

Op softmax_op() {
  return {"softmax", {DType::F32}, {{4, 1}, {3, 7}, {2, 300}, {1, 4099}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            const int64_t rows = s[0], n = s[1];
            Floats x = test::gaussian(size_t(rows * n), rng);
            for (float& v : x) v *= 8.0f;
            std::vector<double> ref(x.size());
            for (int64_t r = 0; r < rows; ++r) {
              double m = -1e300, z = 0;
              for (int64_t i = 0; i < n; ++i) m = std::max(m, double(x[size_t(r * n + i)]));
              for (int64_t i = 0; i < n; ++i) z += (ref[size_t(r * n + i)] = std::exp(x[size_t(r * n + i)] - m));
              for (int64_t i = 0; i < n; ++i) ref[size_t(r * n + i)] /= z;
            }
            return CaseRun{b.softmax(x, rows, n), ref, double(x.size() * 8), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

Op attention_op() {
  // (heads, kv, hd, T, first position, splits, step[, window]): T tokens at positions first,
  // first + step, ... (step 1: a prompt; T = 1: decode; step 4: a batch of sequences' tokens
  // whose tiles some rows of a block see and others not), GQA groups of 1 to 4, the GPU's
  // flash-decoding parts (splits > 1), sliding windows (Mistral, Gemma 3, Phi-3) that start
  // inside a round, a tile, a part.
  return {"attention", {DType::F32},
          {{4, 4, 8, 17, 200, 1, 1}, {8, 2, 64, 3, 0, 1, 1}, {8, 2, 64, 1, 299, 5, 1}, {32, 8, 128, 16, 100, 1, 1},
           {6, 3, 40, 1, 130, 10, 1}, {4, 1, 256, 2, 50, 1, 1}, {8, 2, 64, 70, 13, 1, 4}, {8, 2, 64, 70, 13, 10, 4},
           {14, 2, 64, 17, 100, 1, 1}, {14, 2, 64, 1, 299, 5, 1},  // Qwen2.5-0.5B's groups of 7
           {8, 2, 64, 1, 299, 5, 1, 77}, {4, 1, 256, 1, 250, 5, 1, 13}, {6, 3, 40, 1, 200, 10, 1, 50}, {8, 8, 128, 40, 150, 1, 1, 70},
           {4, 1, 256, 20, 200, 1, 1, 9}, {8, 2, 64, 70, 13, 1, 4, 100}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            AttnInputs a{s[0], s[1], s[2], 300, s[5], {}, {}, {}, {}, float(1.0 / std::sqrt(double(s[2]))), s.size() > 7 ? s[7] : 0};
            const int64_t T = s[3], KV = a.kv * a.hd, Q = a.heads * a.hd;
            a.q = test::gaussian(size_t(T * Q), rng), a.k = test::gaussian(size_t(a.ctx * KV), rng), a.v = test::gaussian(size_t(a.ctx * KV), rng);
            for (float& x : a.k) x = fp16_to_fp32(fp32_to_fp16(x));
            for (float& x : a.v) x = fp16_to_fp32(fp32_to_fp16(x));
            for (int64_t t = 0; t < T; ++t) a.pos.push_back(int32_t(s[4] + s[6] * t));
            std::vector<double> ref(a.q.size());
            for (int64_t t = 0; t < T; ++t)
              for (int64_t h = 0; h < a.heads; ++h) {
                const int64_t kvh = h / (a.heads / a.kv), n = a.pos[size_t(t)] + 1;
                const int64_t first = a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;  // weight 0 before it
                std::vector<double> sc(static_cast<size_t>(n), -1e300);
                double m = -1e300, z = 0;
                for (int64_t p = first; p < n; ++p) {
                  double d = 0;
                  for (int64_t j = 0; j < a.hd; ++j) d += double(a.q[size_t(t * Q + h * a.hd + j)]) * a.k[size_t(p * KV + kvh * a.hd + j)];
                  m = std::max(m, sc[size_t(p)] = d * a.scale);
                }
                for (double& e : sc) z += (e = std::exp(e - m));
                for (int64_t j = 0; j < a.hd; ++j) {
                  double o = 0;
                  for (int64_t p = 0; p < n; ++p) o += sc[size_t(p)] * a.v[size_t(p * KV + kvh * a.hd + j)];
                  ref[size_t(t * Q + h * a.hd + j)] = o / z;
                }
              }
            const double bytes = double(T) * double(a.pos.back() + 1) * double(KV) * 2 * 2 + double(a.q.size()) * 8;  // fp16 K, V read
            return CaseRun{b.attention(a), ref, bytes, 0};
          },
          [](DType, const Backend& b, const Shape& s) {
            // the GPU's prompt kernel runs 16+ tokens of head_dim 64 or 128 on the tensor cores (fp16 q, weights)
            return b.gpu() && s[3] >= 16 && s[5] == 1 && (s[2] == 64 || s[2] == 128) ? 1e-3 : 1e-4;
          }};
}

Op embedding_op() {
  return {"embedding", kAllTypes, {{50, 64, 7}, {300, 96, 3}, {40, 512, 5}},
          [](Backend& b, DType t, const Shape& s, std::mt19937_64& rng) {
            auto w = std::make_shared<HostWeight>(t, s[0], s[1], rng);
            std::vector<int32_t> tok;
            for (int64_t i = 0; i < s[2]; ++i) tok.push_back(int32_t(rng() % uint64_t(s[0])));
            std::vector<double> ref;
            Floats row(static_cast<size_t>(s[1]));
            for (int32_t id : tok) {
              dequantize_row(t, w->w.row(id), row.data(), s[1]);
              ref.insert(ref.end(), row.begin(), row.end());
            }
            CaseRun c{b.embedding(w->w, tok), ref, double(ref.size()) * 4 * 2, 0};
            auto keep = c.prepared.run;
            c.prepared.run = [keep, w] { keep(); };
            return c;
          },
          [](DType, const Backend&, const Shape&) { return 1e-7; }, whole_blocks};
}

Op softcap_op() {
  return {"softcap", {DType::F32}, {{1000}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            Floats x = test::gaussian(size_t(s[0]), rng);
            for (float& v : x) v *= 40.0f;
            std::vector<double> ref;
            for (float v : x) ref.push_back(30.0 * std::tanh(double(v) / 30.0));
            return CaseRun{b.softcap(x, 30.0f), ref, double(x.size() * 8), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

Op head_rmsnorm_op() {
  return {"head_rmsnorm", {DType::F32}, {{5, 6, 64}, {2, 8, 128}, {3, 4, 256}},
          [](Backend& b, DType, const Shape& s, std::mt19937_64& rng) {
            const int64_t T = s[0], heads = s[1], hd = s[2];
            const Floats x = test::gaussian(size_t(T * heads * hd), rng), w = test::gaussian(size_t(hd), rng);
            std::vector<double> ref;
            for (int64_t i = 0; i < T * heads; ++i) {
              const auto y = ref_rmsnorm(x.data() + i * hd, w.data(), hd);
              ref.insert(ref.end(), y.begin(), y.end());
            }
            return CaseRun{b.head_rmsnorm(x, w, T, heads, hd), ref, double(x.size() * 8), 0};
          },
          [](DType, const Backend&, const Shape&) { return 1e-6; }};
}

/// Every op of the harness.
std::vector<Op> ops() {
  return {matmul_op(), matmul_k256_op(), matmul_f32act_op(), matmul_mmq_h_op(), rmsnorm_op(), rope_op(), gated_op(Activation::SwiGLU), gated_op(Activation::GeGLU), softmax_op(),
          attention_op(), embedding_op(), softcap_op(), head_rmsnorm_op()};
}

/// The backends of this binary: the CPU levels this CPU has (unless cpu = false), and CUDA when
/// built with it and a device (or the emulator) is there.
std::vector<std::unique_ptr<Backend>> backends(bool cpu, bool cuda) {
  std::vector<std::unique_ptr<Backend>> b;
  if (cpu)
    for (CpuLevel l : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512})
      if (cpu_level_supported(l)) b.push_back(std::make_unique<CpuBackend>(l));
#ifdef LLMQ_HAVE_CUDA
  int n = 0;
  if (cuda && cudaGetDeviceCount(&n) == cudaSuccess && n > 0) b.push_back(std::make_unique<CudaBackend>());
#else
  (void)cuda;
#endif
  return b;
}

/// One line of the report.
struct Result {
  std::string op, type, shape, backend;
  bool skipped = false, ok = true;
  double err = 0, bound = 0, seconds = 0, gb_s = 0, tok_s = 0;
};

std::string shape_str(const Shape& s) {
  std::string r;
  for (int64_t d : s) {
    if (!r.empty()) r += 'x';
    r += std::to_string(d);
  }
  return r;
}

/// Runs every case of `op_filter` (all when empty) on every backend of `bs` whose name matches
/// `backend_filter`; perf: also times each (best of runs filling about 20 ms); peer: only the
/// ops, types and shapes of llama.cpp's test-backend-ops table (Op::peer_shapes).
std::vector<Result> run_all(const std::vector<std::unique_ptr<Backend>>& bs, uint64_t seed, bool perf, const std::string& op_filter = "",
                            const std::string& backend_filter = "", bool peer = false) {
  std::vector<Result> out;
  for (const Op& op : ops()) {
    if (!op_filter.empty() && op.name != op_filter) continue;
    if (peer && op.peer_shapes.empty()) continue;
    for (DType t : peer ? op.peer_types : op.types)
      for (const Shape& s : peer ? op.peer_shapes : perf && !op.perf_shapes.empty() ? op.perf_shapes : op.shapes)
        for (const auto& b : bs) {
          if (op.valid && !op.valid(t, s)) continue;
          if (!backend_filter.empty() && b->name() != backend_filter) continue;
          std::mt19937_64 rng(seed ^ std::hash<std::string>()(op.name + shape_str(s) + dtype_name(t)));  // same inputs on every backend
          Result r{op.name, dtype_name(t), shape_str(s), b->name()};
          CaseRun c = op.make(*b, t, s, rng);
          if (!c.prepared.run) {
            r.skipped = true;
            out.push_back(r);
            continue;
          }
          c.prepared.run();
          r.err = rel_err(c.checked ? c.checked(c.prepared.result()) : c.prepared.result(), c.ref);
          r.bound = op.bound(t, *b, s);
          r.ok = r.err <= r.bound;
          if (perf) {
            double best = 1e30;
            for (int rep = 0, runs = 1; rep < 5; ++rep) {
              const auto t0 = std::chrono::steady_clock::now();
              for (int i = 0; i < runs; ++i) c.prepared.run();
              const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / runs;
              best = std::min(best, dt);
              runs = int(std::clamp(0.02 / std::max(dt, 1e-9), 1.0, 1e5));
            }
            r.seconds = best, r.gb_s = c.bytes / best / 1e9, r.tok_s = c.tokens > 0 ? c.tokens / best : 0;
          }
          out.push_back(r);
        }
  }
  return out;
}

}  // namespace llmq::ops

#ifndef LLMQ_OPS_MAIN
#include <catch2/catch.hpp>

namespace {

void check_all(bool cpu, bool cuda, const char* what) {
  using namespace llmq;
  const uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  const auto bs = ops::backends(cpu, cuda);
  if (bs.empty()) {
    std::printf("SKIPPED: %s (no backend here)\n", what);
    return;
  }
  int cases = 0, skipped = 0;
  for (const ops::Result& r : ops::run_all(bs, seed, false)) {
    if (r.skipped) {
      ++skipped;
      continue;
    }
    ++cases;
    INFO(r.op << " " << r.type << " " << r.shape << " on " << r.backend << ": error " << r.err << ", bound " << r.bound);
    CHECK(r.ok);
  }
  std::printf("op harness (%s): %d cases passed or failed above, %d skipped (op not on that backend)\n", what, cases, skipped);
}

}  // namespace

#ifdef LLMQ_CUDA_EMU
TEST_CASE("op harness: every op x type on the CUDA backend = the fp64 reference", "[ops][cuda]") { check_all(false, true, "cuda (emulated)"); }
#else
TEST_CASE("op harness: every op x type x CPU level (and a GPU when present) = the fp64 reference", "[ops]") {
  check_all(true, true, "cpu levels + cuda");
}
#endif

#else  // llmq-ops: the harness as a tool

int main(int argc, char** argv) {
  using namespace llmq;
  bool perf = false, peer = false;
  std::string op, backend;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--perf") perf = true;
    else if (a == "--peer-shapes") peer = perf = true;
    else if (a == "--op" && i + 1 < argc) op = argv[++i];
    else if (a == "--backend" && i + 1 < argc) backend = argv[++i];
    else {
      std::fprintf(stderr, "usage: llmq-ops [--perf [--peer-shapes]] [--op NAME] [--backend NAME]\n");
      return 1;
    }
  }
  try {
    const auto bs = ops::backends(true, true);
    int failed = 0;
    std::printf("%-12s %-5s %-16s %-11s %-10s %-8s%s\n", "op", "type", "shape", "backend", "error", "bound",
                perf ? "       us      GB/s      tok/s" : "");
    for (const ops::Result& r : ops::run_all(bs, test::fresh_seed(), perf, op, backend, peer)) {
      if (r.skipped) {
        std::printf("%-12s %-5s %-16s %-11s SKIPPED (not on this backend)\n", r.op.c_str(), r.type.c_str(), r.shape.c_str(), r.backend.c_str());
        continue;
      }
      failed += !r.ok;
      std::printf("%-12s %-5s %-16s %-11s %-10.2e %-8.0e%s", r.op.c_str(), r.type.c_str(), r.shape.c_str(), r.backend.c_str(), r.err, r.bound,
                  r.ok ? "" : " FAIL");
      if (perf) std::printf(" %9.2f %9.2f %10.1f", r.seconds * 1e6, r.gb_s, r.tok_s);
      std::printf("\n");
    }
    std::printf("%d failed\n", failed);
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmq-ops: %s\n", e.what());
    return 2;
  }
}

#endif
