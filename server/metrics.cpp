#include "server/metrics.h"

#include <cstdio>

namespace llmq {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lk(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++n_;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(n_) + "\n";
  return out;
}

// Label values come from fixed sets only (issue 22 item 4): a request's own path (a refused
// request to any URL) would otherwise become a label value, unescaped (label injection) and
// without bound (a series per distinct path).
const char* endpoint_label(const std::string& endpoint) {
  static const char* const kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/health", "/metrics", "/"};
  for (const char* r : kRoutes)
    if (endpoint == r) return r;
  return "other";
}

void Metrics::count_request(const std::string& endpoint, int status) {
  const std::string code = status >= 100 && status <= 599 ? std::to_string(status) : "other";
  std::lock_guard<std::mutex> lk(mu);
  ++requests[std::string(endpoint_label(endpoint)) + "|" + code];
}

std::string Metrics::render(const SchedulerStats& s) {
  const int64_t queued = s.queued, running = s.running, kv_used = s.kv_blocks_used, kv_total = s.kv_blocks_total;
  std::string out = "# HELP llmq_requests_total HTTP requests by endpoint and status.\n# TYPE llmq_requests_total counter\n";
  {
    std::lock_guard<std::mutex> lk(mu);
    for (const auto& [key, n] : requests) {
      const size_t bar = key.find('|');
      out += "llmq_requests_total{endpoint=\"" + key.substr(0, bar) + "\",status=\"" + key.substr(bar + 1) + "\"} " +
             std::to_string(n) + "\n";
    }
  }
  auto gauge = [&](const char* name, const char* type, const char* help, const std::string& v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + v + "\n";
  };
  gauge("llmq_prompt_tokens_total", "counter", "Prompt tokens processed.", std::to_string(prompt_tokens.load()));
  gauge("llmq_generated_tokens_total", "counter", "Tokens generated.", std::to_string(generated_tokens.load()));
  gauge("llmq_queue_length", "gauge", "Requests waiting for a slot.", std::to_string(queued));
  gauge("llmq_running_sequences", "gauge", "Sequences being generated.", std::to_string(running));
  gauge("llmq_kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", std::to_string(kv_used));
  gauge("llmq_kv_cache_blocks_total", "gauge", "KV-cache blocks in all.", std::to_string(kv_total));
  gauge("llmq_kv_cache_usage_ratio", "gauge", "Fraction of the KV cache in use.",
        num(kv_total ? double(kv_used) / double(kv_total) : 0.0));
  gauge("llmq_constrained_tokens_total", "counter", "Tokens sampled under a structured-output constraint.",
        std::to_string(s.constrained_tokens));
  gauge("llmq_constraint_seconds_total", "counter", "Time spent filling constraint masks and accepting tokens.",
        num(s.constraint_seconds));
  gauge("llmq_prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose KV blocks came from the prefix cache.",
        std::to_string(s.cached_prompt_tokens));
  gauge("llmq_prefix_cache_blocks", "gauge", "KV blocks registered in the prefix cache (in use or kept for reuse).",
        std::to_string(s.prefix_blocks));
  out += ttft.render("llmq_time_to_first_token_seconds", "Time from request to first token.");
  out += tpot.render("llmq_time_per_output_token_seconds", "Mean time per generated token after the first, per request.");
  return out;
}

}  // namespace llmq
