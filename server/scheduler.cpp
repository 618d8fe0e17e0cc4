#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "engine/generate.h"
#include "engine/tp.h"
#include "base/error.h"

namespace llmq {

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------- GenRequest

void GenRequest::push(GenEvent e, bool done) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!e.text.empty() || !e.tokens.empty()) events_.push_back(std::move(e));
    done_ = done_ || done;
  }
  if (done) prefilled_ = true;  // ended: whoever waits for its prompt goes on
  cv_.notify_all();
}

bool GenRequest::wait(std::vector<GenEvent>* out, int timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return done_ || !events_.empty(); });
  while (!events_.empty()) {
    out->push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return !done_;
}

// ---------------------------------------------------------------- Scheduler

struct Scheduler::Seq {
  std::shared_ptr<GenRequest> req;
  int32_t kv = -1;               // KV-cache sequence id
  std::vector<int32_t> tokens;   // prompt, then generated ids
  size_t fed = 0;                // tokens already in the KV cache
  int64_t generated = 0;
  Sampler sampler;
  int32_t prev = -1;             // previous id, for decode_piece
  std::string text;              // generated text so far
  size_t emitted = 0;            // bytes of text already sent
  std::vector<TokenInfo> pending;
  std::vector<uint32_t> allowed;  // the constraint's mask, [(vocab + 31) / 32]
  std::vector<TokenInfo> prompt_info;  // prompt_logprobs: the prompt's tokens scored so far
  std::vector<double> pooled;          // embed: [dim] the pooled hidden state so far
  bool done = false;
  explicit Seq(const SamplerParams& p) : sampler(p) {}

  // Whether the forward pass returns a row (logits, or an embedding's hidden state) for the
  // token at index `at` of `tokens`.
  bool wants_row(size_t at) const {
    const GenParams& p = req->params;
    if (p.embed) return *p.embed == Pooling::Mean || (*p.embed == Pooling::First ? at == 0 : at + 1 == p.prompt.size());
    return (p.prompt_logprobs && at < p.prompt.size()) || at + 1 == tokens.size();
  }
  // Which pass of a step feeds it (Scheduler::step): 0 decoding, 1 a prompt chunk, 2 a prompt
  // scored at every position, 3 an embedding's input.
  int pass() const {
    if (req->params.embed) return 3;
    if (req->params.prompt_logprobs && fed < req->params.prompt.size()) return 2;
    return tokens.size() - fed == 1 ? 0 : 1;
  }
};

namespace {

// Length of the longest prefix of text[0, end) that does not end inside a UTF-8 sequence.
size_t utf8_safe_end(const std::string& text, size_t end) {
  size_t i = end;
  int back = 0;
  while (i > 0 && back < 4) {
    const auto c = static_cast<unsigned char>(text[i - 1]);
    if ((c & 0xC0) != 0x80) {  // a lead byte (or ASCII): is its sequence complete?
      const size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
      return (end - (i - 1) >= need) ? end : i - 1;
    }
    --i, ++back;
  }
  return end;
}

}  // namespace

Scheduler::Scheduler(const Model& model, ThreadPool& pool, const SchedulerOptions& opt)
    : m_(model),
      own_(std::make_unique<TensorParallel>(  // the plan llmq-mem infer reports
          model, pool, plan_inference(*model.file, model.config, opt.ctx, opt.n_batch, pool.size(), opt.parallel, true, opt.kv_tokens).ws)),
      run_(*own_),
      opt_(opt),
      stop_ids_(default_stop_ids(m_.vocab)),
      cache_(run_.make_cache(plan_kv(m_.config, server_kv_tokens(opt.ctx, opt.parallel, opt.kv_tokens)).n_blocks, kKvBlockTokens,
                            opt.kv_type)) {
  if (opt.prefix_cache) cache_.enable_prefix_cache();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::Scheduler(BatchRunner& runner, const SchedulerOptions& opt)
    : m_(runner.model()),
      run_(runner),
      opt_(opt),
      stop_ids_(default_stop_ids(m_.vocab)),
      cache_(run_.make_cache(plan_kv(m_.config, server_kv_tokens(opt.ctx, opt.parallel, opt.kv_tokens)).n_blocks, kKvBlockTokens,
                            opt.kv_type)) {
  if (opt.prefix_cache) cache_.enable_prefix_cache();
  thread_ = std::thread([this] { loop(); });
}

uint64_t Scheduler::workspace_bytes() const { return run_.workspace_bytes(); }

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Scheduler::Submit Scheduler::submit(const std::shared_ptr<GenRequest>& r) {
  if (r->params.embed && !run_.has_hidden()) return Submit::NoHidden;
  if (int64_t(r->params.prompt.size()) + (r->params.embed ? 0 : 1) > opt_.ctx || r->params.prompt.empty()) return Submit::TooLong;
  r->t_submit = now_seconds();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (int64_t(queue_.size()) >= opt_.max_queue) return Submit::QueueFull;
    queue_.push_back(r);
  }
  cv_.notify_all();
  return Submit::Ok;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  {
    std::lock_guard<std::mutex> lk(mu_);
    s.queued = int64_t(queue_.size());
  }
  s.running = running_;
  s.kv_blocks_used = kv_used_;
  s.kv_blocks_total = cache_.n_blocks();
  s.cached_prompt_tokens = cached_tokens_;
  s.prefix_blocks = prefix_blocks_;
  s.constrained_tokens = constrained_tokens_;
  s.constraint_seconds = double(constraint_ns_) * 1e-9;
  return s;
}

