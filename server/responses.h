// OpenAI's Responses API (POST /v1/responses; OpenAI API reference, "Responses"), served by the
// chat machinery: a request is translated into a Chat Completions request (instructions and
// input items become messages, tools and text.format their chat forms), generated as one, and
// its reply written back as a Response object (output items: a message with output_text, and
// function_call items) or as Responses streaming events (response.created ... response.completed).
// Not kept: previous_response_id and store (each request stands alone: a 400 for the first).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace llmq {

/// The Chat Completions body for a Responses request `body` (a parsed JSON object):
/// instructions -> a system message; input (a string, or items: messages with string or
/// input_text/output_text content, function_call, function_call_output) -> messages;
/// tools [{"type": "function", "name", "description", "parameters"}] and tool_choice -> their
/// chat forms; max_output_tokens -> max_tokens; text.format -> response_format; temperature,
/// top_p, stream, seed, model as they are. Throws ApiError 400 naming the field for anything
/// malformed or unsupported (previous_response_id, other item or tool types).
nlohmann::json responses_to_chat(const nlohmann::json& body);

/// A Response object: `id` ("resp_..."), the reply `text` and its parsed tool `calls` (chat
/// form: [{"id", "type", "function": {"name", "arguments"}}]), finish ("stop", "length",
/// "tool_calls", "cancelled"), token counts, and the request (its tools, tool_choice,
/// instructions, temperature, top_p, max_output_tokens are echoed as OpenAI does).
nlohmann::json response_object(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                               const nlohmann::json& calls, const std::string& finish, const nlohmann::json& usage,
                               const nlohmann::json& request);

/// The output item of a function call in chat form (Responses: {"type": "function_call", "id",
/// "call_id", "name", "arguments", "status"}).
nlohmann::json function_call_item(const nlohmann::json& chat_call);

/// Responses usage from chat usage: input_tokens, output_tokens, total_tokens and details.
nlohmann::json responses_usage(const nlohmann::json& chat_usage);

}  // namespace llmq
