#include "server/responses.h"

#include "server/api.h"

namespace llmq {

namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& msg, const std::string& param) { throw ApiError(400, msg, param); }

// A message item's content: a string, or parts of type input_text / output_text.
std::string item_text(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad(where + ".content must be a string or an array of text parts", where + ".content");
  std::string text;
  for (const json& part : content) {
    const std::string type = part.is_object() ? part.value("type", "") : "";
    if ((type != "input_text" && type != "output_text") || !part.contains("text") || !part["text"].is_string())
      bad(where + ".content parts must be input_text or output_text (images and files are not supported)", where + ".content");
    text += part["text"].get<std::string>();
  }
  return text;
}

// One input item appended to the chat messages (consecutive function_call items become one
// assistant message with several tool_calls).
void add_item(const json& item, size_t i, json& messages) {
  const std::string where = "input[" + std::to_string(i) + "]";
  if (!item.is_object()) bad(where + " must be an object", where);
  const std::string type = item.value("type", item.contains("role") ? "message" : "");
  if (type == "message") {
    const std::string role = item.value("role", "");
    if (role != "user" && role != "assistant" && role != "system" && role != "developer")
      bad(where + ".role must be user, assistant, system or developer", where + ".role");
    if (!item.contains("content")) bad(where + " has no content", where + ".content");
    messages.push_back({{"role", role}, {"content", item_text(item["content"], where)}});
  } else if (type == "function_call") {
    for (const char* k : {"call_id", "name", "arguments"})
      if (!item.contains(k) || !item[k].is_string()) bad(where + "." + k + " must be a string", where + "." + k);
    json call = {{"id", item["call_id"]}, {"type", "function"}, {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
    if (!messages.empty() && messages.back().value("role", "") == "assistant" && messages.back().contains("tool_calls"))
      messages.back()["tool_calls"].push_back(call);
    else
      messages.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}});
  } else if (type == "function_call_output") {
    if (!item.contains("call_id") || !item["call_id"].is_string()) bad(where + ".call_id must be a string", where + ".call_id");
    const json& out = item.contains("output") ? item["output"] : json();
    messages.push_back({{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", out.is_string() ? out.get<std::string>() : out.dump()}});
  } else {
    bad(where + ".type '" + type + "' is not supported (message, function_call, function_call_output)", where + ".type");
  }
}

// Responses tools ({"type": "function", "name", ...}) and tool_choice in their chat forms.
void add_tools(const json& body, json& chat) {
  if (body.contains("tools") && !body["tools"].is_null()) {
    if (!body["tools"].is_array()) bad("'tools' must be an array", "tools");
    json tools = json::array();
    for (const json& t : body["tools"]) {
      if (!t.is_object() || t.value("type", "") != "function" || !t.contains("name"))
        bad("only function tools are supported ({\"type\": \"function\", \"name\", \"parameters\"})", "tools");
      json f = {{"name", t["name"]}};
      for (const char* k : {"description", "parameters", "strict"})
        if (t.contains(k) && !t[k].is_null()) f[k] = t[k];
      tools.push_back({{"type", "function"}, {"function", f}});
    }
    if (!tools.empty()) chat["tools"] = tools;
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const json& c = body["tool_choice"];
    if (c.is_object() && c.value("type", "") == "function" && c.contains("name"))
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", c["name"]}}}};
    else
      chat["tool_choice"] = c;
  }
}

// text.format -> response_format.
void add_format(const json& body, json& chat) {
  if (!body.contains("text") || !body["text"].is_object() || !body["text"].contains("format")) return;
  const json& f = body["text"]["format"];
  if (!f.is_object() || !f.contains("type")) bad("'text.format' must be an object with a 'type'", "text.format");
  if (f["type"] == "json_schema") {
    json js = {{"name", f.value("name", "schema")}};
    if (f.contains("schema")) js["schema"] = f["schema"];
    if (f.contains("strict")) js["strict"] = f["strict"];
    chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
  } else {
    chat["response_format"] = {{"type", f["type"]}};
  }
}

}  // namespace

static json chat_of(const json& body);  // responses_to_chat without the type-error guard

json responses_to_chat(const json& body) {
  try {
    return chat_of(body);
  } catch (const json::exception& e) {  // a value of the wrong type somewhere
    bad(std::string("invalid request: ") + e.what(), "");
  }
}

static json chat_of(const json& body) {
  if (!body.is_object()) bad("the request body must be a JSON object", "");
  if (body.contains("previous_response_id") && !body["previous_response_id"].is_null())
    bad("previous_response_id is not supported: responses are not stored; send the whole conversation as input",
        "previous_response_id");
  json chat = json::object();
  json messages = json::array();
  if (body.contains("instructions") && !body["instructions"].is_null()) {
    if (!body["instructions"].is_string()) bad("'instructions' must be a string", "instructions");
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
  }
  if (!body.contains("input")) bad("'input' is required", "input");
  const json& input = body["input"];
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
  } else if (input.is_array() && !input.empty()) {
    for (size_t i = 0; i < input.size(); ++i) add_item(input[i], i, messages);
  } else {
    bad("'input' must be a string or a non-empty array of items", "input");
  }
  chat["messages"] = messages;
  add_tools(body, chat);
  add_format(body, chat);
  if (body.contains("max_output_tokens") && !body["max_output_tokens"].is_null()) chat["max_tokens"] = body["max_output_tokens"];
  for (const char* k : {"model", "temperature", "top_p", "stream", "seed"})
    if (body.contains(k) && !body[k].is_null()) chat[k] = body[k];
  return chat;
}