// Ends a queued request without running it (its client went away, or the server stops).
void Scheduler::cancel_queued(GenRequest& r) {
  r.finish_reason = "cancelled";
  r.push({}, true);
}

// When nothing runs, hands the allocator's free pages back to the system (at most every 5 s):
// memory freed by a burst of requests is otherwise kept, scattered through the arenas, and RSS
// creeps up under mixed traffic (scripts/soak.py) though the live heap does not grow.
void Scheduler::trim_when_idle(bool active, double& last_trim) {
#ifdef __GLIBC__
  if (active || now_seconds() - last_trim <= 5.0) return;
  bool idle;
  {
    std::lock_guard<std::mutex> lk(mu_);
    idle = queue_.empty();
  }
  if (idle) {
    malloc_trim(0);
    last_trim = now_seconds();
  }
#else
  (void)active, (void)last_trim;
#endif
}

// A sequence for admitted request r: a cached prefix (whole blocks) is taken as it is, unless
// every position is wanted; then want positions are reserved (admit checked the blocks).
std::unique_ptr<Scheduler::Seq> Scheduler::start_seq(const std::shared_ptr<GenRequest>& r, int64_t want) {
  auto s = std::make_unique<Seq>(r->params.sampling);
  s->req = r;
  s->kv = cache_.add_sequence();
  const bool whole = r->params.embed || r->params.prompt_logprobs;
  s->fed = whole ? 0 : size_t(cache_.attach_prefix(s->kv, r->params.prompt.data(), int64_t(r->params.prompt.size())));
  r->cached_tokens = int64_t(s->fed);
  cached_tokens_ += r->cached_tokens;
  cache_.reserve(s->kv, want);
  s->tokens = r->params.prompt;
  s->prev = s->tokens.back();  // the first piece continues the prompt: keep its leading space
  if (r->params.prompt_logprobs)  // the first token has no logprob (nothing before it)
    s->prompt_info.push_back({s->tokens[0], m_.tokenizer->decode_piece(-1, s->tokens[0]), NAN, {}, -1});
  r->prompt_tokens = int64_t(s->tokens.size());
  return s;
}

// Under mu_: drops the waiting requests whose clients went away (they must not hold places in
// the queue), then admits waiting requests, first come first served, while a slot and the KV
// blocks for their prompt and max_tokens are free.
void Scheduler::admit(std::vector<std::unique_ptr<Seq>>& active) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (!(*it)->cancelled()) {
      ++it;
      continue;
    }
    cancel_queued(**it);
    it = queue_.erase(it);
  }
  while (!queue_.empty() && int(active.size()) < opt_.parallel) {
    std::shared_ptr<GenRequest> r = queue_.front();
    if (r->cancelled()) {
      queue_.pop_front();
      cancel_queued(*r);
      continue;
    }
    if (r->params.after && !r->params.after->prefilled()) break;  // its leader's prompt first (first come, first served)
    const int64_t want = std::min<int64_t>(int64_t(r->params.prompt.size()) + (r->params.embed ? 0 : r->params.max_tokens), opt_.ctx);
    if (cache_.blocks_for(want) > cache_.free_blocks()) break;
    queue_.pop_front();
    active.push_back(start_seq(r, want));
  }
}

// The scheduler's thread: waits for work, admits, runs a step of every active sequence, retires
// the finished ones; at stop, cancels what runs and what waits.
void Scheduler::loop() {
  std::vector<std::unique_ptr<Seq>> active;
  double last_trim = 0;
  for (;;) {
    trim_when_idle(!active.empty(), last_trim);
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !active.empty(); });
      if (stop_) break;
      admit(active);
    }
    try {
      step(active);
    } catch (const std::exception& e) {  // never let one bad step take the server down
      for (auto& s : active) {
        s->req->finish_reason = std::string("error: ") + e.what();
        finish(*s, nullptr);
      }
    }
    for (auto& s : active)
      if (s->done) cache_.remove_sequence(s->kv);
    active.erase(std::remove_if(active.begin(), active.end(), [](const auto& s) { return s->done; }), active.end());
    running_ = int64_t(active.size());
    kv_used_ = cache_.n_blocks() - cache_.free_blocks();
  }
  for (auto& s : active) {
    s->req->finish_reason = "cancelled";
    finish(*s, nullptr);
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& r : queue_) cancel_queued(*r);
}

