// llmq-server: OpenAI-compatible HTTP completions with streaming and continuous batching.
//
//   llmq-server -m model.llmq [--host 127.0.0.1] [--port 8080] [--parallel 4] [--api-key KEY]
//               [--alias NAME] [--cors-origin ORIGIN]
//
// Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true -> Server-Sent
// Events; tools -> tool_calls), POST /v1/responses, POST /v1/embeddings, GET /v1/models and
// /v1/models/{id}, GET /health (503 while
// loading), GET /metrics (Prometheus), POST /tokenize, POST /detokenize, GET / (a web chat
// page); OPTIONS (CORS preflight) on every path.
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <signal.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <chrono>
#include <cmath>
#include <sys/socket.h>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "text/chat.h"
#include "engine/runner/device.h"
#include "engine/model.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"
#include "base/error.h"
#include "mem/infer.h"
#include "engine/generate.h"
#include "server/api.h"
#include "server/embeddings.h"
#include "server/http_guard.h"
#include "server/infill.h"
#include "server/responses.h"
#include "server/tool_calls.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/structured.h"
#include "cli/cli_common.h"

using namespace llmq;
using nlohmann::json;

extern const char* const kIndexHtml;  // server/web/index.html, compiled in (CMake)

namespace {

// httplib's stop() does nothing until listen_after_bind() has started: wait for it first.
void stop_server(httplib::Server& svr) {
  while (!svr.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  svr.stop();
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

struct ServerState {
  std::atomic<bool> ready{false};
  // Graceful shutdown (issue 22 item 7): after the first SIGTERM/SIGINT the server is `draining`
  // (new requests get 503, running ones go on) until no request is `active` or the drain timeout
  // passes; then `aborting` makes every running response end with an error and the truth
  // (finish_reason "cancelled"), and the server stops.
  std::atomic<int> active{0};
  std::atomic<bool> draining{false}, aborting{false};
  // A signal arrived: the loader gives up waiting (shared with the signal thread, which must not
  // keep the whole state alive).
  std::shared_ptr<std::atomic<bool>> stopping = std::make_shared<std::atomic<bool>>(false);
  std::string load_error;
  std::unique_ptr<Model> model;
  std::unique_ptr<Runner> runner;          // what runs the batches (engine/runner/runner.h)
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<StructuredOutputs> structured;  // response_format / grammar (server/structured.h)
  std::optional<ChatTemplate> tmpl;
  std::string model_id;
  std::optional<Pooling> pooling;  ///< --pooling; else the model's (ModelConfig::pooling)
  Metrics metrics;
  size_t max_body = 1 << 20;
  size_t max_token_bytes = 4;  ///< most text bytes one token can stand for (set at load)
};

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, e.body());
  if (e.status == 429) res.set_header("Retry-After", "1");
}

json token_logprob_json(const Tokenizer& tok, const TokenInfo& t) {
  auto entry = [&](int32_t id, const std::string& piece, float lp) {
    json bytes = json::array();
    for (unsigned char c : piece) bytes.push_back(int(c));
    return json{{"token", piece}, {"logprob", lp}, {"bytes", bytes}, {"id", id}};
  };
  json j = entry(t.id, t.piece, t.logprob);
  json top = json::array();
  for (const auto& [id, lp] : t.top) top.push_back(entry(id, tok.decode_piece(t.prev, id), lp));
  j["top_logprobs"] = top;
  return j;
}

// /v1/completions' logprobs object, built token by token: tokens, token_logprobs, top_logprobs
// ({"piece": logprob, ...}) and text_offset (into the choice's text). A token with a NaN logprob
// (the prompt's first, under echo) has null for both.
struct CompletionLogprobs {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  void add(const Tokenizer& tok, const TokenInfo& t, size_t offset) {
    tokens.push_back(t.piece);
    offsets.push_back(offset);
    if (std::isnan(t.logprob)) {
      lps.push_back(nullptr), tops.push_back(nullptr);
      return;
    }
    json top = json::object();
    for (const auto& [id, lp] : t.top) top[tok.decode_piece(t.prev, id)] = lp;
    lps.push_back(t.logprob), tops.push_back(top);
  }
  json to_json() const { return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}}; }
};

// A prompt text of more than ctx x max_token_bytes bytes cannot fit the context, whatever its
// tokens: refuse it before tokenizing. Tokenizing a near-1-MiB prompt only to refuse it took
// tens of MB of short-lived memory per request (the soak saw RSS grow by ~200 MB from it).
// `param` names the request field (messages, prompt, input).
void check_prompt_bytes(const ServerState& st, const std::string& param, size_t bytes, int64_t ctx) {
  if (bytes / st.max_token_bytes >= size_t(ctx))
    throw ApiError(400, "the " + param + " of " + std::to_string(bytes) + " bytes is longer than the context of " + std::to_string(ctx) +
                            " tokens can hold",
                   param, "context_length_exceeded");
}

// Token ids given by the client must be in the vocabulary (ApiError 400 on `param`).
void check_token_ids(const ServerState& st, const std::vector<int32_t>& ids, const std::string& param) {
  for (int32_t id : ids)
    if (id < 0 || id >= int32_t(st.model->vocab.size()))
      throw ApiError(400, param + " token id " + std::to_string(id) + " out of range", param);
}

// The build that answered, as OpenAI's system_fingerprint.
const std::string kSystemFingerprint = std::string("fp_llmq_") + LLMQ_VERSION;

// n random hex digits (response ids, as OpenAI's are random rather than counting).
std::string random_hex(int n) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[rng() % 16];
  return s;
}

// The prompt as /v1/completions' echo gives it back: the text, or the given token ids decoded.
std::string echo_text(const ServerState& st, const CompletionRequest& r) {
  if (r.prompt_ids.empty()) return r.prompt;
  std::string text;
  int32_t prev = -1;
  for (int32_t id : r.prompt_ids) text += st.model->tokenizer->decode_piece(prev, id), prev = id;
  return text;
}

// Whether the reply of a chat request is parsed for tool calls (server/tool_calls.h).
bool uses_tools(const CompletionRequest& r) { return r.chat && !r.tools.empty() && !r.tool_choice_none; }

// A streamed reply of a request with tools: its text so far and the bytes sent as content.
struct ToolStream {
  std::string text;
  size_t sent = 0;
};

// The deltas that end a streamed reply whose `rest` was held back: its text outside the calls
// (if any), then one delta with every call (OpenAI's streamed form: index, id, type, function).
std::vector<json> held_deltas(const std::string& rest, const std::string& id, const std::vector<std::string>& tools) {
  const ParsedReply p = parse_tool_calls(rest, id, tools);
  if (p.calls.empty()) return {json{{"content", rest}}};
  std::vector<json> out;
  if (!p.content.empty()) out.push_back({{"content", p.content}});
  json calls = json::array();
  for (size_t i = 0; i < p.calls.size(); ++i) {
    json c = p.calls[i];
    c["index"] = i;
    calls.push_back(c);
  }
  out.push_back({{"tool_calls", calls}});
  return out;
}

