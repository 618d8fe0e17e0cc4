#include "engine/roofline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "base/buffer.h"

namespace llmq {

ForwardCost forward_cost(const Model& m, int64_t n_tokens, int64_t pos0, int kv_elem_bytes) {
  const ModelConfig& c = m.config;
  ForwardCost cost;
  // Weights multiplied per token: by every token (layer matrices), and by the last token only
  // (the last layer's Q, output and FFN matrices, the output projection: forward_shard computes
  // only the flagged token's hidden state there, and the logits of the last token).
  double all_tokens = 0, last_token = 0;
  const std::string last_layer = "blk." + std::to_string(c.n_layers - 1) + ".";
  for (const TensorInfo& t : m.file->tensors()) {
    if (t.name == "token_embd.weight") continue;  // counted below
    cost.weight_bytes += double(t.nbytes);
    if (t.shape.size() != 2) continue;
    const bool kv = t.name.find(".attn_k.") != std::string::npos || t.name.find(".attn_v.") != std::string::npos;
    const bool to_last = t.name == "output.weight" || (t.name.rfind(last_layer, 0) == 0 && !kv);
    (to_last ? last_token : all_tokens) += double(t.numel());
  }
  const Weight& e = m.token_embd;
  if (c.tied_embeddings) {  // the output matmul reads the whole embedding matrix
    cost.weight_bytes += double(e.rows) * double(e.row_stride());
    last_token += double(e.rows) * double(e.cols);
  } else {
    cost.weight_bytes += double(n_tokens) * double(e.row_stride());
  }
  // Positions pos0 .. pos0 + n - 1 each attend to (p + 1) positions (in the last layer only the
  // last one does).
  const double attended = double(n_tokens) * double(pos0) + double(n_tokens) * double(n_tokens + 1) / 2;
  const double attended_last = double(pos0 + n_tokens);
  cost.kv_bytes = double(c.n_layers) * 2.0 * attended * double(c.kv_dim()) * double(kv_elem_bytes);
  cost.flops = 2.0 * (double(n_tokens) * all_tokens + last_token) +
               4.0 * double(c.q_dim()) * (double(c.n_layers - 1) * attended + attended_last);
  return cost;
}

namespace {

// Sum of 64-bit words with 8 independent accumulators (the compiler vectorizes it); the result
// only keeps the loads from being optimized away.
uint64_t sum_words(const uint8_t* p, uint64_t bytes) {
  const uint64_t n = bytes / 64;
  uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t w[8];
    std::memcpy(w, p + i * 64, 64);
    for (int k = 0; k < 8; ++k) a[k] += w[k];
  }
  uint64_t s = 0;
  for (uint64_t x : a) s += x;
  return s;
}

double timed_pass(ThreadPool& pool, const uint8_t* data, uint64_t bytes, std::atomic<uint64_t>& sink) {
  const uint64_t lines = bytes / 64;
  const auto t0 = std::chrono::steady_clock::now();
  pool.parallel_for(int64_t(pool.size()), [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t a = lines * uint64_t(i) / uint64_t(pool.size()), b = lines * uint64_t(i + 1) / uint64_t(pool.size());
      sink.fetch_add(sum_words(data + a * 64, (b - a) * 64), std::memory_order_relaxed);
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double measure_read_bandwidth(ThreadPool& pool, const uint8_t* data, uint64_t bytes, int passes) {
  std::atomic<uint64_t> sink{0};
  double best = 1e30;
  for (int p = 0; p < std::max(1, passes); ++p) best = std::min(best, timed_pass(pool, data, bytes, sink));
  return double(bytes / 64 * 64) / best;
}

ReadBandwidth measure_read_bandwidth(ThreadPool& pool, uint64_t bytes, int passes) {
  bytes = std::max<uint64_t>(bytes / 64 * 64, 64);
  // Huge pages, as the engine's packed weights and KV cache (base/buffer.h): the machine's
  // best streaming read, not one slowed by TLB misses.
  HugeBuffer buf(bytes);
  // Distinct values in every page (all threads, as the reads will).
  pool.parallel_for(int64_t(bytes / 4096 + 1), [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t a = uint64_t(i) * 4096, b = std::min(bytes, a + 4096);
      if (a < b) std::memset(buf.data() + a, int(i & 0xff), b - a);
    }
  });
  ReadBandwidth r;
  r.buffer_bytes = bytes;
  r.threads = pool.size();
  r.passes = passes;
  r.bytes_per_s = measure_read_bandwidth(pool, buf.data(), bytes, passes);
  return r;
}

double measure_int8_peak(ThreadPool& pool, double seconds) {
  if (int8_dot_peak_loop(1) == 0) return 0;
  // Rounds per thread for about `seconds`, from a short calibration on this thread.
  int64_t rounds = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    int8_dot_peak_loop(rounds);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0.02 || rounds > (int64_t(1) << 40)) {
      rounds = std::max<int64_t>(1, int64_t(double(rounds) * seconds / s));
      break;
    }
    rounds *= 4;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::atomic<uint64_t> macs{0};
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(int64_t(pool.size()), [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) macs.fetch_add(int8_dot_peak_loop(rounds), std::memory_order_relaxed);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * double(macs.load()) / s);
  }
  return best;
}

}  // namespace llmq
