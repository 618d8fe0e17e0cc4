#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
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
  bool done = false;
  explicit Seq(const SamplerParams& p) : sampler(p) {}
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
      cache_(run_.make_cache(plan_kv(m_.config, server_kv_tokens(opt.ctx, opt.parallel, opt.kv_tokens)).n_blocks, kKvBlockTokens,
                            opt.kv_type)) {
  if (opt.prefix_cache) cache_.enable_prefix_cache();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::Scheduler(BatchRunner& runner, const SchedulerOptions& opt)
    : m_(runner.model()),
      run_(runner),
      opt_(opt),
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
  if (int64_t(r->params.prompt.size()) + 1 > opt_.ctx || r->params.prompt.empty()) return Submit::TooLong;
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

void Scheduler::loop() {
  std::vector<std::unique_ptr<Seq>> active;
  double last_trim = 0;
  for (;;) {
#ifdef __GLIBC__
    // When nothing runs, hand the allocator's free pages back to the system (at most every 5 s):
    // memory freed by a burst of requests is otherwise kept, scattered through the arenas, and
    // RSS creeps up under mixed traffic (scripts/soak.py) though the live heap does not grow.
    if (active.empty() && now_seconds() - last_trim > 5.0) {
      bool idle;
      {
        std::lock_guard<std::mutex> lk(mu_);
        idle = queue_.empty();
      }
      if (idle) {
        malloc_trim(0);
        last_trim = now_seconds();
      }
    }
#endif
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !active.empty(); });
      if (stop_) break;
      // Drop waiting requests whose clients went away: they must not hold places in the queue.
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (!(*it)->cancelled()) {
          ++it;
          continue;
        }
        (*it)->finish_reason = "cancelled";
        (*it)->push({}, true);
        it = queue_.erase(it);
      }
      // Admit waiting requests, first come first served, while a slot and KV blocks are free.
      while (!queue_.empty() && int(active.size()) < opt_.parallel) {
        std::shared_ptr<GenRequest> r = queue_.front();
        if (r->cancelled()) {
          queue_.pop_front();
          r->finish_reason = "cancelled";
          r->push({}, true);
          continue;
        }
        if (r->params.after && !r->params.after->prefilled()) break;  // its leader's prompt first (first come, first served)
        const int64_t want = std::min<int64_t>(int64_t(r->params.prompt.size()) + r->params.max_tokens, opt_.ctx);
        if (cache_.blocks_for(want) > cache_.free_blocks()) break;
        queue_.pop_front();
        auto s = std::make_unique<Seq>(r->params.sampling);
        s->req = r;
        s->kv = cache_.add_sequence();
        // A cached prefix (whole blocks) is taken as it is; then the rest is reserved (the check
        // above counted every block, so this cannot fail).
        s->fed = size_t(cache_.attach_prefix(s->kv, r->params.prompt.data(), int64_t(r->params.prompt.size())));
        r->cached_tokens = int64_t(s->fed);
        cached_tokens_ += r->cached_tokens;
        cache_.reserve(s->kv, want);
        s->tokens = r->params.prompt;
        s->prev = s->tokens.back();  // the first piece continues the prompt: keep its leading space
        r->prompt_tokens = int64_t(s->tokens.size());
        active.push_back(std::move(s));
      }
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
  for (auto& r : queue_) {
    r->finish_reason = "cancelled";
    r->push({}, true);
  }
}

