#include "server/tool_calls.h"

#include <algorithm>

#include "base/error.h"

namespace llmq {

namespace {

constexpr const char* kOpen = "<tool_call>";
constexpr const char* kClose = "</tool_call>";

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// The call a JSON object spells ({"name", "arguments" or Llama's "parameters"}), or null.
nlohmann::json call_of_json(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return nullptr;
  const char* key = j.contains("arguments") ? "arguments" : "parameters";
  nlohmann::json args = j.contains(key) ? j[key] : nlohmann::json::object();
  if (args.is_string()) args = nlohmann::json::parse(args.get<std::string>(), nullptr, false);
  if (args.is_discarded() || !args.is_object()) return nullptr;
  return {{"type", "function"}, {"function", {{"name", j["name"]}, {"arguments", args.dump()}}}};
}

nlohmann::json call_of(const std::string& body) {
  const auto j = nlohmann::json::parse(body, nullptr, false);
  return j.is_discarded() ? nlohmann::json(nullptr) : call_of_json(j);
}

// A whole reply that is only calls: one object (Llama 3.x, bare Hermes) or an array of them
// (Mistral), after an optional "[TOOL_CALLS]" or "<|python_tag|>"; each must name a tool of the
// request. Empty array when the reply is not of that form.
nlohmann::json whole_reply_calls(std::string text, const std::vector<std::string>& tools) {
  for (const char* tag : {"[TOOL_CALLS]", "<|python_tag|>"})
    if (text.rfind(tag, 0) == 0) text = trim(text.substr(std::string(tag).size()));
  if (text.empty() || (text[0] != '{' && text[0] != '[')) return nlohmann::json::array();
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return nlohmann::json::array();
  if (j.is_object()) j = nlohmann::json::array({j});
  nlohmann::json calls = nlohmann::json::array();
  for (const auto& c : j) {
    nlohmann::json call = call_of_json(c);
    if (call.is_null() || std::count(tools.begin(), tools.end(), call["function"]["name"].get<std::string>()) == 0)
      return nlohmann::json::array();
    calls.push_back(std::move(call));
  }
  return calls;
}

}  // namespace

ParsedReply parse_tool_calls(const std::string& text, const std::string& id_prefix, const std::vector<std::string>& tools) {
  ParsedReply r;
  r.calls = whole_reply_calls(trim(text), tools);
  for (size_t i = 0; i < r.calls.size(); ++i) r.calls[i]["id"] = "call_" + id_prefix + "_" + std::to_string(i);
  if (!r.calls.empty()) return r;
  std::string content;
  const std::string open = kOpen, close = kClose;
  size_t pos = 0;
  for (;;) {
    const size_t a = text.find(open, pos);
    if (a == std::string::npos) break;
    const size_t body = a + open.size();
    const size_t b = text.find(close, body);
    const size_t end = b == std::string::npos ? text.size() : b + close.size();
    nlohmann::json call = call_of(text.substr(body, (b == std::string::npos ? text.size() : b) - body));
    content += text.substr(pos, a - pos);
    if (call.is_null()) {
      content += text.substr(a, end - a);
    } else {
      call["id"] = "call_" + id_prefix + "_" + std::to_string(r.calls.size());
      r.calls.push_back(std::move(call));
    }
    pos = end;
  }
  content += text.substr(std::min(pos, text.size()));
  r.content = trim(content);
  return r;
}

std::vector<std::string> tool_names(const std::string& tools_json) {
  std::vector<std::string> names;
  const auto j = nlohmann::json::parse(tools_json, nullptr, false);
  if (j.is_array())
    for (const auto& t : j)
      if (t.is_object() && t.contains("function") && t["function"].is_object() && t["function"].contains("name") &&
          t["function"]["name"].is_string())
        names.push_back(t["function"]["name"].get<std::string>());
  return names;
}

size_t tool_call_safe_prefix(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos) {
    const std::string head = text.substr(first, 16);
    if (head[0] == '{' || head[0] == '[') return 0;
    for (const std::string tag : {"[TOOL_CALLS]", "<|python_tag|>"})
      if (tag.compare(0, std::min(tag.size(), head.size()), head, 0, std::min(tag.size(), head.size())) == 0) return 0;
  }
  const std::string open = kOpen;
  const size_t a = text.find(open);
  if (a != std::string::npos) return a;
  for (size_t k = std::min(open.size() - 1, text.size()); k > 0; --k)  // a trailing "<", "<t", ... "<tool_call"
    if (text.compare(text.size() - k, k, open, 0, k) == 0) return text.size() - k;
  return text.size();
}

ToolSyntax tool_syntax(const std::string& chat_template) {
  if (chat_template.find("[TOOL_CALLS]") != std::string::npos) return ToolSyntax::Mistral;
  if (chat_template.find("<tool_call>") != std::string::npos) return ToolSyntax::Hermes;
  if (chat_template.find("<|python_tag|>") != std::string::npos || chat_template.find("\"parameters\"") != std::string::npos)
    return ToolSyntax::Llama3;
  return ToolSyntax::Hermes;
}

OutputFormat forced_tool_call(const std::string& tools_json, const std::string& name, ToolSyntax syntax) {
  const char* args = syntax == ToolSyntax::Llama3 ? "parameters" : "arguments";
  nlohmann::ordered_json any_of = nlohmann::ordered_json::array();
  for (const auto& t : nlohmann::ordered_json::parse(tools_json)) {
    const auto& f = t["function"];
    if (!name.empty() && f["name"] != name) continue;
    nlohmann::ordered_json params = f.contains("parameters") ? f["parameters"] : nlohmann::ordered_json{{"type", "object"}};
    any_of.push_back({{"type", "object"},
                      {"properties", {{"name", {{"const", f["name"]}}}, {args, params}}},
                      {"required", {"name", args}},
                      {"additionalProperties", false}});
  }
  if (any_of.empty()) throw UsageError("tool_choice names the function '" + name + "', which is not among the tools");
  OutputFormat out;
  out.kind = OutputFormat::Kind::JsonSchema;
  out.spec = any_of.size() == 1 ? any_of[0].dump() : nlohmann::ordered_json{{"anyOf", any_of}}.dump();
  if (syntax == ToolSyntax::Hermes) out.prefix = "<tool_call>\n", out.suffix = "\n</tool_call>";
  if (syntax == ToolSyntax::Mistral) out.prefix = "[TOOL_CALLS][", out.suffix = "]";
  return out;
}

}  // namespace llmq