// Tokens of the request's prompt (chat: through the template, markup as special tokens).
std::vector<int32_t> prompt_tokens(const ServerState& st, const CompletionRequest& r, int64_t ctx) {
  const Tokenizer& tok = *st.model->tokenizer;
  const Vocab& v = st.model->vocab;
  std::vector<int32_t> ids;
  if (r.chat) {
    if (!st.tmpl) throw ApiError(400, "the model has no chat template; use /v1/completions", "messages");
    std::vector<ChatTemplate::Segment> segs;
    try {
      segs = st.tmpl->apply_segments(r.messages, true, r.tools);
    } catch (const UsageError& e) {  // the template refused the conversation (raise_exception, a role it lacks, tools)
      throw ApiError(400, std::string("the chat template cannot render this conversation: ") + e.what(), "messages");
    }
    size_t bytes = 0;
    for (const auto& seg : segs) bytes += seg.text.size();
    check_prompt_bytes(st, "messages", bytes, ctx);
    const std::string bos_text = v.bos_id >= 0 ? v.tokens[size_t(v.bos_id)] : "";
    const bool starts_with_bos = !segs.empty() && segs[0].special && !bos_text.empty() && segs[0].text.rfind(bos_text, 0) == 0;
    if (v.add_bos && v.bos_id >= 0 && !starts_with_bos) ids.push_back(v.bos_id);
    for (const auto& s : segs) {
      const auto part = tok.encode(s.text, false, s.special);
      ids.insert(ids.end(), part.begin(), part.end());
    }
  } else if (!r.prompt_ids.empty()) {
    check_token_ids(st, r.prompt_ids, "prompt");
    ids = r.prompt_ids;
  } else if (!r.suffix.empty()) {  // fill in the middle
    check_prompt_bytes(st, "prompt", r.prompt.size() + r.suffix.size(), ctx);
    const auto fim = find_infill_tokens(v);
    if (!fim) throw ApiError(400, "'suffix' needs a model trained to fill in the middle; this vocabulary has no FIM tokens", "suffix");
    ids = infill_prompt(tok, *fim, r.prompt, r.suffix);
  } else {
    check_prompt_bytes(st, "prompt", r.prompt.size(), ctx);
    ids = tok.encode(r.prompt, v.add_bos);
  }
  if (ids.empty()) throw ApiError(400, "the prompt is empty", r.chat ? "messages" : "prompt");
  return ids;
}

// One accepted completion request on its way out: what the response needs.
struct Reply {
  ServerState& st;
  std::vector<std::shared_ptr<GenRequest>> gs;  ///< one per choice: prompt i's sample k is gs[i · r.n + k]
  CompletionRequest r;
  bool chat;
  std::string id;
  int64_t created;
  const char* endpoint;
  std::shared_ptr<void> in_flight;  ///< keeps st.active counted until the last copy goes
  json responses_request = nullptr;  ///< /v1/responses: the request as sent (the reply is a Response); else null
  bool http10 = false;  ///< an HTTP/1.0 request: no chunked transfer coding, so a whole reply is sent whole