void Scheduler::step(std::vector<std::unique_ptr<Seq>>& active) {
  for (auto& s : active)
    if (s->req->cancelled()) {
      s->req->finish_reason = "cancelled";
      finish(*s, nullptr);
    }
  // Within the token budget: decoding sequences (one pending token) first, then prompt chunks,
  // then prompts scored at every position (one logits row each; the rows are opt.parallel), then
  // embedding inputs, which run in a forward pass of their own (hidden states, not logits).
  std::vector<BatchToken> batch, hidden;
  std::vector<std::pair<Seq*, int64_t>> fed, hfed;  // sequence, tokens it feeds this step
  std::vector<std::pair<Seq*, size_t>> rows;        // owner of each logits row, and the index of its token
  int64_t budget = run_.capacity(), rows_left = opt_.parallel;
  for (int pass = 0; pass < 4; ++pass)
    for (auto& sp : active) {
      Seq& s = *sp;
      const int64_t pending = int64_t(s.tokens.size() - s.fed);
      if (s.done || pending <= 0 || s.pass() != pass) continue;
      const int64_t n = std::min({pending, budget, pass == 2 ? rows_left : pending});
      if (n <= 0) continue;
      for (int64_t i = 0; i < n; ++i) {
        const size_t at = s.fed + size_t(i);
        const bool row = s.wants_row(at);
        (pass == 3 ? hidden : batch).push_back({s.kv, s.tokens[at], row});
        if (row && pass != 3) rows.emplace_back(&s, at), --rows_left;
      }
      (pass == 3 ? hfed : fed).emplace_back(&s, n);
      budget -= n;
    }
  if (!hidden.empty()) pool_hidden(hfed, run_.forward_hidden(cache_, hidden.data(), int64_t(hidden.size())));  // first: the logits pass reuses its buffers
  const float* logits = batch.empty() ? nullptr : run_.forward(cache_, batch.data(), int64_t(batch.size()));
  for (auto* list : {&fed, &hfed})
    for (auto& [s, n] : *list) {
      s->fed += size_t(n);
      if (s->fed >= s->req->params.prompt.size()) s->req->prefilled_ = true;
      cache_.register_prefix(s->kv, s->tokens.data(), int64_t(s->fed));  // its full blocks, for later prompts
      if (s->req->params.embed && s->fed == s->tokens.size()) end_embedding(*s);
    }
  prefix_blocks_ = cache_.prefix_blocks();
  for (size_t r = 0; r < rows.size(); ++r) take_row(*rows[r].first, rows[r].second, logits + r * size_t(m_.config.vocab_size));
}

// Adds the hidden-state rows [n_rows, dim] of an embedding pass to their sequences' pools (before
// their `fed` advances: row order is batch order).
void Scheduler::pool_hidden(const std::vector<std::pair<Seq*, int64_t>>& fed, const float* rows) {
  const int64_t D = m_.config.dim;
  for (auto& [s, n] : fed) {
    if (s->pooled.empty()) s->pooled.assign(size_t(D), 0.0);
    const bool sum = *s->req->params.embed == Pooling::Mean;  // else the one wanted row is the pool
    for (int64_t i = 0; i < n; ++i) {
      if (!s->wants_row(s->fed + size_t(i))) continue;
      for (int64_t d = 0; d < D; ++d) s->pooled[size_t(d)] = (sum ? s->pooled[size_t(d)] : 0.0) + rows[d];
      rows += D;
    }
  }
}

// An embedding whose input is all in: its pool, averaged (mean) and L2-normalised, as the result.
void Scheduler::end_embedding(Seq& s) {
  const double k = *s.req->params.embed == Pooling::Mean ? 1.0 / double(s.tokens.size()) : 1.0;
  double norm = 0.0;
  for (double& v : s.pooled) {
    v *= k;
    norm += v * v;
  }
  norm = norm > 0 ? 1.0 / std::sqrt(norm) : 0.0;
  for (double v : s.pooled) s.req->embedding.push_back(float(v * norm));
  finish(s, "stop");
}

