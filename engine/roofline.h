// What bounds a forward pass: bytes it must read and arithmetic it must do, and the machine's
// own streaming-read bandwidth, measured with the same threads (for llmq-bench's fractions).
//
// Decode of one token reads every weight once (the Williams, Waterman & Patterson 2009 roofline:
// time >= bytes / bandwidth), so tok/s x bytes-per-token / read-bandwidth is how close a decode
// runs to the machine's limit. Prefill does 2 FLOPs per weight per token (one multiply, one add)
// plus attention, so its GFLOP/s is the figure to compare with the cores' arithmetic rate.
#pragma once
#include <cstddef>
#include <cstdint>

#include "engine/model.h"
#include "base/threadpool.h"

namespace llmq {

/// Bytes and arithmetic of one forward pass of `n_tokens` tokens of one sequence at positions
/// pos0 .. pos0 + n_tokens - 1 (llmq's CPU engine).
struct ForwardCost {
  double weight_bytes = 0;  ///< weights read once per pass: every 2-D matmul weight as stored
                            ///< (scales included), the output matrix, the 1-D norms, and the
                            ///< n_tokens embedding rows (none extra when tied: the output read
                            ///< covers them)
  double kv_bytes = 0;      ///< K and V read by attention: per layer and token at position p,
                            ///< 2 * (p + 1) * kv_dim * element bytes (each position once per KV head)
  double flops = 0;         ///< the arithmetic forward_shard does for logits of the last token:
                            ///< 2 * weights per matmul and token (every token through the layer
                            ///< matrices, except the last layer's Q, output and FFN matrices and
                            ///< the output projection, which see the last token only) +
                            ///< attention: 4 * (p + 1) * q_dim per layer and token at position p
                            ///< (q.k scores and the weighted sum of V; last layer: last token)
  double bytes() const { return weight_bytes + kv_bytes; }
};

/// The cost of running tokens pos0 .. pos0 + n_tokens - 1 through `m` (see ForwardCost).
/// kv_elem_bytes: 4 (f32 KV cache) or 2 (bf16).
ForwardCost forward_cost(const Model& m, int64_t n_tokens, int64_t pos0, int kv_elem_bytes = 4);

/// A measured streaming-read bandwidth.
struct ReadBandwidth {
  double bytes_per_s = 0;  ///< best pass: buffer bytes / seconds
  uint64_t buffer_bytes = 0;
  int threads = 0;
  int passes = 0;
};

/// Sums a buffer of `bytes` (far larger than the caches: 1 GiB by default; llmq-bench uses 512 MiB) with `pool`'s
/// threads, each thread a contiguous share, as decode's matmuls read weights; returns the best
/// of `passes` passes after one untimed pass that faults the pages in. Ordinary heap memory
/// (4 KiB pages unless the system makes huge pages by itself).
/// Throws std::bad_alloc when the buffer cannot be had.
ReadBandwidth measure_read_bandwidth(ThreadPool& pool, uint64_t bytes = uint64_t(1) << 30, int passes = 5);

/// The same read over memory that is already there (e.g. a model's mapped weights): the best
/// of `passes` passes over [data, data + bytes), in bytes/s.
double measure_read_bandwidth(ThreadPool& pool, const uint8_t* data, uint64_t bytes, int passes = 5);

/// The int8 multiply-add peak of the active CPU level on all of `pool`'s threads at once: each
/// runs int8_dot_peak_loop (nothing but `vpdpbusd`) for about `seconds`; returns
/// 2 · multiply-adds / wall seconds (operations per second, a multiply and an add each), the best
/// of 3 runs, or 0 when the level has no such loop. What a block-quantized prefill's integer
/// dot products could reach at most on this machine.
double measure_int8_peak(ThreadPool& pool, double seconds = 0.2);

}  // namespace llmq