  /// The one choice of a streamed response.
  const std::shared_ptr<GenRequest>& g() const { return gs.front(); }
  void cancel() const {
    for (const auto& g : gs) g->cancel();
  }
  /// OpenAI's usage: each prompt's tokens once (as for n > 1), every choice's completion.
  json usage() const {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (size_t i = 0; i < gs.size(); ++i) {
      completion += gs[i]->completion_tokens;
      if (i % size_t(r.n) == 0) prompt += gs[i]->prompt_tokens, cached += gs[i]->cached_tokens;
    }
    return json{{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion},
                {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }
  void record(int status) const {
    st.metrics.count_request(endpoint, status);
    for (const auto& g : gs) {
      st.metrics.prompt_tokens += uint64_t(g->prompt_tokens);
      st.metrics.generated_tokens += uint64_t(g->completion_tokens);
      if (g->completion_tokens > 0) st.metrics.ttft.observe(g->t_first - g->t_submit);
      if (g->completion_tokens > 1) st.metrics.tpot.observe((g->t_done - g->t_first) / double(g->completion_tokens - 1));
    }
  }
  static json finish_reason(const GenRequest& g) {
    if (g.finish_reason == "stop" || g.finish_reason == "length") return g.finish_reason;
    return "stop";
  }
};

// One choice of a finished request: its JSON (index, text or message, finish_reason, logprobs).
json whole_choice(const Reply& rp, size_t index, const std::vector<GenEvent>& events) {
  const ServerState& st = rp.st;
  const GenRequest& g = *rp.gs[index];
  const CompletionRequest& r = rp.r;
  const Tokenizer& tok = *st.model->tokenizer;
  const std::string echo = !rp.chat && r.echo ? echo_text(st, r.with_prompt(index / size_t(r.n))) : "";
  std::string text;
  json lp_content = json::array();
  CompletionLogprobs lps;
  size_t prompt_offset = 0;  // echo: the prompt's tokens' offsets
  for (const GenEvent& e : events) {
    for (const TokenInfo& t : e.tokens) {
      if (r.top_logprobs < 0) continue;
      if (rp.chat) lp_content.push_back(token_logprob_json(tok, t));
      else lps.add(tok, t, e.prompt ? prompt_offset : echo.size() + text.size());
      if (e.prompt) prompt_offset += t.piece.size();
    }
    text += e.text;
  }
  json choice = {{"index", index}, {"finish_reason", Reply::finish_reason(g)}, {"logprobs", nullptr}};
  if (rp.chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
    if (uses_tools(r)) {
      const std::string call_ids = rp.gs.size() > 1 ? rp.id + "_" + std::to_string(index) : rp.id;
      const ParsedReply p = parse_tool_calls(text, call_ids, tool_names(r.tools));
      if (!p.calls.empty()) {
        choice["message"] = {{"role", "assistant"}, {"content", p.content.empty() ? json(nullptr) : json(p.content)}, {"tool_calls", p.calls}};
        choice["finish_reason"] = "tool_calls";
      }
    }
    if (r.top_logprobs >= 0) choice["logprobs"] = {{"content", lp_content}};
  } else {
    choice["text"] = echo + text;
    if (r.top_logprobs >= 0) choice["logprobs"] = lps.to_json();
  }
  return choice;
}

// The whole response of a finished request: its status and JSON body (events [choices]).
std::pair<int, json> whole_body(const Reply& rp, const std::vector<std::vector<GenEvent>>& events) {
  json choices = json::array();
  for (size_t i = 0; i < rp.gs.size(); ++i) {
    if (rp.gs[i]->finish_reason.rfind("error", 0) == 0)
      return {500, ApiError(500, rp.gs[i]->finish_reason, "", "", "server_error").body()};
    choices.push_back(whole_choice(rp, i, events[i]));
  }
  if (!rp.responses_request.is_null()) {  // /v1/responses: one choice as a Response object
    const json& m = choices[0]["message"];
    return {200, response_object(rp.id, rp.created, rp.st.model_id, m["content"].is_string() ? m["content"].get<std::string>() : "",
                                 m.value("tool_calls", json::array()), choices[0]["finish_reason"], rp.usage(), rp.responses_request)};
  }
  return {200, json{{"id", rp.id},
                    {"object", rp.chat ? "chat.completion" : "text_completion"},
                    {"system_fingerprint", kSystemFingerprint},
                    {"created", rp.created},
                    {"model", rp.st.model_id},
                    {"choices", choices},
                    {"usage", rp.usage()}}};
}

// Waits up to timeout_ms for any choice's events; false when every choice has finished and its
// events are drained.
bool wait_choices(const Reply& rp, std::vector<std::vector<GenEvent>>& events, int timeout_ms) {
  bool alive = false;
  for (size_t i = 0; i < rp.gs.size(); ++i)
    alive = rp.gs[i]->wait(&events[i], alive ? 0 : timeout_ms) || alive;  // block on the first running one only
  return alive;
}

// A non-streamed response: a request that ends within 2 s gets a plain one, a longer one is
// sent chunked with a space each second (a probe that cancels the request when the client left).
void respond_whole(const std::shared_ptr<Reply>& rp, httplib::Response& res) {
  ServerState& st = rp->st;
  // A request that ends within 2 s gets a plain response (an HTTP/1.0 one always: its client
  // knows no chunked coding, and it waits without being probed).
  auto events = std::make_shared<std::vector<std::vector<GenEvent>>>(rp->gs.size());
  const double deadline = now_seconds() + (rp->http10 ? 1e9 : 2.0);
  bool alive = true;
  while (alive && now_seconds() < deadline && !st.aborting) alive = wait_choices(*rp, *events, 200);
  if (alive && st.aborting) {  // shutting down past the drain timeout, nothing sent yet: a real 503
    rp->cancel();
    send_json(res, 503, ApiError(503, "the server is shutting down: the completion was cancelled", "", "", "server_error").body());
    rp->record(503);
    return;
  }
  if (!alive) {
    const auto [status, body] = whole_body(*rp, *events);
    send_json(res, status, body);
    rp->record(status);
    return;
  }
  // A longer one is sent chunked, and each second a space (white space before JSON is valid
  // JSON) probes the connection, so a client that went away cancels its sequences and frees
  // their KV blocks within a second or two instead of at max_tokens.
  auto finished = std::make_shared<bool>(false);
  res.set_chunked_content_provider(
      "application/json",
      [&st, rp, events, finished](size_t, httplib::DataSink& sink) {
        if (st.aborting) {  // shutting down past the drain timeout: say so (the status, 200, is on the wire)
          rp->cancel();
          const std::string text = dump(ApiError(503, "the server is shutting down: the completion was cancelled", "", "",
                                                 "server_error").body());
          sink.write(text.data(), text.size());
          sink.done();
          *finished = true;
          rp->record(503);
          return true;
        }
        if (wait_choices(*rp, *events, 1000)) {
          if (!sink.write(" ", 1)) {
            rp->cancel();
            return false;
          }
          return true;
        }
        const auto [status, body] = whole_body(*rp, *events);  // status is already 200 on the wire
        const std::string text = dump(body);
        sink.write(text.data(), text.size());
        sink.done();
        *finished = true;
        rp->record(status);
        return true;
      },
      [rp, finished](bool) {
        if (!*finished) rp->cancel();
      });
}

// One choice of a streamed response: its request, and with tools the reply so far and how much
// of it went out as content.
struct StreamChoice {
  std::shared_ptr<GenRequest> g;
  size_t index = 0;
  ToolStream held;
  bool ended = false;
};

// The chunk of one step's output of choice c, or null when it is all held back (a possible
// tool call).
json stream_delta(const Reply& rp, StreamChoice& c, const GenEvent& e) {
  const CompletionRequest& r = rp.r;
  const Tokenizer& tok = *rp.st.model->tokenizer;
  json choice = {{"index", c.index}, {"finish_reason", nullptr}, {"logprobs", nullptr}};
  if (rp.chat && uses_tools(r)) {  // content up to a (possible) <tool_call>; the rest waits for the end
    c.held.text += e.text;
    const size_t safe = tool_call_safe_prefix(c.held.text);
    if (safe <= c.held.sent) return nullptr;
    choice["delta"] = {{"content", c.held.text.substr(c.held.sent, safe - c.held.sent)}};
    c.held.sent = safe;
  } else if (rp.chat) {
    choice["delta"] = {{"content", e.text}};
    if (r.top_logprobs >= 0) {
      json content = json::array();
      for (const TokenInfo& t : e.tokens) content.push_back(token_logprob_json(tok, t));
      choice["logprobs"] = {{"content", content}};
    }
  } else {
    choice["text"] = e.text;  // a prompt event (echo with logprobs) has none: the echo went first
    if (r.top_logprobs >= 0) {
      CompletionLogprobs lps;
      for (const TokenInfo& t : e.tokens) lps.add(tok, t, 0);
      json j = lps.to_json();
      j.erase("text_offset");  // offsets into a stream's whole text are the client's to count
      choice["logprobs"] = j;
    }
  }
  return choice;
}

// The chunks that end choice c: the held rest (text and calls), then its finish_reason.
std::vector<json> stream_end(const Reply& rp, StreamChoice& c) {
  std::vector<json> out;
  json last = {{"index", c.index}, {"finish_reason", Reply::finish_reason(*c.g)}, {"logprobs", nullptr}};
  if (rp.chat) last["delta"] = json::object();
  else last["text"] = "";
  if (rp.chat && uses_tools(rp.r) && c.held.sent < c.held.text.size()) {
    const std::string call_ids = rp.gs.size() > 1 ? rp.id + "_" + std::to_string(c.index) : rp.id;
    for (const json& delta : held_deltas(c.held.text.substr(c.held.sent), call_ids, tool_names(rp.r.tools))) {
      out.push_back({{"index", c.index}, {"delta", delta}, {"finish_reason", nullptr}, {"logprobs", nullptr}});
      if (delta.contains("tool_calls")) last["finish_reason"] = "tool_calls";
    }
  }
  out.push_back(last);
  return out;
}

// What a Server-Sent Events reply keeps between calls of its content provider: the reply, and
// whether it ended (else closing the connection cancels its sequences).
class SseStream {
 public:
  explicit SseStream(std::shared_ptr<Reply> rp) : rp_(std::move(rp)), st_(rp_->st) {}
  bool finished() const { return finished_; }
  void cancel() { rp_->cancel(); }

 protected:
  bool gone() {  // the client went away: free the sequences now
    rp_->cancel();
    return false;
  }
  bool finish(httplib::DataSink& sink, int status) {  // the stream's end, recorded with its HTTP status
    sink.done();
    finished_ = true;
    rp_->record(status);
    return true;
  }

  std::shared_ptr<Reply> rp_;
  ServerState& st_;
  bool finished_ = false;
};

// Serves rp as a stream of Stream (an SseStream with provide(sink): the content provider's body,
// true to be called again or at the end, false when the client went away).
template <class Stream>
void respond_sse(const std::shared_ptr<Reply>& rp, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  auto stream = std::make_shared<Stream>(rp);
  res.set_chunked_content_provider(
      "text/event-stream", [stream](size_t, httplib::DataSink& sink) { return stream->provide(sink); },
      [stream](bool) {
        if (!stream->finished()) stream->cancel();  // connection closed before the end
      });
}

// A streamed completion in progress: Server-Sent Events, one chunk per step's output of each
// choice (its index says which), each choice's last chunk when it ends, then [DONE].
class CompletionStream : public SseStream {
 public:
  explicit CompletionStream(std::shared_ptr<Reply> rp) : SseStream(std::move(rp)) {
    for (size_t i = 0; i < rp_->gs.size(); ++i) choices_.push_back(StreamChoice{rp_->gs[i], i, {}, false});
  }

  bool provide(httplib::DataSink& sink) {
    if (!started_ && !open(sink)) return gone();
    if (st_.aborting) return abort(sink);  // shutting down past the drain timeout
    bool waited = false, alive = false;
    for (StreamChoice& c : choices_) {
      if (c.ended) continue;
      std::vector<GenEvent> events;
      const bool running = c.g->wait(&events, waited ? 0 : 200);  // block on the first running choice only
      waited = true;
      for (const GenEvent& e : events)
        if (const json d = stream_delta(*rp_, c, e); !d.is_null() && !send(sink, chunk(d))) return gone();
      if (running) {
        alive = true;
        continue;
      }
      c.ended = true;
      for (const json& d : stream_end(*rp_, c))
        if (!send(sink, chunk(d))) return gone();
    }
    if (alive) return sink.is_writable() ? true : gone();
    bool ok = true;
    if (rp_->r.include_usage) {
      json u = chunk(nullptr);
      u["usage"] = rp_->usage();
      ok = send(sink, u);
    }
    return end(sink, ok, 200);
  }

 private:
  json chunk(const json& choice) const {
    return json{{"id", rp_->id},
                {"object", rp_->chat ? "chat.completion.chunk" : "text_completion"},
                {"system_fingerprint", kSystemFingerprint},
                {"created", rp_->created},
                {"model", st_.model_id},
                {"choices", choice.is_null() ? json::array() : json::array({choice})}};
  }
  static bool send(httplib::DataSink& sink, const json& c) {
    const std::string s = "data: " + dump(c) + "\n\n";
    return sink.write(s.data(), s.size());
  }
  // The first chunks: the assistant role (chat), the echoed prompt (completions with echo).
  bool open(httplib::DataSink& sink) {
    started_ = true;
    for (const StreamChoice& c : choices_) {
      if (rp_->chat && !send(sink, chunk({{"index", c.index}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"finish_reason", nullptr}})))
        return false;
      if (rp_->r.echo && !send(sink, chunk({{"index", c.index}, {"text", echo_text(st_, rp_->r.with_prompt(c.index / size_t(rp_->r.n)))},
                                             {"finish_reason", nullptr}, {"logprobs", nullptr}})))
        return false;
    }
    return true;
  }
  // Shutting down: an error event, each open choice's true finish_reason (cancelled), [DONE].
  bool abort(httplib::DataSink& sink) {
    rp_->cancel();
    bool ok = send(sink, ApiError(503, "the server is shutting down: the completion was cancelled", "", "", "server_error").body());
    for (const StreamChoice& c : choices_) {
      json last = {{"index", c.index}, {"finish_reason", "cancelled"}, {"logprobs", nullptr}};
      if (rp_->chat) last["delta"] = json::object();
      else last["text"] = "";
      ok = ok && (c.ended || send(sink, chunk(last)));
    }
    return end(sink, ok, 503);
  }
  bool end(httplib::DataSink& sink, bool ok, int status) {  // [DONE] when the client is still there
    if (ok) {
      const std::string d = "data: [DONE]\n\n";
      sink.write(d.data(), d.size());
    }
    return finish(sink, status);
  }

  std::vector<StreamChoice> choices_;
  bool started_ = false;
};

// A /v1/responses stream in progress (OpenAI API reference, "Streaming events"):
// response.created, then per text piece response.output_text.delta inside a message item (opened
// at the first text), the items' done events, function_call items, and response.completed with
// the whole Response.
class ResponsesStream : public SseStream {
 public:
  explicit ResponsesStream(std::shared_ptr<Reply> rp) : SseStream(std::move(rp)), msg_id_("msg_" + rp_->id.substr(5)) {
    c_ = StreamChoice{rp_->g(), 0, {}, false};
  }

