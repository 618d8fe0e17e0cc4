// The continuous-batching scheduler: one loop runs prefill and decode of every active sequence
// in shared forward passes; requests join between steps and leave when done or cancelled.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/model.h"
#include "engine/sampler.h"

namespace llmq {

class GenRequest;

/// What a request asks the scheduler for.
struct GenParams {
  std::vector<int32_t> prompt;     ///< token ids (BOS included when wanted)
  int64_t max_tokens = 16;         ///< most tokens to generate (0: the prompt only, for its logprobs)
  SamplerParams sampling;
  std::vector<std::string> stop;   ///< stop strings (not included in the output)
  std::vector<int32_t> stop_ids;   ///< tokens that end the output besides the model's end of sequence/turn
  int top_logprobs = -1;           ///< -1: no logprobs; 0..20: logprobs with that many alternatives
  /// Completions' echo with logprobs: before any generated token, one GenEvent with prompt set
  /// brings the prompt's tokens, each but the first with its log probability given those before
  /// it (and top_logprobs alternatives). The whole prompt is then computed (no prefix-cache
  /// blocks), at most SchedulerOptions::parallel positions a step (the logits rows there are).
  bool prompt_logprobs = false;
  /// An embedding instead of a completion: the prompt's final-norm hidden states (engine/model.h
  /// Output::Hidden) pooled this way, L2-normalised, into GenRequest::embedding; nothing is
  /// generated. nullopt: a completion.
  std::optional<Pooling> embed;
  /// Constrained decoding (server/structured.h): the tokens it rules out are never sampled;
  /// used by the scheduler's thread only. nullptr: none.
  std::shared_ptr<TokenConstraint> constraint;
  /// Another request this one waits for: it is admitted only once that one's prompt is in the
  /// KV cache, so it starts from the blocks the prefix cache then holds (n > 1: the samples of a
  /// prompt share one prefill). nullptr: none.
  std::shared_ptr<GenRequest> after;
};

/// One generated token, for logprobs.
struct TokenInfo {
  int32_t id;
  std::string piece;                            ///< its text (may be part of a UTF-8 character)
  float logprob;
  std::vector<std::pair<int32_t, float>> top;   ///< alternatives, most likely first
  int32_t prev = -1;                            ///< the token before it (decode_piece context)
};

/// A step's output for one request: text that is safe to show (complete UTF-8, no partial
/// stop string) and the tokens produced since the previous event.
struct GenEvent {
  std::string text;
  std::vector<TokenInfo> tokens;
  bool prompt = false;  ///< the prompt's tokens (GenParams::prompt_logprobs; text empty); the first has logprob NaN
};

/// A request shared between the HTTP thread that made it and the scheduler loop.
class GenRequest {
 public:
  explicit GenRequest(GenParams p) : params(std::move(p)) {}
  const GenParams params;

  /// Waits up to timeout_ms for events or the end. Returns false when finished and drained.
  bool wait(std::vector<GenEvent>* out, int timeout_ms);
  /// Asks the scheduler to stop this request and free its KV blocks at the next step.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }
  /// Its prompt is in the KV cache (or it ended): requests `after` it may start.
  bool prefilled() const { return prefilled_; }

  // Filled in by the scheduler; read after wait() returned false.
  std::string finish_reason;  ///< "stop" or "length" (or "cancelled")
  int64_t prompt_tokens = 0, completion_tokens = 0;
  int64_t cached_tokens = 0;  ///< prompt tokens whose KV came from the prefix cache
  std::vector<float> embedding;  ///< GenParams::embed: [dim], unit length (empty if it failed)
  double t_submit = 0, t_first = 0, t_done = 0;  ///< seconds (steady clock)

