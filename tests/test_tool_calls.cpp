// Tool calls in model output (server/tool_calls.h): the Hermes <tool_call> blocks and the bare
// call object, what stays content, and how much of a streamed reply may go out before the end.
#include <catch2/catch.hpp>

#include "server/tool_calls.h"

using namespace llmq;

TEST_CASE("Hermes <tool_call> blocks become OpenAI tool_calls", "[server][tools]") {
  const std::vector<std::string> tools{"get_weather", "add"};
  const auto p = parse_tool_calls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
      "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
      "x", tools);
  CHECK(p.content == "Let me check.");
  REQUIRE(p.calls.size() == 2);
  CHECK(p.calls[0]["id"] == "call_x_0");
  CHECK(p.calls[0]["type"] == "function");
  CHECK(p.calls[0]["function"]["name"] == "get_weather");
  CHECK(p.calls[0]["function"]["arguments"] == "{\"city\":\"Paris\"}");
  CHECK(p.calls[1]["function"]["arguments"] == "{\"a\":1}");  // arguments given as JSON text
  // An unclosed last block (generation stopped) still counts; a malformed one stays text.
  CHECK(parse_tool_calls("<tool_call>{\"name\": \"add\", \"arguments\": {}}", "y", tools).calls.size() == 1);
  const auto bad = parse_tool_calls("a <tool_call>{not json}</tool_call> b", "z", tools);
  CHECK(bad.calls.empty());
  CHECK(bad.content == "a <tool_call>{not json}</tool_call> b");
  // The bare object counts only as the whole reply and for a tool of the request.
  CHECK(parse_tool_calls(" {\"name\": \"add\", \"arguments\": {\"a\": 2}}\n", "w", tools).calls.size() == 1);
  CHECK(parse_tool_calls("{\"name\": \"rm_rf\", \"arguments\": {}}", "w", tools).calls.empty());
  CHECK(parse_tool_calls("{\"name\": \"add\"} and more", "w", tools).calls.empty());
  // Llama 3.x: "parameters", maybe after <|python_tag|>; Mistral: an array, maybe after [TOOL_CALLS].
  const auto llama = parse_tool_calls("<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}", "l", tools);
  REQUIRE(llama.calls.size() == 1);
  CHECK(llama.calls[0]["function"]["arguments"] == "{\"a\":1}");
  const auto mistral = parse_tool_calls(
      "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {}}]", "m", tools);
  REQUIRE(mistral.calls.size() == 2);
  CHECK(mistral.calls[1]["id"] == "call_m_1");
  CHECK(parse_tool_calls("[{\"name\": \"add\", \"arguments\": {}}]", "m", tools).calls.size() == 1);
  CHECK(parse_tool_calls("[{\"name\": \"add\", \"arguments\": {}}, {\"name\": \"nope\"}]", "m", tools).calls.empty());
  CHECK(parse_tool_calls("[1, 2, 3]", "m", tools).content == "[1, 2, 3]");
}

TEST_CASE("a streamed reply is held from a possible <tool_call> on", "[server][tools]") {
  CHECK(tool_call_safe_prefix("Hello there") == 11);
  CHECK(tool_call_safe_prefix("Hello <tool") == 6);
  CHECK(tool_call_safe_prefix("Hello <") == 6);
  CHECK(tool_call_safe_prefix("Hi <tool_call>{") == 3);
  CHECK(tool_call_safe_prefix("  {\"name\"") == 0);  // may be a bare call
  CHECK(tool_call_safe_prefix("[TOOL_") == 0);
  CHECK(tool_call_safe_prefix("<|python") == 0);
  CHECK(tool_call_safe_prefix("<|") == 0);    // may become <|python_tag|>
  CHECK(tool_call_safe_prefix("<|im") == 4);  // cannot
  CHECK(tool_call_safe_prefix("Sure, [1]") == 9);
  CHECK(tool_names(R"([{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"b"}}])") ==
        std::vector<std::string>{"a", "b"});
}