  bool provide(httplib::DataSink& sink) {
    if (seq_ == 0) {
      json created = response_object(rp_->id, rp_->created, st_.model_id, "", json::array(), "stop", nullptr, rp_->responses_request);
      created["status"] = "in_progress", created["output"] = json::array();
      if (!send(sink, "response.created", {{"response", created}}) || !send(sink, "response.in_progress", {{"response", created}}))
        return gone();
    }
    if (st_.aborting) {  // shutting down past the drain timeout
      rp_->cancel();
      send(sink, "error", {{"code", "server_error"}, {"message", "the server is shutting down: the response was cancelled"}, {"param", nullptr}});
      return finish(sink, 503);
    }
    std::vector<GenEvent> events;
    const bool alive = c_.g->wait(&events, 200);
    for (const GenEvent& e : events)
      if (const json d = stream_delta(*rp_, c_, e); !d.is_null() && !piece(sink, d["delta"].value("content", ""))) return gone();
    if (alive) return sink.is_writable() ? true : gone();
    json calls = json::array(), reason = Reply::finish_reason(*c_.g);
    for (const json& d : stream_end(*rp_, c_)) {
      if (d.contains("finish_reason") && !d["finish_reason"].is_null()) reason = d["finish_reason"];
      if (!d.contains("delta")) continue;
      if (d["delta"].contains("content") && d["delta"]["content"].is_string() && !piece(sink, d["delta"]["content"].get<std::string>()))
        return gone();
      for (const json& tc : d["delta"].value("tool_calls", json::array()))
        calls.push_back({{"id", tc["id"]}, {"type", "function"}, {"function", tc["function"]}});
    }
    const bool ok = close_message(sink) && send_calls(sink, calls);
    const json done = response_object(rp_->id, rp_->created, st_.model_id, text_, calls, reason, rp_->usage(), rp_->responses_request);
    if (ok) send(sink, done["status"] == "completed" ? "response.completed" : "response.incomplete", {{"response", done}});
    return finish(sink, 200);
  }

