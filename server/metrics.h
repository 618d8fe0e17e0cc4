// Prometheus text-format metrics for llmq-server (exposition format 0.0.4).
#pragma once
#include "server/scheduler.h"
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace llmq {

/// A histogram with fixed upper bounds (seconds); thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  /// `name_bucket{le="..."} n` lines, then _sum and _count.
  std::string render(const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t n_ = 0;
};

struct Metrics {
  std::mutex mu;
  std::map<std::string, uint64_t> requests;  ///< "endpoint|status" -> count
  std::atomic<uint64_t> prompt_tokens{0}, generated_tokens{0};
  Histogram ttft{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram tpot{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};

  /// One request to `endpoint` answered `status`. Endpoints outside the server's routes count as
  /// "other" and statuses outside 100-599 as "other", so the label values are a fixed set.
  void count_request(const std::string& endpoint, int status);
  /// The whole exposition, with the scheduler's gauges passed in.
  /// The Prometheus text: these counters and the scheduler's (queue, sequences, KV cache,
  /// prefix cache, constrained decoding).
  std::string render(const SchedulerStats& s);
};

/// The label value of an endpoint: one of the server's routes, or "other".
const char* endpoint_label(const std::string& endpoint);

}  // namespace llmq