// One logits row of s, for the token at index `at` of its tokens: a prompt position scored (echo
// with logprobs), or the last token's, from which the next token is drawn.
void Scheduler::take_row(Seq& s, size_t at, const float* row) {
  const Tokenizer& tok = *m_.tokenizer;
  const int64_t V = m_.config.vocab_size;
  const GenParams& p = s.req->params;
  if (s.done) return;
  if (at + 1 < s.tokens.size()) {  // scores the prompt's next token
    TokenInfo info{s.tokens[at + 1], tok.decode_piece(s.tokens[at], s.tokens[at + 1]), 0.0f, {}, s.tokens[at]};
    info.logprob = Sampler::logprob(row, V, info.id, std::max(p.top_logprobs, 0), &info.top);
    s.prompt_info.push_back(std::move(info));
    return;
  }
  if (p.prompt_logprobs && s.generated == 0) s.req->push({"", std::move(s.prompt_info), true}, false);
  if (p.max_tokens == 0) return finish(s, "length");
  const int32_t id = draw(s, row);
  if (id < 0) return finish(s, "stop");  // the constraint allows nothing (cannot happen with its mask applied)
  s.tokens.push_back(id);
  ++s.generated;
  if (s.generated == 1) s.req->t_first = now_seconds();
  if (std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end() || std::find(p.stop_ids.begin(), p.stop_ids.end(), id) != p.stop_ids.end()) {
    s.generated -= 1;  // the end-of-turn token is not part of the completion
    return finish(s, "stop");
  }
  TokenInfo info{id, tok.decode_piece(s.prev, id), 0.0f, {}, s.prev};
  s.prev = id;
  if (p.top_logprobs >= 0) info.logprob = Sampler::logprob(row, V, id, p.top_logprobs, &info.top);
  const size_t before = s.text.size();
  s.text += info.piece;
  s.pending.push_back(std::move(info));
  // A stop string ends the completion (and is not part of it).
  size_t longest = 0;
  for (const auto& st : p.stop) longest = std::max(longest, st.size());
  const size_t from = before >= longest ? before - longest + 1 : 0;
  size_t cut = std::string::npos;
  for (const auto& st : p.stop)
    if (!st.empty()) cut = std::min(cut, s.text.find(st, from));
  if (cut != std::string::npos) {
    s.text.resize(cut);
    finish(s, "stop");
  } else if (s.generated >= p.max_tokens || int64_t(s.tokens.size()) >= opt_.ctx) {
    finish(s, "length");
  } else {
    emit(s, false);
  }
}

// The next token of s from its logits row, under its constraint if it has one: by rejection
// where that is exact (Sampler::mask_by_rejection: the unconstrained draw, and the mask only when
// the constraint refuses it), else under the mask. The constraint's own time (mask, accept) is
// counted for /metrics. Returns -1 when the constraint accepts nothing.
int32_t Scheduler::draw(Seq& s, const float* row) {
  const int64_t V = m_.config.vocab_size;
  TokenConstraint* rule = s.req->params.constraint.get();
  if (!rule) return s.sampler.sample(row, V, s.tokens);
  int64_t ns = 0;
  auto timed = [&](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool r = f();
    ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  int32_t id = -1;
  if (s.sampler.mask_by_rejection()) {
    id = s.sampler.sample(row, V, s.tokens);
    if (!timed([&] { return rule->accept(id); })) id = -1;
  }
  if (id < 0) {
    s.allowed.resize(size_t((V + 31) / 32));
    const bool masked = timed([&] { return rule->fill_mask(s.allowed.data()); });
    id = s.sampler.sample(row, V, s.tokens, masked ? s.allowed.data() : nullptr);
    if (!timed([&] { return rule->accept(id); })) id = -1;
  }
  ++constrained_tokens_;
  constraint_ns_ += ns;
  return id;
}

void Scheduler::emit(Seq& s, bool final) {
  size_t end = s.text.size();
  if (!final) {
    for (const auto& st : s.req->params.stop)  // hold back what may be the start of a stop string
      for (size_t k = std::min(st.size() - 1, s.text.size()); k > 0 && !st.empty(); --k)
        if (s.text.compare(s.text.size() - k, k, st, 0, k) == 0) {
          end = std::min(end, s.text.size() - k);
          break;
        }
    end = utf8_safe_end(s.text, end);
  }
  if (end < s.emitted) end = s.emitted;
  GenEvent e{s.text.substr(s.emitted, end - s.emitted), std::move(s.pending)};
  s.pending.clear();
  s.emitted = end;
  s.req->push(std::move(e), false);
}

void Scheduler::finish(Seq& s, const char* reason) {
  if (s.done) return;
  if (reason) s.req->finish_reason = reason;
  s.req->completion_tokens = s.generated;
  s.req->t_done = now_seconds();
  if (s.req->t_first == 0) s.req->t_first = s.req->t_done;
  emit(s, true);
  s.req->push({}, true);
  s.done = true;
}

}  // namespace llmq
