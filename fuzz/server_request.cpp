// Fuzz target server_request: llmq-server's request parsing (server/api.*:
// parse_completion_request, parse_embedding_request) on arbitrary bodies, as /v1/completions,
// /v1/chat/completions or /v1/embeddings.
//
// Input layout: byte 0 bit 0 picks the endpoint (1: chat), bit 1 /v1/responses (its body is
// translated to a chat body first, server/responses.h), bit 2 /v1/embeddings; the rest is the body.
// Checked: only ApiError is thrown (status 400, 404 or 413), and its JSON body serializes
// (the server sends it); an accepted request has values in their documented ranges, and a
// chat request's messages apply to the ChatML template (as the server then does).
#include <cstdint>
#include <string>

#include "base/error.h"
#include "text/chat.h"
#include "fuzz/fuzz_common.h"
#include "server/api.h"
#include "server/responses.h"

using namespace llmq;

namespace {

// An embeddings body: only ApiError 400/404/413; an accepted one has 1..kMaxEmbeddingInputs
// non-empty inputs of one kind, token ids from 0.
int embeddings(const std::string& body) {
  EmbeddingRequest r;
  try {
    r = parse_embedding_request(body, "smollm2", 576, 1u << 16);
  } catch (const ApiError& e) {
    if (e.status != 400 && e.status != 404 && e.status != 413) fuzz::fail("unexpected status " + std::to_string(e.status));
    (void)e.body().dump();
    return 0;
  }
  if (r.size() < 1 || r.size() > kMaxEmbeddingInputs) fuzz::fail("input count out of range");
  if (!r.texts.empty() && !r.ids.empty()) fuzz::fail("text and token-id inputs mixed");
  for (const auto& t : r.texts)
    if (t.empty()) fuzz::fail("an empty text input");
  for (const auto& ids : r.ids) {
    if (ids.empty()) fuzz::fail("an empty token-id input");
    for (int32_t id : ids)
      if (id < 0) fuzz::fail("negative token id");
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool responses = data[0] & 2u;  // a /v1/responses body, translated to chat first
  const bool chat = (data[0] & 1u) || responses;
  std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  constexpr int64_t kCtx = 2048;
  if (data[0] & 4u) return embeddings(body);
  CompletionRequest r;
  try {
    if (responses) body = responses_to_chat(parse_json_body(body)).dump();
    r = parse_completion_request(body, chat, "smollm2", kCtx, 1u << 16);
  } catch (const ApiError& e) {
    if (e.status != 400 && e.status != 404 && e.status != 413) fuzz::fail("unexpected status " + std::to_string(e.status));
    (void)e.body().dump();  // what the server sends: must not throw (e.g. on invalid UTF-8)
    return 0;
  }
  if (r.chat != chat) fuzz::fail("chat flag lost");
  if (r.max_tokens != -1 && (r.max_tokens < (chat ? 1 : 0) || r.max_tokens > kCtx)) fuzz::fail("max_tokens out of range");
  if (r.max_tokens == 0 && !r.echo) fuzz::fail("max_tokens 0 without echo");
  if (r.top_logprobs < -1 || r.top_logprobs > 20) fuzz::fail("top_logprobs out of range");
  if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2)) fuzz::fail("temperature out of range");
  if (!(r.sampling.top_p >= 0 && r.sampling.top_p <= 1)) fuzz::fail("top_p out of range");
  if (r.stop.size() > 4) fuzz::fail("more than 4 stop strings");
  if (r.n < 1 || int64_t(r.n) * int64_t(r.prompts()) > kMaxChoices) fuzz::fail("more choices than kMaxChoices");
  for (size_t i = 0; i < r.prompts(); ++i) (void)r.with_prompt(i);  // every prompt of a batch is there
  if (chat) {
    if (r.messages.empty()) fuzz::fail("a chat request without messages");
    // Roles are valid: ChatML renders them, but for tool turns (role tool, assistant tool_calls),
    // which only templates with a tools section render (the server answers 400 there).
    bool tool_turns = !r.tools.empty();
    for (const ChatMessage& m : r.messages) tool_turns = tool_turns || m.role == "tool" || !m.tool_calls.empty();
    try {
      (void)ChatTemplate::by_name("chatml").apply_segments(r.messages, true);
    } catch (const UsageError&) {
      if (!tool_turns) throw;
    }
  } else {
    for (int32_t id : r.prompt_ids)
      if (id < 0) fuzz::fail("negative prompt token id");
  }
  return 0;
}