 private:
  bool send(httplib::DataSink& sink, const char* type, json e) {
    e["type"] = type, e["sequence_number"] = seq_++;
    const std::string line = std::string("event: ") + type + "\ndata: " + dump(e) + "\n\n";
    return sink.write(line.data(), line.size());
  }
  json message_item(const char* status) const {
    return json{{"type", "message"}, {"id", msg_id_}, {"status", status}, {"role", "assistant"},
                {"content", item_open_ && std::string(status) == "completed"
                                ? json::array({{{"type", "output_text"}, {"text", text_}, {"annotations", json::array()}}})
                                : json::array()}};
  }
  bool piece(httplib::DataSink& sink, const std::string& text) {  // one text delta, opening the message item first
    if (text.empty()) return true;
    if (!item_open_) {
      item_open_ = true;
      if (!send(sink, "response.output_item.added", {{"output_index", 0}, {"item", message_item("in_progress")}}) ||
          !send(sink, "response.content_part.added", {{"item_id", msg_id_}, {"output_index", 0}, {"content_index", 0},
                                                       {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}}))
        return false;
    }
    text_ += text;
    return send(sink, "response.output_text.delta",
                {{"item_id", msg_id_}, {"output_index", 0}, {"content_index", 0}, {"delta", text}, {"logprobs", json::array()}});
  }
  bool close_message(httplib::DataSink& sink) {  // the message item's done events, when it was opened
    if (!item_open_) return true;
    const json part = {{"type", "output_text"}, {"text", text_}, {"annotations", json::array()}};
    return send(sink, "response.output_text.done",
                {{"item_id", msg_id_}, {"output_index", 0}, {"content_index", 0}, {"text", text_}, {"logprobs", json::array()}}) &&
           send(sink, "response.content_part.done", {{"item_id", msg_id_}, {"output_index", 0}, {"content_index", 0}, {"part", part}}) &&
           send(sink, "response.output_item.done", {{"output_index", 0}, {"item", message_item("completed")}});
  }
  bool send_calls(httplib::DataSink& sink, const json& calls) {  // a function_call item per call, after the message
    for (size_t i = 0; i < calls.size(); ++i) {
      const json item = function_call_item(calls[i]);
      const int64_t index = int64_t(i) + (item_open_ ? 1 : 0);
      if (!send(sink, "response.output_item.added", {{"output_index", index}, {"item", item}}) ||
          !send(sink, "response.function_call_arguments.done", {{"item_id", item["id"]}, {"output_index", index}, {"arguments", item["arguments"]}}) ||
          !send(sink, "response.output_item.done", {{"output_index", index}, {"item", item}}))
        return false;
    }
    return true;
  }
  const std::string msg_id_;
  StreamChoice c_;
  int64_t seq_ = 0;
  bool item_open_ = false;
  std::string text_;
};

// The generation parameters of every choice of r, in index order (prompt i's sample k at
// i · n + k): each its own prompt tokens, seed (seed + k) and constraint; a sample after the
// first of a prompt waits for the first's prefill, so it starts from the blocks the prefix cache
// then holds (`after`). Throws ApiError.
std::vector<GenParams> choice_params(const ServerState& st, CompletionRequest& r, int64_t ctx) {
  for (const auto& [tid, bias] : r.sampling.logit_bias)
    if (tid >= int32_t(st.model->vocab.size())) throw ApiError(400, "logit_bias token id " + std::to_string(tid) + " is out of range", "logit_bias");
  if (r.tool_choice_forced) {
    if (r.format.kind != OutputFormat::Kind::Text)
      throw ApiError(400, "tool_choice that forces a call cannot be combined with response_format or grammar", "tool_choice");
    try {
      r.format = forced_tool_call(r.tools, r.tool_choice_name, tool_syntax(st.model->chat_template));
    } catch (const UsageError& e) {
      throw ApiError(400, e.what(), "tool_choice");
    }
  }
  std::vector<GenParams> out;
  for (size_t i = 0; i < r.prompts(); ++i) {
    const CompletionRequest ri = r.with_prompt(i);
    GenParams gp;
    gp.prompt = prompt_tokens(st, ri, ctx);
    if (int64_t(gp.prompt.size()) + 1 > ctx)
      throw ApiError(400, "the prompt has " + std::to_string(gp.prompt.size()) + " tokens; the context is " + std::to_string(ctx),
                     r.chat ? "messages" : "prompt", "context_length_exceeded");
    const int64_t room = ctx - int64_t(gp.prompt.size());
    gp.max_tokens = std::min(r.max_tokens >= 0 ? r.max_tokens : (r.chat ? room : 16), room);
    gp.stop = r.stop;
    if (!r.suffix.empty()) gp.stop_ids = find_infill_tokens(st.model->vocab)->stops;
    gp.top_logprobs = r.top_logprobs;
    gp.prompt_logprobs = r.echo && r.top_logprobs >= 0;
    for (int k = 0; k < r.n; ++k) {
      gp.sampling = r.sampling;
      gp.sampling.seed = r.sampling.seed + uint64_t(k);
      try {
        gp.constraint = st.structured->constraint(r.format);  // a matcher of its own (the compiled grammar is cached)
      } catch (const UsageError& e) {
        throw ApiError(400, e.what(), r.tool_choice_forced ? "tool_choice" : r.format.kind == OutputFormat::Kind::Grammar ? "grammar" : "response_format");
      }
      out.push_back(gp);
    }
  }
  return out;
}

// A completion request (`body`: a /v1/completions or /v1/chat/completions body; with
// `responses_request` set, the chat translation of that /v1/responses request) parsed, queued and
// answered, whole or streamed.
void handle_generation(ServerState& st, const std::string& body, httplib::Response& res, bool chat, const char* endpoint,
                       const json& responses_request = nullptr, bool http10 = false) {
  if (!st.ready) {
    send_json(res, 503, ApiError(503, "the model is loading", "", "", "server_error").body());
    return;
  }
  const int64_t ctx = st.scheduler->options().ctx;
  CompletionRequest r;
  std::vector<GenParams> params;
  try {
    r = parse_completion_request(body, chat, st.model_id, ctx, st.max_body);
    if (!responses_request.is_null() && r.n != 1) throw ApiError(400, "/v1/responses takes no 'n'", "n");
    params = choice_params(st, r, ctx);
  } catch (const ApiError& e) {
    send_error(res, e);
    st.metrics.count_request(endpoint, e.status);
    return;
  }
  std::vector<std::shared_ptr<GenRequest>> gs;
  for (size_t i = 0; i < params.size(); ++i) {
    if (i % size_t(r.n) != 0) params[i].after = gs[i - i % size_t(r.n)];  // the prompt's first sample
    gs.push_back(std::make_shared<GenRequest>(params[i]));
    const Scheduler::Submit sub = st.scheduler->submit(gs.back());
    if (sub == Scheduler::Submit::Ok) continue;
    for (const auto& g : gs) g->cancel();  // the choices already queued
    if (sub == Scheduler::Submit::QueueFull) {
      send_error(res, ApiError(429, "the server is busy: too many requests queued; retry later", "", "rate_limit_exceeded",
                               "rate_limit_error"));
      st.metrics.count_request(endpoint, 429);
    } else {
      send_error(res, ApiError(400, "the prompt does not fit the context", chat ? "messages" : "prompt", "context_length_exceeded"));
    }
    return;
  }

  ++st.active;  // until the response is done: the last copy of `in_flight` goes with it
  const bool responses = !responses_request.is_null();
  std::string id = std::string(responses ? "resp_" : chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
  auto in_flight = std::shared_ptr<void>(nullptr, [&st](void*) { --st.active; });
  auto reply = std::make_shared<Reply>(Reply{st, std::move(gs), std::move(r), chat, std::move(id), int64_t(std::time(nullptr)),
                                             endpoint, std::move(in_flight), responses_request, http10});
  if (reply->r.stream && responses) respond_sse<ResponsesStream>(reply, res);
  else if (reply->r.stream) respond_sse<CompletionStream>(reply, res);
  else respond_whole(reply, res);
}

void handle_completion(ServerState& st, const httplib::Request& req, httplib::Response& res, bool chat) {
  handle_generation(st, req.body, res, chat, chat ? "/v1/chat/completions" : "/v1/completions", nullptr, req.version == "HTTP/1.0");
}

// POST /v1/embeddings: each input (text, tokenized as a completions prompt, or token ids) pooled
// and normalised by the scheduler (server/embeddings.h).
void handle_embeddings(ServerState& st, const httplib::Request& req, httplib::Response& res) {
  const char* endpoint = "/v1/embeddings";
  if (!st.ready) return send_json(res, 503, ApiError(503, "the model is loading", "", "", "server_error").body());
  try {
    const Model& m = *st.model;
    const EmbeddingRequest r = parse_embedding_request(req.body, st.model_id, m.config.dim, st.max_body);
    std::vector<std::vector<int32_t>> inputs = r.ids;
    for (const std::string& text : r.texts) {
      check_prompt_bytes(st, "input", text.size(), st.scheduler->options().ctx);
      inputs.push_back(m.tokenizer->encode(text, m.vocab.add_bos));
    }
    int64_t tokens = 0;
    for (const auto& ids : inputs) {
      check_token_ids(st, ids, "input");
      if (ids.empty()) throw ApiError(400, "an input has no tokens", "input");
      tokens += int64_t(ids.size());
    }
    const auto vectors =
        run_embeddings(*st.scheduler, inputs, st.pooling.value_or(m.config.pooling), int(st.scheduler->options().parallel), st.aborting);
    send_json(res, 200, embeddings_json(vectors, r.base64, st.model_id, tokens));
    st.metrics.prompt_tokens += uint64_t(tokens);
    st.metrics.count_request(endpoint, 200);
  } catch (const ApiError& e) {
    send_error(res, e);
    st.metrics.count_request(endpoint, e.status);
  }
}

// POST /v1/responses: translated to a chat request (server/responses.h), answered as a Response.
void handle_responses(ServerState& st, const httplib::Request& req, httplib::Response& res) {
  json chat;
  json request;
  try {
    if (req.body.size() > st.max_body) throw ApiError(413, "request body too large");
    request = parse_json_body(req.body);
    chat = responses_to_chat(request);
  } catch (const ApiError& e) {
    send_error(res, e);
    st.metrics.count_request("/v1/responses", e.status);
    return;
  }
  handle_generation(st, chat.dump(), res, true, "/v1/responses", request, req.version == "HTTP/1.0");
}

}  // namespace

// The graceful part of a shutdown, after signal `sig`: new requests get 503 while the running
// ones finish, for up to drain_s seconds or until a second signal; what still runs then is ended
// with an error (ServerState::aborting), given up to 3 s to say so.
static void drain(ServerState& st, const sigset_t& sigs, int sig, double drain_s) {
  st.draining = true;
  std::fprintf(stderr, "llmq-server: signal %d: draining %d running request(s) for up to %g s (a second signal stops at once)\n",
               sig, st.active.load(), drain_s);
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const timespec step{0, 100 * 1000 * 1000};
  bool second = false;
  while (st.ready && st.active > 0 && waited() < drain_s && !second) second = sigtimedwait(&sigs, nullptr, &step) > 0;
  if (st.active > 0) {
    std::fprintf(stderr, "llmq-server: %s: ending %d request(s) that did not finish\n", second ? "second signal" : "drain timeout",
                 st.active.load());
    st.aborting = true;
    const auto t1 = std::chrono::steady_clock::now();
    while (!second && st.active > 0 && std::chrono::steady_clock::now() - t1 < std::chrono::seconds(3))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::fprintf(stderr, "llmq-server: stopping\n");
}

// A request's body refused from its headers alone: a chunked body (411: send Content-Length) or
// a Content-Length over `max_body` (413); code 0 when it may be read.
struct BodyRefusal {
  int code = 0;
  const char* message = nullptr;
};
static BodyRefusal body_refusal(const httplib::Request& req, size_t max_body) {
  const std::string te = req.get_header_value("Transfer-Encoding");
  if (!te.empty() && te != "identity") return {411, "chunked request bodies are not accepted: send Content-Length"};
  if (!req.has_header("Content-Length")) return {};
  const std::string cl = req.get_header_value("Content-Length");
  const bool absurd = cl.empty() || cl.size() > 18 || cl.find_first_not_of("0123456789") != std::string::npos;
  if (absurd || std::stoull(cl) > max_body) return {413, "request body too large"};
  return {};
}

// The checks before any route: shutting down (503), bodies refused by their headers (411, 413),
// the API key (401); and the error and exception handlers' OpenAI error bodies.
static void add_guards(httplib::Server& svr, ServerState& st, const std::string& api_key) {
  svr.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
    // Bodies are judged by their headers before a byte of them is read (issue 22 items 2, 13):
    // a Content-Length over the limit gets 413 at once (not after the timeout the library
    // spends draining it), a chunked body 411 (send Content-Length), and the connection closes.
    if (st.draining) {  // shutting down: finishing what runs, taking nothing new
      send_json(res, 503, ApiError(503, "the server is shutting down", "", "", "server_error").body());
      res.set_header("Connection", "close");
      st.metrics.count_request(req.path, 503);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (const BodyRefusal refused = body_refusal(req, st.max_body); refused.code) {
      send_json(res, refused.code, ApiError(refused.code, refused.message).body());
      res.set_header("Connection", "close");
      st.metrics.count_request(req.path, refused.code);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (api_key.empty() || req.path == "/health" || req.path == "/" || req.method == "OPTIONS")  // CORS preflights carry no key
      return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + api_key) return httplib::Server::HandlerResponse::Unhandled;
    send_json(res, 401, ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "", "invalid_api_key",
                                 "authentication_error").body());
    res.set_header("Connection", "close");  // the body was not read: this connection cannot carry another request
    st.metrics.count_request(req.path, 401);
    return httplib::Server::HandlerResponse::Handled;
  });
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_json(res, 500, ApiError(500, what, "", "", "server_error").body());
  });
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) send_json(res, 404, ApiError(404, "no route " + req.method + " " + req.path, "", "not_found").body());
    else if (res.status == 413) send_json(res, 413, ApiError(413, "request body too large").body());
    else if (res.status == 400)  // httplib's own: a malformed request line or header, or one over --max-header-bytes / --max-headers
      send_json(res, 400, ApiError(400, "malformed request, or a header over the server's limits").body());
  });
}

