#include "engine/cpu_ops.h"

#include <algorithm>
#include <cmath>

namespace llmq {

// ---------------------------------------------------------------- dot products

namespace {

// fp32 dot with 8 independent accumulators (lets the compiler use vector registers without
// -ffast-math, and keeps rounding independent of the thread count).
float dot_f32(const float* a, const float* b, int64_t n) {
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

bool is_block_quant(DType t) { return t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_1; }

}  // namespace

void quantize_act_q8(const float* x, BlockQ8Act* out, int64_t n) {
  for (int64_t b = 0; b < n / QK; ++b, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = int(std::nearbyint(x[j] * id));
      out[b].qs[j] = int8_t(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * float(sum);
  }
}

// ---------------------------------------------------------------- matmul

void matmul(ThreadPool& pool, MatmulScratch& s, float* y, const float* x, int64_t T, const Weight& w) {
  const int64_t M = w.rows, K = w.cols;
  if (is_block_quant(w.type)) {
    const int64_t nb = K / QK;
    if (s.xq.size() < size_t(T * nb)) s.xq.resize(size_t(T * nb));
    BlockQ8Act* xq = s.xq.data();
    pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) quantize_act_q8(x + t * K, xq + t * nb, K);
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
            default: v = dot_q4_1(reinterpret_cast<const BlockQ4_1*>(row), xt, nb); break;
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
      for (int64_t t = 0; t < T; ++t) y[t * M + r] = dot_f32(wr, x + t * K, K);
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
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void rope(float* v, int64_t n_heads, int64_t head_dim, int64_t pos, double theta, RopeLayout layout) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double freq = std::pow(theta, -2.0 * double(i) / double(head_dim));
    const double angle = double(pos) * freq;
    const float c = float(std::cos(angle)), s = float(std::sin(angle));
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

void softmax(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void swiglu(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void embedding_row(float* out, const Weight& emb, int64_t token) {
  dequantize_row(emb.type, emb.row(token), out, emb.cols);
}

}  // namespace llmq