void Scheduler::step(std::vector<std::unique_ptr<Seq>>& active) {
  for (auto& s : active)
    if (s->req->cancelled()) {
      s->req->finish_reason = "cancelled";
      finish(*s, nullptr);
    }
  // Decoding sequences (one pending token) first, then prompt chunks, within the token budget.
  std::vector<BatchToken> batch;
  std::vector<std::pair<Seq*, int64_t>> fed;  // sequence, tokens it feeds this step
  std::vector<Seq*> sample_for;               // owners of the logits rows, in batch order
  int64_t budget = run_.capacity();
  for (int pass = 0; pass < 2; ++pass)
    for (auto& sp : active) {
      Seq& s = *sp;
      const int64_t pending = int64_t(s.tokens.size() - s.fed);
      if (s.done || pending <= 0 || (pass == 0) != (pending == 1) || budget <= 0) continue;
      const int64_t n = std::min(pending, budget);
      for (int64_t i = 0; i < n; ++i) {
        const bool last = s.fed + size_t(i) + 1 == s.tokens.size();
        batch.push_back({s.kv, s.tokens[s.fed + size_t(i)], last});
        if (last) sample_for.push_back(&s);
      }
      fed.emplace_back(&s, n);
      budget -= n;
    }
  if (batch.empty()) return;
  const float* logits = run_.forward(cache_, batch.data(), int64_t(batch.size()));
  for (auto& [s, n] : fed) {
    s->fed += size_t(n);
    if (s->fed >= s->req->params.prompt.size()) s->req->prefilled_ = true;
    cache_.register_prefix(s->kv, s->tokens.data(), int64_t(s->fed));  // its full blocks, for later prompts
  }
  prefix_blocks_ = cache_.prefix_blocks();

  const Tokenizer& tok = *m_.tokenizer;
  const int64_t V = m_.config.vocab_size;
  const std::vector<int32_t> stop_ids = default_stop_ids(m_.vocab);
  for (size_t r = 0; r < sample_for.size(); ++r) {
    Seq& s = *sample_for[r];
    const float* row = logits + r * size_t(V);
    TokenConstraint* rule = s.req->params.constraint.get();
    // The constraint's own cost (filling the mask, accepting the token) is timed for /metrics;
    // the sampler's pass over the mask touches only the ruled-out tokens.
    auto t0 = std::chrono::steady_clock::now();
    if (rule) s.allowed.resize(size_t((V + 31) / 32));
    const uint32_t* mask = rule && rule->fill_mask(s.allowed.data()) ? s.allowed.data() : nullptr;
    const int64_t fill_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    const int32_t id = s.sampler.sample(row, V, s.tokens, mask);
    t0 = std::chrono::steady_clock::now();
    const bool off_grammar = rule && !rule->accept(id);  // cannot happen with the mask applied
    if (rule) {
      ++constrained_tokens_;
      constraint_ns_ += fill_ns + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
    if (off_grammar) {
      finish(s, "stop");
      continue;
    }
    s.tokens.push_back(id);
    ++s.generated;
    if (s.generated == 1) s.req->t_first = now_seconds();
    const auto& extra = s.req->params.stop_ids;
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end() || std::find(extra.begin(), extra.end(), id) != extra.end()) {
      s.generated -= 1;  // the end-of-turn token is not part of the completion
      finish(s, "stop");
      continue;
    }
    TokenInfo info{id, tok.decode_piece(s.prev, id), 0.0f, {}, s.prev};
    s.prev = id;
    if (s.req->params.top_logprobs >= 0)
      info.logprob = Sampler::logprob(row, V, id, s.req->params.top_logprobs, &info.top);
    const size_t before = s.text.size();
    s.text += info.piece;
    s.pending.push_back(std::move(info));
    // A stop string ends the completion (and is not part of it).
    size_t longest = 0;
    for (const auto& st : s.req->params.stop) longest = std::max(longest, st.size());
    const size_t from = before >= longest ? before - longest + 1 : 0;
    size_t cut = std::string::npos;
    for (const auto& st : s.req->params.stop)
      if (!st.empty()) cut = std::min(cut, s.text.find(st, from));
    if (cut != std::string::npos) {
      s.text.resize(cut);
      finish(s, "stop");
    } else if (s.generated >= s.req->params.max_tokens || int64_t(s.tokens.size()) >= opt_.ctx) {
      finish(s, "length");
    } else {
      emit(s, false);
    }
  }
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