 private:
  friend class Scheduler;
  void push(GenEvent e, bool done);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenEvent> events_;
  bool done_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> prefilled_{false};
};

struct SchedulerOptions {
  int parallel = 4;         ///< most sequences running at once
  int64_t ctx = 4096;       ///< most tokens (prompt + generated) per sequence
  int64_t max_queue = 64;   ///< most requests waiting; more are refused (HTTP 429)
  int64_t n_batch = 512;    ///< most tokens in one forward pass
  int64_t kv_tokens = 0;    ///< KV-cache size in tokens over all sequences (0: server_kv_tokens() in engine/mem_plan.h)
  KvType kv_type = KvType::F32;  ///< KV-cache element type (engine/kv_cache.h)
  bool prefix_cache = true;      ///< reuse the KV blocks of prompt prefixes seen before (KVCache::attach_prefix)
};

/// Counters for /metrics, read without stopping the loop.
struct SchedulerStats {
  int64_t queued = 0, running = 0, kv_blocks_used = 0, kv_blocks_total = 0;
  int64_t cached_prompt_tokens = 0;  ///< prompt tokens served from the prefix cache
  int64_t prefix_blocks = 0;         ///< KV blocks registered in the prefix cache (held or kept)
  int64_t constrained_tokens = 0;  ///< tokens sampled under a constraint (structured outputs)
  double constraint_seconds = 0;   ///< time spent on their masks (fill, apply in the sampler, accept)
};

class Scheduler {
 public:
  /// Starts the loop thread. The model and pool must outlive the scheduler.
  Scheduler(const Model& model, ThreadPool& pool, const SchedulerOptions& opt);
  /// The same on another runner (engine/model.h BatchRunner: tensor-parallel CPU ranks,
  /// engine/tp.h, or a GPU, engine/cuda/session.h), which must outlive the scheduler and serve it
  /// alone; a step feeds at most runner.capacity() tokens (opt.n_batch is not used).
  Scheduler(BatchRunner& runner, const SchedulerOptions& opt);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class Submit { Ok, QueueFull, TooLong, NoHidden };
  /// Queues a request. TooLong: prompt + 1 exceeds the context (prompt alone for an
  /// embedding); NoHidden: an embedding on a runner without hidden states (BatchRunner::
  /// has_hidden); QueueFull: the queue is at its bound (the caller answers 429).
  Submit submit(const std::shared_ptr<GenRequest>& r);
  SchedulerStats stats() const;
  /// Whether embeddings can be computed here (BatchRunner::has_hidden).
  bool has_hidden() const { return run_.has_hidden(); }
  const SchedulerOptions& options() const { return opt_; }
  /// Bytes of the KV cache (all tensor-parallel ranks, or the GPU's) and of the workspaces
  /// (measured: the buffers' capacities).
  uint64_t kv_bytes() const { return run_.kv_bytes(cache_); }
  uint64_t workspace_bytes() const;

 private:
  struct Seq;
  void loop();
  static void cancel_queued(GenRequest& r);  // a queued request ended without running
  void trim_when_idle(bool active, double& last_trim);
  void admit(std::vector<std::unique_ptr<Seq>>& active);  // under mu_
  std::unique_ptr<Seq> start_seq(const std::shared_ptr<GenRequest>& r, int64_t want);
  void step(std::vector<std::unique_ptr<Seq>>& active);
  void pool_hidden(const std::vector<std::pair<Seq*, int64_t>>& fed, const float* rows);
  void end_embedding(Seq& s);
  void take_row(Seq& s, size_t at, const float* row);
  int32_t draw(Seq& s, const float* row);
  void finish(Seq& s, const char* reason);
  void emit(Seq& s, bool final);

  const Model& m_;
  std::unique_ptr<TensorParallel> own_;  // the one-rank runner of the (model, pool) constructor
  BatchRunner& run_;
  SchedulerOptions opt_;
  std::vector<int32_t> stop_ids_;  // the model's end-of-sequence/turn tokens (engine/generate.h default_stop_ids)
  KVCache cache_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<GenRequest>> queue_;
  std::atomic<int64_t> running_{0}, kv_used_{0}, constrained_tokens_{0}, constraint_ns_{0}, cached_tokens_{0}, prefix_blocks_{0};
  bool stop_ = false;
  std::thread thread_;
};

/// Seconds on the steady clock.
double now_seconds();

}  // namespace llmq