// The routes: CORS preflights, /health, the chat page, /v1/models, the completions endpoints,
// /tokenize, /detokenize and /metrics.
// A small JSON endpoint of llmq's own: 503 while the model loads, else reply(st, body) as 200;
// an ApiError or malformed JSON answers 400.
template <class Reply>
static void handle_json(const ServerState& st, const httplib::Request& req, httplib::Response& res, Reply reply) {
  if (!st.ready) return send_json(res, 503, ApiError(503, "the model is loading").body());
  try {
    send_json(res, 200, reply(st, parse_json_body(req.body)));
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const json::exception& e) {
    send_error(res, ApiError(400, std::string("malformed request: ") + e.what()));
  }
}

// /tokenize (llama.cpp's server): {"content", "add_special"?, "parse_special"?} -> {"tokens"}.
static json tokenize_reply(const ServerState& st, const json& j) {
  if (!j.is_object() || !j.contains("content") || !j["content"].is_string()) throw ApiError(400, "'content' must be a string", "content");
  const bool add_special = j.value("add_special", false), parse_special = j.value("parse_special", false);
  return {{"tokens", st.model->tokenizer->encode(j["content"].get<std::string>(), add_special, parse_special)}};
}

// /detokenize: {"tokens": [ids in the vocabulary]} -> {"content"}.
static json detokenize_reply(const ServerState& st, const json& j) {
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) throw ApiError(400, "'tokens' must be an array", "tokens");
  std::vector<int32_t> ids;
  for (const json& t : j["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= int64_t(st.model->vocab.size()))
      throw ApiError(400, "token ids must be integers in [0, vocab)", "tokens");
    ids.push_back(t.get<int32_t>());
  }
  return {{"content", st.model->tokenizer->decode(ids)}};
}

// /metrics (Prometheus text): the server's counters, then the connection guard's.
static std::string metrics_text(ServerState& st, const HttpGuardStats& h) {
  SchedulerStats s;
  if (st.ready) s = st.scheduler->stats();
  return st.metrics.render(s) +
         "# HELP llmq_http_refused_connections_total Connections answered 503 over --max-connections or --max-connections-per-ip.\n"
         "# TYPE llmq_http_refused_connections_total counter\nllmq_http_refused_connections_total " +
         std::to_string(h.refused_connections.load()) +
         "\n# HELP llmq_http_dropped_requests_total Requests dropped at --request-timeout, a stalled read or a header limit.\n"
         "# TYPE llmq_http_dropped_requests_total counter\nllmq_http_dropped_requests_total " +
         std::to_string(h.deadline_drops.load()) + "\n";
}

static void add_routes(GuardedServer& svr, ServerState& st, const std::string& cors_origin) {
  if (!cors_origin.empty()) {  // CORS: every response names the allowed origin; preflights are answered here
    svr.set_default_headers({{"Access-Control-Allow-Origin", cors_origin}});
    svr.Options(R"(.*)", [](const httplib::Request&, httplib::Response& res) {
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
      res.set_header("Access-Control-Max-Age", "86400");
      res.status = 204;
    });
  }
  svr.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    if (st.ready) send_json(res, 200, {{"status", "ok"}});
    else if (!st.load_error.empty()) send_json(res, 503, {{"status", "error"}, {"error", st.load_error}});
    else send_json(res, 503, {{"status", "loading"}});
  });
  svr.Get("/", [&](const httplib::Request&, httplib::Response& res) { res.set_content(kIndexHtml, "text/html; charset=utf-8"); });
  const auto model_json = [&st] { return json{{"id", st.model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "llmq"}}; };
  svr.Get("/v1/models", [&st, model_json](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_json()})}});
    st.metrics.count_request("/v1/models", 200);
  });
  svr.Get(R"(/v1/models/(.+))", [&st, model_json](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != st.model_id) {
      send_error(res, ApiError(404, "The model '" + std::string(req.matches[1]) + "' does not exist", "model", "model_not_found"));
      return;
    }
    send_json(res, 200, model_json());
  });
  svr.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) { handle_completion(st, req, res, false); });
  svr.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) { handle_completion(st, req, res, true); });
  svr.Post("/v1/responses", [&](const httplib::Request& req, httplib::Response& res) { handle_responses(st, req, res); });
  svr.Post("/v1/embeddings", [&](const httplib::Request& req, httplib::Response& res) { handle_embeddings(st, req, res); });
  svr.Post("/tokenize", [&](const httplib::Request& req, httplib::Response& res) { handle_json(st, req, res, tokenize_reply); });
  svr.Post("/detokenize", [&](const httplib::Request& req, httplib::Response& res) { handle_json(st, req, res, detokenize_reply); });
  svr.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(st, svr.guard_stats()), "text/plain; version=0.0.4");
  });
}

// The connection limits' flags (server/http_guard.h); --timeout is the stall of one read or write.
// max_connections and max_per_ip stay 0 unless given: main derives them from --parallel.
static void add_http_flags(CLI::App& app, HttpLimits& http) {
  http.max_connections = 0, http.max_per_ip = 0;
  app.add_option("--timeout", http.stall_s, "seconds a client may stall reading or writing before it is dropped")
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--request-timeout", http.request_deadline_s,
                 "seconds from a request's first byte until its header and body are in, in all (a slowloris client that "
                 "sends a byte at a time is dropped then)")
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--max-connections", http.max_connections,
                 "open connections at most (default 4 x (parallel + max-queue) + 16, at least 128); more are answered 503 at once");
  app.add_option("--max-connections-per-ip", http.max_per_ip,
                 "open connections from one client address at most (default: 3/4 of --max-connections)");
  app.add_option("--max-header-bytes", http.max_header_bytes, "bytes of a request's line and header fields at most (400 beyond)")
      ->check(CLI::Range(1024, 1 << 20));
  app.add_option("--max-headers", http.max_header_lines, "header fields of a request at most (400 beyond)")->check(CLI::Range(8, 10000));
}

// Every flag of llmq-server but the connection limits (add_http_flags).
struct ServerFlags {
  std::string model_path, host = "127.0.0.1", api_key, device = "cpu", template_name, kv_type = "f32", alias, cors_origin = "*";
  std::string gpu_layers = "all", pooling, mem_budget;
  int port = 8080, threads = 0, parallel = 4, tp = 1;
  int64_t ctx = 0, max_queue = 64, kv_tokens = 0, n_batch = 512, grammar_cache_mib = 64;
  double drain_s = 30;
  bool no_verify = false, no_prefix_cache = false, fit = false, parallel_given = false;
  HttpLimits http;
};