json function_call_item(const json& chat_call) {
  const std::string call_id = chat_call.value("id", "");
  return {{"type", "function_call"},
          {"id", "fc_" + call_id},
          {"call_id", call_id},
          {"name", chat_call["function"]["name"]},
          {"arguments", chat_call["function"]["arguments"]},
          {"status", "completed"}};
}

json responses_usage(const json& u) {
  const int64_t in = u.value("prompt_tokens", int64_t(0)), out = u.value("completion_tokens", int64_t(0));
  const int64_t cached = u.contains("prompt_tokens_details") ? u["prompt_tokens_details"].value("cached_tokens", int64_t(0)) : 0;
  return {{"input_tokens", in},
          {"input_tokens_details", {{"cached_tokens", cached}}},
          {"output_tokens", out},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", in + out}};
}

json response_object(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                     const json& calls, const std::string& finish, const json& usage, const json& request) {
  json output = json::array();
  if (!text.empty() || calls.empty())
    output.push_back({{"type", "message"},
                      {"id", "msg_" + id.substr(id.find('_') + 1)},
                      {"status", finish == "length" ? "incomplete" : "completed"},
                      {"role", "assistant"},
                      {"content", json::array({{{"type", "output_text"}, {"text", text}, {"annotations", json::array()}}})}});
  for (const json& c : calls) output.push_back(function_call_item(c));
  const bool cut = finish == "length" || finish == "cancelled";
  json r = {{"id", id},
            {"object", "response"},
            {"created_at", created},
            {"status", cut ? "incomplete" : "completed"},
            {"incomplete_details", cut ? json{{"reason", finish == "length" ? "max_output_tokens" : "cancelled"}} : json(nullptr)},
            {"error", nullptr},
            {"model", model},
            {"output", output},
            {"parallel_tool_calls", true},
            {"tool_choice", request.value("tool_choice", json("auto"))},
            {"tools", request.value("tools", json::array())},
            {"text", request.value("text", json{{"format", {{"type", "text"}}}})},
            {"usage", usage.is_null() ? json(nullptr) : responses_usage(usage)}};
  for (const char* k : {"instructions", "temperature", "top_p", "max_output_tokens"})
    r[k] = request.contains(k) ? request[k] : json(nullptr);
  return r;
}

}  // namespace llmq
