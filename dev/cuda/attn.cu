// Attention lab: the engine's attention() (engine/cuda/attention.h) timed on Llama shapes with a
// random fp16 cache: a 512-token prompt (TFLOP/s of the causal products, 4 · hd per visible
// (query, position) pair) and decode steps at 512 and 4096 cached positions (GB/s of the K and V
// bytes read, from copies of the cache in turn so that they come cold from HBM; flash-decoding
// parts of 64 positions plus their merge; version 1, attention_kernel, and version 3,
// attention_decode_v3_kernel, checked against the first's output; version 2 was removed after
// the fifth GPU session, dev/README.md #15). Version 3 also at block targets of 264, 1056 and
// 2048 besides its default 528 (set_decode_v3_blocks: fewer or more parts). What the lab times
// alone moves far more than whole decode does (dev/README.md #22): confirm a winner end to end
// (scripts/gpu_check.sh blocks).
// Then a batched decode step of 32 sequences through block tables (llmq-server's; batched_step).
// LLMQ_CUDA_ATTN=0 in the environment puts prompts on the CUDA-core kernel instead of the
// tensor cores, for comparison.
//
//   dev/cuda/build.sh && build-gpu/dev/attn && LLMQ_CUDA_ATTN=0 build-gpu/dev/attn
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/cuda/attention.h"
#include "engine/cuda/cuda.h"
#include "engine/cuda/matmul.h"

using namespace llmq;
using namespace llmq::cuda;

// The decode variants timed: version 1, then version 3 at its default block target (528: 132 SMs
// x 4) and at 132 x 2 and x 8 blocks and 2048 (the default until the sixth GPU session).
struct Variant {
  int version;
  int64_t v3_blocks;  // 0: the default
};
constexpr Variant kVariants[] = {{1, 0}, {3, 0}, {3, 264}, {3, 1056}, {3, 2048}};

void use(const Variant& v) { set_decode_attention_version(v.version), set_decode_v3_blocks(v.v3_blocks); }
void use_defaults() { set_decode_attention_version(0), set_decode_v3_blocks(0); }

// "v1", "v3", "v3 b528": a variant's label.
std::string label(const Variant& v) { return "v" + std::to_string(v.version) + (v.v3_blocks ? " b" + std::to_string(v.v3_blocks) : ""); }

// A batched decode step as llmq-server runs it: 32 sequences, one token each at 600-662 cached
// positions, through block tables of 16 positions (a shuffled pool), 16 flash-decoding parts
// (a 1024-token context's plan); each version against version 1's output, GB/s of K and V.
void batched_step(const char* name, int64_t heads, int64_t kv, int64_t hd) {
  const int64_t T = 32, ctx = 1024, bt = 16, stride = ctx / bt, parts = ctx / 64, Q = heads * hd, KV = kv * hd;
  std::vector<int32_t> pos(T), seq(T), tables(size_t(T * stride));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(600 + 2 * t), seq[size_t(t)] = int32_t(t);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = int32_t((i * 7919) % tables.size());  // a permutation (7919 is prime)
  DeviceBuffer k(size_t(T * ctx * KV) * 2), v(k.bytes()), q(size_t(T * Q) * 4), out(size_t(T * Q) * 4), part(size_t(T * heads * parts * (hd + 2)) * 4);
  fill_random(split_weight_view(DType::F16, T * ctx, KV, k.as<uint8_t>()), 4, nullptr);
  fill_random(split_weight_view(DType::F16, T * ctx, KV, v.as<uint8_t>()), 5, nullptr);
  fill_random(split_weight_view(DType::F32, T, Q, q.as<uint8_t>()), 6, nullptr);
  DeviceBuffer pd(size_t(T) * 4), sd(size_t(T) * 4), td(tables.size() * 4);
  pd.upload(pos.data(), pos.size() * 4), sd.upload(seq.data(), seq.size() * 4), td.upload(tables.data(), tables.size() * 4);
  const KvPages pages{sd.as<int32_t>(), td.as<int32_t>(), stride, bt};
  const float scale = float(1.0 / std::sqrt(double(hd)));
  double bytes = 0;
  for (int32_t p : pos) bytes += 2.0 * double(p + 1) * double(KV) * 2.0;
  std::vector<float> ref1;
  for (const Variant& var : kVariants) {
    use(var);
    auto step = [&] {
      attention(q.as<float>(), Q, k.as<uint16_t>(), v.as<uint16_t>(), pd.as<int32_t>(), T, heads, kv, hd, scale, parts, 64, part.as<float>(),
                out.as<float>(), Q, nullptr, pages);
    };
    step();
    check(cudaDeviceSynchronize(), "batched decode");
    std::vector<float> got(size_t(T * Q));
    check(cudaMemcpy(got.data(), out.as<float>(), got.size() * 4, cudaMemcpyDeviceToHost), "copy");
    if (ref1.empty()) ref1 = got;
    double err = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) err += (got[i] - ref1[i]) * (got[i] - ref1[i]), norm += ref1[i] * ref1[i];
    const double ms = best_time_ms(30, step);
    std::printf("%-13s batched decode, 32 sequences at 600-662 (paged, %lld parts) %-8s %7.1f us  %7.0f GB/s of K+V  (rel. diff from v1 %.1e)\n",
                name, (long long)parts, label(var).c_str(), ms * 1e3, bytes / (ms * 1e-3) / 1e9, std::sqrt(err / std::max(norm, 1e-30)));
  }
  use_defaults();
}