static void add_server_flags(CLI::App& app, ServerFlags& f) {
  app.add_option("model,-m,--model", f.model_path, "model file (.llmq, GGUF or a Hugging Face directory; positional or -m)")->required();
  app.add_option("--host", f.host, "address to bind (default 127.0.0.1: this machine only)");
  app.add_option("--port", f.port, "TCP port");
  app.add_option("--device", f.device, "cpu | cuda | auto (auto: the GPU when one is present)");
  app.add_option("-c,--ctx", f.ctx, "most tokens per sequence (default: the model's context, at most 4096)");
  app.add_option("--parallel", f.parallel, "most sequences generated at once (continuous batching)")
      ->each([&f](const std::string&) { f.parallel_given = true; });
  app.add_option("--max-queue", f.max_queue, "most requests waiting; more get HTTP 429");
  app.add_option("--kv-tokens", f.kv_tokens, "KV-cache size in tokens over all sequences (default: parallel x min(ctx, 2048))");
  app.add_option("-b,--batch", f.n_batch, "most tokens per forward pass");
  app.add_option("--kv-type", f.kv_type, "KV cache element type: f32, or bf16 (half the memory; attention on bf16 operands); "
                                      "--device cuda: f16 (default) or q8_0 (17/32 of f16's bytes)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "q8_0"}));
  app.add_option("--api-key", f.api_key, "require 'Authorization: Bearer KEY' (except /health)");
  app.add_option("--alias", f.alias, "the model id clients name (default: the model file's name without .llmq)");
  app.add_option("--cors-origin", f.cors_origin,
                 "Access-Control-Allow-Origin for browser apps (default *: any page may call the API, as with vLLM and "
                 "llama.cpp; an API key still applies); empty: no CORS headers");
  app.add_option("-t,--threads", f.threads, "CPU threads in all (default: all cores); with --tp they are shared by the ranks");
  app.add_option("--gpu-layers,--n-gpu-layers", f.gpu_layers,
                 "with --device cuda: the last N layers (and the output) on the GPU, the others on the CPU (partial offload); "
                 "'auto': as many as fit the GPU's free memory (or --mem); default: all");
  app.add_option("--tp", f.tp, "tensor-parallel ranks: split every layer over N ranks (CPU: rank threads in this process; --device cuda: one rank per GPU over NCCL when N GPUs are present, else N ranks on GPU 0). "
                               "Under `mpirun -np N` (one machine or several): one rank per process, --tp N; rank 0 serves HTTP, the others serve it");
  app.add_option("--chat-template", f.template_name, "chat template name, overriding the model's");
  add_http_flags(app, f.http);
  app.add_option("--drain-timeout", f.drain_s,
                 "on SIGTERM/SIGINT: seconds the running requests may take to finish (new ones get 503) before they are ended "
                 "with an error; a second signal stops at once")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_flag("--no-verify", f.no_verify, "skip tensor checksum verification at load");
  app.add_option("--pooling", f.pooling, "/v1/embeddings: how an input's hidden states are pooled: last, mean or cls (default: the model's "
                                         "pooling_type, else last)")
      ->check(CLI::IsMember({"last", "mean", "cls"}));
  app.add_option("--grammar-cache-mib", f.grammar_cache_mib,
                 "MiB of compiled grammars (response_format, grammar, forced tool calls) kept for reuse, least recently used "
                 "dropped first; 0: no cache")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  app.add_flag("--no-prefix-cache", f.no_prefix_cache,
               "compute every prompt afresh (by default, on the CPU, the KV blocks of prompt prefixes seen before are reused)");
  app.add_flag("--fit", f.fit,
               "before loading, pick the largest context (multiple of 16), then the most parallel sequences, that fit --mem, "
               "with a KV cache of parallel x ctx tokens; print the plan as JSON on stderr (--ctx / --parallel given are kept). "
               "With --device cuda the GPU's plan within --mem or the GPU's free memory (all layers on the GPU)");
  app.add_option("--mem", f.mem_budget, "memory budget for --fit, e.g. 8GiB (default: MemAvailable)");
}

// --fit: the context, parallel sequences and KV tokens that fit --mem (or the host's available
// memory, or the GPU's free memory with --device cuda), from the file's metadata and tensor
// directory only (llmq-mem infer --fit); the plan printed as JSON on stderr. Throws UsageError
// when nothing fits.
static void fit_flags(ServerFlags& f, bool gpu) {
  const double budget = !f.mem_budget.empty() ? mem::parse_size(f.mem_budget) : gpu ? double(cuda_free_bytes()) : double(mem::available_memory());
  auto file = LlmqFile::open(f.model_path, false);
  const ModelConfig c = mem::file_config(*file);
  mem::InferOptions o;
  o.ctx = f.ctx, o.parallel = f.parallel, o.server = true, o.n_batch = f.n_batch, o.threads = f.threads, o.kv_type = f.kv_type;
  o.device = gpu ? "cuda" : "cpu";
  const mem::FitResult r = mem::fit_inference(*file, c, o, budget, f.ctx > 0, f.parallel_given);
  std::fprintf(stderr, "llmq-server: fit plan: %s\n", mem::fit_json(r, budget).dump().c_str());
  if (!r.fits) throw UsageError("the model does not fit in " + cli::human_bytes(uint64_t(budget)));
  f.ctx = r.options.ctx, f.parallel = int(r.options.parallel), f.kv_tokens = r.options.kv_tokens;
}

// The loader thread's work: the model, the runner (one rank of `group` under mpirun), the chat
// template, the scheduler and the structured-output engine into st, then st.ready; the memory
// lines on stderr. Throws what loading throws.
static void load_state(ServerState& st, const ServerFlags& f, const RunnerOptions& ro, MpiComm* group, bool gpu) {
  st.model = load_model(f.model_path, !f.no_verify, ro.place);  // with -ngl N the CPU runs the first layers: load_model packs those
  // A token stands for at most its piece's bytes (SentencePiece's "▁" and byte-level BPE's
  // byte characters only lengthen the text), or one character (<unk>, <0xNN>): 4 bytes.
  for (const std::string& piece : st.model->vocab.tokens) st.max_token_bytes = std::max(st.max_token_bytes, piece.size());
  const int64_t seq_ctx = f.ctx > 0 ? f.ctx : std::min(st.model->config.context_length, kDefaultMaxCtx);
  RunnerOptions rs = ro;
  rs.ctx = seq_ctx;
  cli::join_tp_group(group, *st.model, rs);
  st.runner = cli::make_tool_runner("llmq-server", *st.model, rs);
  if (!f.template_name.empty()) st.tmpl = ChatTemplate::by_name(f.template_name);
  else if (!st.model->chat_template.empty()) st.tmpl = ChatTemplate::for_vocab(st.model->chat_template, st.model->vocab);
  SchedulerOptions so;
  so.parallel = f.parallel, so.ctx = seq_ctx, so.max_queue = f.max_queue, so.kv_tokens = f.kv_tokens, so.n_batch = f.n_batch;
  so.kv_type = ro.kv_type;  // the CPU's pools (partial offload: f32)
  // The GPU's paged attention has not yet run with shared blocks on a real device: the CPU only.
  so.prefix_cache = !f.no_prefix_cache && !gpu;
  st.scheduler = std::make_unique<Scheduler>(st.runner->batch(), so);
  st.structured = std::make_unique<StructuredOutputs>(*st.model->tokenizer, default_stop_ids(st.model->vocab), size_t(f.grammar_cache_mib) << 20);
  st.ready = true;
  const uint64_t file_bytes = st.model->file->file_size() + st.model->packed.bytes(), kv_b = st.scheduler->kv_bytes(),
                 ws_b = st.scheduler->workspace_bytes();
  std::fprintf(stderr,
               "llmq-server: %s ready on http://%s:%d (%s, parallel %d, ctx %lld, KV cache %s, tp %d, peak memory %s)\n"
               "llmq-server: memory: model file and repacked weights %s, KV cache %s, workspace %s; total %llu bytes (%s)%s\n",
               st.model_id.c_str(), f.host.c_str(), f.port, device_name(gpu ? Device::Cuda : Device::Cpu), f.parallel, (long long)so.ctx,
               cli::human_bytes(kv_b).c_str(), f.tp, cli::human_bytes(cli::peak_rss_bytes()).c_str(), cli::human_bytes(file_bytes).c_str(),
               cli::human_bytes(kv_b).c_str(), cli::human_bytes(ws_b).c_str(), (unsigned long long)(file_bytes + kv_b + ws_b),
               cli::human_bytes(file_bytes + kv_b + ws_b).c_str(),
               gpu ? " (KV cache and workspace on the GPU, the weights uploaded beside them: see the GPU memory line)" : "");
}

// Rank 0 (or the only process): listens at once, loads in the background (/health answers 503
// until the model is ready), serves until a signal in `sigs` drains it. 2 when loading failed.
static int serve_http(ServerFlags& f, const RunnerOptions& ro, MpiComm* group, bool gpu, const sigset_t& sigs) {
  auto st = std::make_shared<ServerState>();
  st->model_id = f.alias.empty() ? std::filesystem::path(f.model_path).stem().string() : f.alias;
  if (!f.pooling.empty()) st->pooling = pooling_from_name(f.pooling);
  // Defaults roomy enough for a burst through one reverse proxy (every running and queued
  // request, and as many again waiting for their 429), with a quarter kept for other addresses.
  HttpLimits& http = f.http;
  if (http.max_connections <= 0) http.max_connections = std::max(128, 4 * (f.parallel + int(f.max_queue)) + 16);
  if (http.max_per_ip <= 0) http.max_per_ip = std::max(1, http.max_connections * 3 / 4);
  GuardedServer svr(http);
  // Workers beyond max_connections answer the connections over the limits (503) at once.
  const int http_threads = http.max_connections + 16;
  svr.new_task_queue = [http_threads] { return new httplib::ThreadPool(size_t(http_threads)); };
  svr.set_payload_max_length(st->max_body + 1);
  int listen_fd = -1;
  svr.set_socket_options([&listen_fd](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);  // not SO_REUSEPORT: a port in use is an error
    listen_fd = sock;
  });
  add_guards(svr, *st, f.api_key);
  add_routes(svr, *st, f.cors_origin);
  if (!svr.bind_to_port(f.host, f.port))
    throw UsageError("cannot listen on " + f.host + ":" + std::to_string(f.port) + " (in use, or not allowed)");
  ::listen(listen_fd, SOMAXCONN);  // httplib listened with a backlog of 5: bursts of clients got resets
  std::thread loader([&] {
    try {
      load_state(*st, f, ro, group, gpu);
    } catch (const std::exception& e) {
      if (*st->stopping) return;  // a signal stopped the server while it loaded
      st->load_error = e.what();
      std::fprintf(stderr, "llmq-server: error: %s\n", e.what());
      stop_server(svr);
    }
  });
  std::thread([&svr, sigs, drain_s = f.drain_s, weak = std::weak_ptr<ServerState>(st)] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (auto state = weak.lock()) drain(*state, sigs, sig, drain_s);
    if (auto state = weak.lock()) *state->stopping = true;
    stop_server(svr);
  }).detach();
  std::fprintf(stderr, "llmq-server: listening on http://%s:%d, loading %s\n", f.host.c_str(), f.port, f.model_path.c_str());
  svr.listen_after_bind();
  loader.join();
  return st->load_error.empty() ? 0 : 2;
}

