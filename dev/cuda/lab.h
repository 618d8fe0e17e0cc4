// What the dev/cuda labs share: a matrix in enough copies that timed calls read DRAM, not L2,
// random activations with their int8 quantization (quantize_act's layout), and the error check.
// Device helpers (warp_sum, fp16_bits_to_float, dp4a4) come from engine/cuda/common.cuh.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda/cuda.h"
#include "engine/cuda/matmul.h"

namespace llmq::cuda::lab {

/// A lab's start: `--reps N` from the command line (else `reps`), stdout line-buffered, GPU 0
/// selected and described on stdout. Throws as cuda::check.
inline int start(int argc, char** argv, int reps) {
  for (int i = 1; i + 1 < argc; i += 2)
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a lab cut short by `timeout`
  check(cudaSetDevice(0), "cudaSetDevice");
  std::printf("%s\n", device_description(0).c_str());
  return reps;
}

/// Types from a comma-separated list of names ("q4_0,q4_k"); throws as dtype_from_name.
inline std::vector<DType> parse_types(const char* list) {
  std::vector<DType> out;
  std::string s(list);
  for (size_t b = 0; b <= s.size();) {
    const size_t e = std::min(s.find(',', b), s.size());
    out.push_back(dtype_from_name(s.substr(b, e - b)));
    b = e + 1;
  }
  return out;
}

/// Copies of a random [rows, cols] matrix of type t, >= 512 MiB in all (at least 2).
struct WeightCopies {
  DeviceBuffer buf;
  std::vector<DeviceWeight> w;
  WeightCopies(DType t, int64_t rows, int64_t cols) {
    const uint64_t bytes = split_weight_bytes(t, rows, cols);
    const int copies = int(std::max<uint64_t>(2, (512ull << 20) / bytes + 1));
    buf = DeviceBuffer(bytes * uint64_t(copies));
    for (int i = 0; i < copies; ++i) {
      w.push_back(split_weight_view(t, rows, cols, buf.as<uint8_t>() + bytes * uint64_t(i)));
      fill_random(w.back(), 100 + uint64_t(i), nullptr);
    }
  }
  size_t size() const { return w.size(); }
};

/// Activations x [T, cols] uniform in ±1 (fixed seed) and the buffers of their int8 copy.
struct Activations {
  DeviceBuffer x, q, d, s;
  DeviceActQ8 xq;
  std::vector<float> host;
  Activations(int64_t T, int64_t cols)
      : x(size_t(T * cols) * 4), q(size_t(T * cols)), d(size_t(T * cols / 8)), s(size_t(T * cols / 8)), host(size_t(T * cols)) {
    srand(7);
    for (auto& v : host) v = float(rand()) / float(RAND_MAX) * 2.0f - 1.0f;
    x.upload(host.data(), host.size() * 4);
    xq = {q.as<int8_t>(), d.as<float>(), s.as<float>()};
  }
};

/// max |a - ref| / max |ref|; infinite when a holds a NaN or an infinity (the check before timing).
inline double max_rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num = std::max(num, double(std::fabs(a[i] - ref[i]))), den = std::max(den, double(std::fabs(ref[i])));
  }
  return num / den;
}

}  // namespace llmq::cuda::lab
