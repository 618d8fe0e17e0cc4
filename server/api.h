// The OpenAI-compatible request side of llmq-server: parsing and validating JSON bodies of
// /v1/completions and /v1/chat/completions (OpenAI API reference, "Completions" and "Chat").
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "server/structured.h"
#include "text/chat.h"

namespace llmq {

/// A request the server refuses: HTTP status and OpenAI's error object fields.
struct ApiError : std::runtime_error {
  ApiError(int status_, std::string message, std::string param_ = "", std::string code_ = "",
           std::string type_ = "invalid_request_error")
      : std::runtime_error(message), status(status_), param(std::move(param_)), code(std::move(code_)), type(std::move(type_)) {}
  int status;
  std::string param, code, type;
  /// {"error": {"message", "type", "param", "code"}}
  nlohmann::json body() const;
};

/// Most choices (prompts × n) one request may ask for.
inline constexpr int kMaxChoices = 16;

struct CompletionRequest {
  bool chat = false;
  std::string model;
  std::string prompt;                 ///< completions: prompt text
  std::vector<int32_t> prompt_ids;    ///< completions: prompt given as token ids
  /// completions: a batch of prompts beyond the first (`prompt` as a list); the reply has one
  /// choice per prompt and sample, prompt i's sample k at index i · n + k
  std::vector<std::string> more_prompts;
  std::vector<std::vector<int32_t>> more_prompt_ids;
  int n = 1;                          ///< samples per prompt (OpenAI `n`)
  std::vector<ChatMessage> messages;  ///< chat
  int64_t max_tokens = -1;            ///< -1: not given; 0 (completions with echo): the prompt only
  SamplerParams sampling;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
  bool echo = false;                  ///< completions: the prompt text goes in front of the reply
  std::string suffix;                 ///< completions: text after the gap (fill-in-the-middle); empty: none
  int top_logprobs = -1;              ///< -1: no logprobs
  /// chat: the request's `tools` as a JSON array text (empty: none), checked to be OpenAI's
  /// [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
  std::string tools;
  bool tool_choice_none = false;      ///< tool_choice "none": the reply is not parsed for calls
  bool tool_choice_forced = false;    ///< tool_choice "required" or a named function: the reply is one call
  std::string tool_choice_name;       ///< the named function (empty: any of the tools)
  /// `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  /// "schema", "strict"}} (OpenAI), or `grammar` (GBNF text, as llama.cpp's server takes it)
  OutputFormat format;

  /// Prompts in the request (1 for chat).
  size_t prompts() const { return 1 + more_prompts.size() + more_prompt_ids.size(); }
  /// The request for prompt i alone (i < prompts()): a completions request with that prompt.
  CompletionRequest with_prompt(size_t i) const;
};

/// Most nesting levels of arrays and objects a request body may have. A valid request needs 4
/// (chat content parts); a 1 MiB body of "[[[[..." would otherwise build a million nested
/// values (~1 GB of allocations across concurrent requests, freed memory the allocator keeps).
inline constexpr int kMaxJsonDepth = 32;

/// Parses a request body as JSON. Throws ApiError 400 for malformed JSON, numbers out of
/// range (1e999) and nesting deeper than kMaxJsonDepth (checked while parsing, before the
/// deep values are built).
nlohmann::json parse_json_body(const std::string& body);

/// Parses and validates a request body. `model_id` is the served model's id (a different
/// `model` is a 404); max_tokens is clamped to `ctx` (the room the prompt leaves is taken later);
/// `max_body` the body size. Chat messages may be
/// system/developer, user, assistant (with `tool_calls`, content then optional) or tool (with
/// `tool_call_id`); `tools` and `tool_choice` "auto", "none", "required" or a named function (the
/// last two make the reply one call, by constrained decoding). Throws ApiError (400 malformed JSON, wrong
/// types or ranges, more than kMaxChoices choices; 404 unknown model; 413 body too large).
CompletionRequest parse_completion_request(const std::string& body, bool chat, const std::string& model_id, int64_t ctx,
                                           size_t max_body);

/// Most inputs one /v1/embeddings request may hold (OpenAI's limit).
inline constexpr size_t kMaxEmbeddingInputs = 2048;

/// A POST /v1/embeddings body (OpenAI API reference, "Embeddings").
struct EmbeddingRequest {
  /// The inputs, each text or token ids (`input`: a string, an array of token ids, or an array
  /// of either kind, at most kMaxEmbeddingInputs)
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;  ///< when the inputs are token ids (then texts is empty)
  bool base64 = false;  ///< `encoding_format` "base64": each vector as the base64 of its little-endian float32 bytes
  size_t size() const { return texts.empty() ? ids.size() : texts.size(); }
};

/// Parses and validates an embeddings body: `model` as parse_completion_request (404 when it is
/// not the served one); `encoding_format` "float" or "base64"; `dimensions`, if given, must be
/// the model's `dim` (a decoder's hidden state is not a Matryoshka embedding: it is not cut);
/// `user` is accepted. Throws ApiError (400 malformed or empty inputs, 404, 413 body too large).
EmbeddingRequest parse_embedding_request(const std::string& body, const std::string& model_id, int64_t dim, size_t max_body);

}  // namespace llmq