int main() {
  try {
    check(cudaSetDevice(0), "cudaSetDevice");
    std::printf("%s, LLMQ_CUDA_ATTN=%s\n", device_description(0).c_str(), std::getenv("LLMQ_CUDA_ATTN") ? std::getenv("LLMQ_CUDA_ATTN") : "(unset)");
    struct Cfg { const char* name; int64_t heads, kv, hd; };
    for (const Cfg& c : {Cfg{"llama-2-7b", 32, 32, 128}, Cfg{"llama-3-8b", 32, 8, 128}, Cfg{"smollm2-135m", 9, 3, 64}}) {
      const int64_t ctx = 4096, Q = c.heads * c.hd, KV = c.kv * c.hd, T = 512;
      DeviceBuffer k(size_t(ctx * KV) * 2), v(size_t(ctx * KV) * 2), q(size_t(T * Q) * 4), out(size_t(T * Q) * 4);
      fill_random(split_weight_view(DType::F16, ctx, KV, k.as<uint8_t>()), 1, nullptr);
      fill_random(split_weight_view(DType::F16, ctx, KV, v.as<uint8_t>()), 2, nullptr);
      fill_random(split_weight_view(DType::F32, T, Q, q.as<uint8_t>()), 3, nullptr);
      std::vector<int32_t> pos(T);
      for (int64_t i = 0; i < T; ++i) pos[size_t(i)] = int32_t(i);
      DeviceBuffer pd(size_t(T) * 4);
      pd.upload(pos.data(), pos.size() * 4);
      const float scale = float(1.0 / std::sqrt(double(c.hd)));
      const double ms = best_time_ms(20, [&] {
        attention(q.as<float>(), Q, k.as<uint16_t>(), v.as<uint16_t>(), pd.as<int32_t>(), T, c.heads, c.kv, c.hd, scale, 1, ctx,
                  nullptr, out.as<float>(), Q, nullptr);
      });
      const double flop = 4.0 * double(c.hd) * double(c.heads) * double(T) * double(T + 1) / 2.0;
      std::printf("%-13s prefill T=512        %9.1f us  %7.1f TFLOP/s\n", c.name, ms * 1e3, flop / (ms * 1e-3) / 1e12);
      // Decode steps read K and V cold, as a model's layers do (each layer's cache once a token):
      // copies of the cache, a step's rows at 512 positions past 256 MiB in all (the H200's L2
      // holds 50 MB), the next copy each step. (Until the sixth GPU session the lab read one
      // cache over and over, hot in L2 at 512 positions; the cold times came out within 10%.)
      const int64_t copies = std::min<int64_t>(512, (int64_t(256) << 20) / (512 * KV * 4) + 1);
      DeviceBuffer kr(size_t(copies * ctx * KV) * 2), vr(kr.bytes());
      fill_random(split_weight_view(DType::F16, copies * ctx, KV, kr.as<uint8_t>()), 7, nullptr);
      fill_random(split_weight_view(DType::F16, copies * ctx, KV, vr.as<uint8_t>()), 8, nullptr);
      for (int32_t p : {511, 4095}) {
        const int64_t parts = ctx / 64;
        DeviceBuffer part(size_t(c.heads * parts * (c.hd + 2)) * 4), p1(4);
        p1.upload(&p, 4);
        std::vector<float> ref1;  // version 1's output: version 3 is checked against it
        for (const Variant& var : kVariants) {
          use(var);
          int64_t next = 0;  // the copy the next step reads
          auto step = [&] {
            const size_t off = size_t(next++ % copies) * size_t(ctx * KV);
            attention(q.as<float>(), Q, kr.as<uint16_t>() + off, vr.as<uint16_t>() + off, p1.as<int32_t>(), 1, c.heads, c.kv, c.hd, scale,
                      parts, 64, part.as<float>(), out.as<float>(), Q, nullptr);
          };
          step();
          next = 0;
          check(cudaDeviceSynchronize(), "decode");
          std::vector<float> got(static_cast<size_t>(Q));
          check(cudaMemcpy(got.data(), out.as<float>(), size_t(Q) * 4, cudaMemcpyDeviceToHost), "copy");
          double err = 0, norm = 0;
          if (ref1.empty()) ref1 = got;
          for (size_t i = 0; i < got.size(); ++i) err += (got[i] - ref1[i]) * (got[i] - ref1[i]), norm += ref1[i] * ref1[i];
          const double dms = best_time_ms(50, step);
          const double bytes = 2.0 * double(p + 1) * double(KV) * 2.0;
          std::printf("%-13s decode at %4d (64 parts) %-8s %7.1f us  %7.0f GB/s of K+V  (rel. diff from v1 %.1e)\n", c.name, p,
                      label(var).c_str(), dms * 1e3, bytes / (dms * 1e-3) / 1e9, std::sqrt(err / std::max(norm, 1e-30)));
        }
        use_defaults();
      }
      batched_step(c.name, c.heads, c.kv, c.hd);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention lab: %s\n", e.what());
    return 1;
  }
  return 0;
}