// Blocks the stop signals, checks the flags, plans (--fit), joins an MPI group under mpirun, then
// serves HTTP (rank 0) or rank 0's forward passes (the other ranks).
static int run_server(ServerFlags& f) {
  // SIGINT/SIGTERM stop the server cleanly: blocked in every thread, taken by one waiter. Blocked
  // first, before the CUDA runtime (the device pick, the GPU plan) or MPI start threads of their
  // own, which would inherit an open mask, take the signal and die of it (an H200 run's server
  // exited 143 on SIGTERM instead of draining).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  const bool gpu = pick_device(f.device) == Device::Cuda;
  if (gpu && f.kv_type != "f32" && f.kv_type != "f16" && f.kv_type != "q8_0") throw UsageError("--kv-type with --device cuda: f16 (the default) or q8_0");
  if (!gpu) kv_type_from_name(f.kv_type);  // f32 or bf16 on the CPU: the error before listening
  if (f.parallel < 1 || f.max_queue < 0) throw UsageError("--parallel must be >= 1 and --max-queue >= 0");
  if (f.fit && gpu && f.gpu_layers != "all") throw UsageError("--fit with --device cuda plans every layer on the GPU; leave --gpu-layers out");
  if (f.fit) fit_flags(f, gpu);
  mem::InferOptions lo;
  lo.ctx = f.ctx, lo.n_batch = f.n_batch, lo.parallel = f.parallel, lo.server = true, lo.kv_tokens = f.kv_tokens;
  const int64_t gpu_layers = cli::resolve_gpu_layers("llmq-server", f.gpu_layers, gpu, f.model_path, lo, f.mem_budget);
  const bool partial = gpu && gpu_layers >= 0;
  // Under mpirun: MPI initialised here, on the main thread (which finalises it when this body
  // ends, after the state below and its runner are gone), this process one rank of the job.
  const std::unique_ptr<MpiComm> group = cli::start_mpi_group(f.tp, partial);
  // Under mpirun: this process's rank of a group over processes (engine/parallel/tp_process.h), the
  // same runner on every rank, built from rank 0's sizes: the CPU's TensorParallel for one rank, or
  // a GPU rank.
  RunnerOptions ro;
  ro.place = Placement{gpu ? Device::Cuda : Device::Cpu, gpu_layers, f.tp, false, f.ctx};
  ro.threads = f.threads, ro.ctx = f.ctx, ro.n_batch = f.n_batch, ro.parallel = f.parallel, ro.kv_tokens = f.kv_tokens;
  ro.capacity = std::max<int64_t>(f.n_batch, f.parallel);  // tokens per forward pass
  ro.gpu_kv_q8 = gpu && f.kv_type == "q8_0", ro.kv_type = gpu ? KvType::F32 : kv_type_from_name(f.kv_type);
  if (group && group->rank() > 0) {  // a rank of a process group: no HTTP, rank 0's forward passes until it stops
    pthread_sigmask(SIG_UNBLOCK, &sigs, nullptr);  // a signal (mpirun ending the job) ends this rank at once
    ro.place.gpu_layers = -1;
    auto model = load_model(f.model_path, !f.no_verify, ro.place);
    cli::join_tp_group(group.get(), *model, ro);
    auto runner = cli::make_tool_runner("llmq-server", *model, ro);
    return runner->serve();  // rank 0's forward passes until it stops; only rank 0 prints
  }
  return serve_http(f, ro, group.get(), gpu, sigs);
}

int main(int argc, char** argv) {
  CLI::App app{"llmq-server: OpenAI-compatible completions over HTTP"};
  ServerFlags flags;
  add_server_flags(app, flags);
  LLMQ_CLI_PARSE(app, argc, argv);
#ifdef __GLIBC__
  // glibc gives threads up to 8 malloc arenas per core and each arena keeps the memory freed in
  // it. With 50+ HTTP threads, scripts/soak.py saw RSS climb from 89 to 110 MB in two minutes
  // (and on) while the live heap stayed under 30 MB (heaptrack). Two arenas, and a fixed mmap
  // threshold (request bodies over 128 KiB go back to the system when freed, instead of raising
  // the threshold and staying in an arena), keep RSS flat. Allocation is not on the hot path.
  mallopt(M_ARENA_MAX, 2);
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#endif
  return cli::run_guarded("llmq-server", [&] { return run_server(flags); });
}
