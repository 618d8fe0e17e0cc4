// Tool calls in a model's output, for /v1/chat/completions with `tools`: the Hermes format that
// Qwen2.5/Qwen3, Hermes and many fine-tunes are trained on (their chat templates ask for it):
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
// one block per call, anywhere in the reply. A reply that is only calls may also come as
//   {"name": "get_weather", "parameters": {...}}        Llama 3.1/3.2 (after <|python_tag|>)
//   [TOOL_CALLS][{"name": ..., "arguments": {...}}]    Mistral ([TOOL_CALLS] is a control token,
//                                                      so often only the array reaches the text)
// or as the bare Hermes object (small models drop the tags): such a whole-reply form counts when
// every call names one of the request's tools.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/structured.h"

namespace llmq {

/// A reply split into its text and its calls.
struct ParsedReply {
  std::string content;  ///< the text outside the <tool_call> blocks, trimmed of surrounding white space
  /// OpenAI's tool_calls: [{"id": "call_<prefix>_<i>", "type": "function",
  /// "function": {"name", "arguments": JSON text}}]; empty array when there are none.
  nlohmann::json calls = nlohmann::json::array();
};

/// Parses the Hermes <tool_call> blocks of `text`. A block whose body is not a JSON object with
/// a string "name" (and "arguments" an object, or absent) stays in the content as text; a last
/// block without its closing tag is taken to the end of the text (generation stopped there).
/// Call ids are "call_" + id_prefix + "_" + index. `tools`: the names of the request's tools
/// (for the bare-object form).
ParsedReply parse_tool_calls(const std::string& text, const std::string& id_prefix, const std::vector<std::string>& tools);

/// How many leading bytes of a reply streamed so far can be sent as content now: everything
/// before the first "<tool_call>", and before a trailing partial "<tool_call" (which may yet
/// become one); nothing while the reply so far (white space skipped) starts with "{", "[" or a
/// prefix of "[TOOL_CALLS]" or "<|python_tag|>" (it may be a whole-reply call). The rest is held
/// until the reply ends.
size_t tool_call_safe_prefix(const std::string& text);

/// The function names of a request's `tools` (JSON array text, as CompletionRequest::tools).
std::vector<std::string> tool_names(const std::string& tools_json);

/// How a model writes a call, read off its chat template's text: Hermes tags (the default),
/// Llama 3's bare {"name", "parameters"} object (a template that mentions <|python_tag|> or
/// asks for "parameters" without <tool_call>), or Mistral's [TOOL_CALLS] array.
enum class ToolSyntax { Hermes, Llama3, Mistral };
ToolSyntax tool_syntax(const std::string& chat_template);

/// tool_choice "required" (name empty: any of the tools) or a named function: the output format
/// that makes the reply exactly one call, written as `syntax` writes it, its arguments following
/// the tool's `parameters` schema (any object when it has none). Throws UsageError when `name`
/// is not one of the tools.
OutputFormat forced_tool_call(const std::string& tools_json, const std::string& name, ToolSyntax syntax);

}  // namespace llmq
