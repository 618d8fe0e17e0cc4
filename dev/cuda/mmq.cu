// MMQ lab (prefill and batched-decode matmuls): the engine's mmq (int8 tensor cores on the
// quant blocks, engine/cuda/mmq.cu) at each tile width against the path it replaces (the whole
// matrix dequantized to fp16, then cuBLAS) and against cuBLAS alone on a ready fp16 matrix (the
// ceiling of that path), on llama-2-7b's shapes, for T = 16 .. 512 tokens. Weights rotate over
// copies totalling >= 512 MiB so small T reads DRAM, not L2. TFLOP/s = 2 rows cols T / time.
//
// "engine matmul" is what the engine runs for that T (matmul(): MMQ up to kCudaMmqMaxTokens,
// then dequantize + cuBLAS), quantization of the fp32 input included. "mmq_h" (Q4_0, Q8_0, T <=
// 64): MMQ on fp16 tiles (each weight dequantized to fp16 once per tile, fp16 mma) on the fp16
// activations cuBLAS reads; matmul() takes it under LLMQ_CUDA_MMQ_F16=1.
//
//   dev/cuda/build.sh && build-gpu/dev/mmq [--reps N] [--types q4_0,q4_k,...]
// (default: every quantized type the engine's MMQ takes, Q4_0 first)
//   build-gpu/dev/mmq --sweep [--types q4_0,q8_0]
// The batched-decode sizes (T = 16, 32) with every K split count and pipeline depth, and at 3
// stages with registers for 3 or 4 blocks per SM (MmqTuning): at 2 blocks per SM (128 registers
// at 256 threads), a grid just past 264 blocks runs a second wave; the depth moved nothing by more
// than 3% on an H200, so a block's stage costs its warps' dependent instructions more than a
// memory latency, and more resident warps are the next lever.
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "engine/cuda/cuda.h"
#include "engine/cuda/matmul.h"
#include "dev/cuda/lab.h"

using namespace llmq;
using namespace llmq::cuda;

#define CK(x) check((x), #x)

namespace {

void ckb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw CudaError(std::string(what) + ": cuBLAS error");
}

struct Shape {
  int rows, cols;
  const char* what;
};

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), n += double(b[i]) * b[i];
  }
  return std::sqrt(e / n);
}

// --sweep: per type, matrix and T, the time of every (splits, stages) against the engine's pick
// (its split scratch as the engine plans it for llmq-run's batch of 512: plan_cuda_matmul).
void sweep(const std::vector<DType>& types, const std::vector<Shape>& shapes, int reps) {
  for (DType type : types) {
    for (const Shape& sh : shapes) {
      const lab::WeightCopies wc(type, sh.rows, sh.cols);
      const int copies = int(wc.size());
      lab::Activations act(32, sh.cols);
      DeviceBuffer y(size_t(32) * sh.rows * 4), split(size_t(64) << 20);
      const uint64_t engine_split = plan_cuda_matmul(512, sh.cols, sh.rows).mmq_split;
      for (int T : {16, 32}) {
        quantize_act(act.x.as<float>(), act.xq, T, sh.cols, nullptr);
        int i = 0;
        // One product (its output downloaded) and its time per copy, at `bytes` of split scratch.
        auto run = [&](MmqTuning tune, uint64_t bytes, std::vector<float>& out) {
          mmq(wc.w[0], act.xq, y.as<float>(), T, 0, nullptr, 0, split.as<float>(), bytes, tune);
          CK(cudaDeviceSynchronize());
          out.resize(size_t(T) * sh.rows);
          y.download(out.data(), out.size() * 4);
          return best_time_ms(reps, [&] {
                   for (int k = 0; k < copies; ++k) mmq(wc.w[(i++) % copies], act.xq, y.as<float>(), T, 0, nullptr, 0, split.as<float>(), bytes, tune);
                 }) / copies;
        };
        std::vector<float> ref, got;
        const double base = run({}, engine_split, ref);
        const int blocks = (sh.rows + 127) / 128, pick = mmq_splits(wc.w[0], T, engine_split);
        std::printf("%-5s %-8s %5dx%-5d T=%-3d engine: split %d (%d blocks), 3 stages %8.1f us\n", dtype_name(type), sh.what, sh.rows, sh.cols, T,
                    pick, blocks * pick, base * 1e3);
        double best = base;
        MmqTuning best_t{pick, 3, 0};
        for (int splits : {1, 2, 3, 4, 5, 6, 8, 10, 12, 16}) {
          if (splits > sh.cols / 64 || uint64_t(splits) * T * sh.rows * 4 > split.bytes()) continue;
          for (int variant : {3, 4, 6, 8, -3, -4}) {  // stages, or (negative) 3 stages at 3 or 4 blocks per SM
            const MmqTuning tune{splits, variant > 0 ? variant : 0, variant < 0 ? -variant : 0};
            const int stages = variant > 0 ? variant : 3;
            const double ms = run(tune, split.bytes(), got);
            std::printf("%-5s %-8s %5dx%-5d T=%-3d split %2d (%4d blocks) stages %d, %s %8.1f us  %.2fx the engine's  diff %.1e\n",
                        dtype_name(type), sh.what, sh.rows, sh.cols, T, splits, blocks * splits, stages,
                        variant == -3 ? "3 per SM" : variant == -4 ? "4 per SM" : "default ", ms * 1e3, ms / base, rel(got, ref));
            if (ms < best) best = ms, best_t = tune;
          }
        }
        std::printf("%-5s %-8s %5dx%-5d T=%-3d best: split %d, %d stages, blocks per SM %s %8.1f us (%.2fx the engine's)\n", dtype_name(type),
                    sh.what, sh.rows, sh.cols, T, best_t.splits, best_t.stages ? best_t.stages : 3,
                    best_t.min_blocks ? std::to_string(best_t.min_blocks).c_str() : "default", best * 1e3, best / base);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int reps = lab::start(argc, argv, 10);
    cublasHandle_t h;
    ckb(cublasCreate(&h), "cublasCreate");
    DeviceBuffer ws(32 << 20);
    ckb(cublasSetWorkspace(h, ws.get(), ws.bytes()), "cublasSetWorkspace");
    const std::vector<Shape> shapes = {{12288, 4096, "qkv"}, {4096, 4096, "wo"}, {22016, 4096, "gate_up"}, {4096, 11008, "down"}, {4096, 14336, "tbo"}};
    const int Ts[] = {16, 32, 64, 128, 512};
    const int maxT = 512;
    std::vector<DType> types = {DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::Q5_0, DType::Q3_K,
                                DType::Q5_K, DType::Q2_K, DType::Q5_1, DType::Q4_1, DType::IQ4_NL};
    bool do_sweep = false, typed = false;
    for (int a = 1; a < argc; ++a) {
      if (!std::strcmp(argv[a], "--types") && a + 1 < argc) types = lab::parse_types(argv[++a]), typed = true;
      else if (!std::strcmp(argv[a], "--sweep")) do_sweep = true;
    }
    if (do_sweep) {  // the depths are built for Q4_0 and Q8_0 only (MmqTuning)
      sweep(typed ? types : std::vector<DType>{DType::Q4_0, DType::Q8_0}, shapes, reps);
      cublasDestroy(h);
      return 0;
    }
    for (DType type : types) {
      for (const Shape& sh : shapes) {
        const lab::WeightCopies wc(type, sh.rows, sh.cols);
        const std::vector<DeviceWeight>& w = wc.w;
        const int copies = int(wc.size());
        lab::Activations act(maxT, sh.cols);
        const DeviceBuffer& x = act.x;
        const std::vector<float>& hx = act.host;
        const DeviceActQ8 xq = act.xq;
        DeviceBuffer xh(size_t(maxT) * sh.cols * 2), wh(size_t(sh.rows) * sh.cols * 2), y(size_t(maxT) * sh.rows * 4);
        DeviceBuffer split(8 << 20);  // the engine's split-K scratch (CudaMatmulPlan::mmq_split)
        MatmulContext ctx(maxT, sh.cols, nullptr, sh.rows);  // the engine's matmul: GEMV / MMQ / dequantize + cuBLAS by T
        // x as fp16 for cuBLAS
        {
          std::vector<__half> hh(hx.size());
          for (size_t i = 0; i < hx.size(); ++i) hh[i] = __float2half(hx[i]);
          xh.upload(hh.data(), hh.size() * 2);
        }
        const float one = 1.0f, zero = 0.0f;
        auto gemm = [&](const void* a, int T) {
          ckb(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.rows, T, sh.cols, &one, a, CUDA_R_16F, sh.cols, xh.get(), CUDA_R_16F, sh.cols,
                           &zero, y.get(), CUDA_R_32F, sh.rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
        };
        for (int T : Ts) {
          const double flop = 2.0 * sh.rows * double(sh.cols) * T;
          quantize_act(x.as<float>(), xq, T, sh.cols, nullptr);
          // Reference output: dequantize + cuBLAS on copy 0.
          dequantize_rows_f16(w[0], 0, sh.rows, wh.as<uint16_t>(), nullptr);
          gemm(wh.get(), T);
          CK(cudaDeviceSynchronize());
          std::vector<float> ref(size_t(T) * sh.rows), got(ref.size());
          y.download(ref.data(), ref.size() * 4);
          int i = 0;
          auto line = [&](const char* what, double ms, double err) {
            std::printf("%-5s %-8s %5dx%-5d T=%-4d %-22s %9.1f us %7.1f TFLOP/s  err %.1e\n", dtype_name(type), sh.what, sh.rows, sh.cols, T,
                        what, ms * 1e3, flop / (ms * 1e-3) / 1e12, err);
          };
          line("cublas fp16 (ready)", best_time_ms(reps, [&] { gemm(wh.get(), T); }), 0.0);
          line("dequant + cublas", best_time_ms(reps, [&] {
                 for (int k = 0; k < copies; ++k) {
                   dequantize_rows_f16(w[(i++) % copies], 0, sh.rows, wh.as<uint16_t>(), nullptr);
                   gemm(wh.get(), T);
                 }
               }) / copies,
               0.0);
          // One MMQ variant at one tile width: run(weight) once on copy 0 against the reference,
          // then timed over the copies.
          auto variant = [&](const char* what, int tile, const std::function<void(const DeviceWeight&)>& run) {
            CK(cudaMemset(y.get(), 0xff, y.bytes()));
            run(w[0]);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            y.download(got.data(), got.size() * 4);
            const double err = rel(got, ref);
            char name[64];
            std::snprintf(name, sizeof name, "%s tile %d split %d%s", what, tile, mmq_splits(w[0], T, split.bytes()),
                          std::strcmp(what, "mmq") == 0 && tile == mmq_tile_tokens(T) ? " *" : "");
            line(name, best_time_ms(reps, [&] {
                   for (int k = 0; k < copies; ++k) run(w[(i++) % copies]);
                 }) / copies,
                 err);
          };
          for (int tile : {16, 32, 64, 128})
            if (tile <= 2 * T)
              variant("mmq", tile, [&](const DeviceWeight& wk) { mmq(wk, xq, y.as<float>(), T, 0, nullptr, tile, split.as<float>(), split.bytes()); });
          for (int tile : {16, 32, 64})  // MMQ on fp16 tiles (mmq_h), on the fp16 activations cuBLAS reads
            if (mmq_h_supported(w[0]) && tile <= 2 * T && T <= 64)
              variant("mmq_h", tile, [&](const DeviceWeight& wk) {
                mmq_h(wk, xh.as<uint16_t>(), y.as<float>(), T, 0, nullptr, tile, split.as<float>(), split.bytes());
              });
          line("quantize_act", best_time_ms(reps, [&] { quantize_act(x.as<float>(), xq, T, sh.cols, nullptr); }), 0.0);
          line("engine matmul (x fp32)", best_time_ms(reps, [&] {
                 for (int k = 0; k < copies; ++k) matmul(ctx, w[(i++) % copies], x.as<float>(), y.as<float>(), T);
               }) / copies,
               0.0);
        }
      }
    }
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mmq lab: %s\n", e.what());
    return 1;
  }
  return 0;
}
