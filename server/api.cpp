#include "server/api.h"

#include <cmath>
#include <random>

namespace llmq {

using nlohmann::json;

json ApiError::body() const {
  // The message may quote the request's raw bytes (json::parse_error's "last read: ..."), which
  // need not be UTF-8, and json::dump() throws on invalid UTF-8 (the server then had no error
  // body to send; found by fuzz/server_request). Replace invalid bytes by U+FFFD.
  const std::string message =
      json::parse(json(what()).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}};
}

namespace {

[[noreturn]] void bad(const std::string& msg, const std::string& param) { throw ApiError(400, msg, param); }

double number(const json& j, const char* key, double lo, double hi) {
  const json& v = j.at(key);
  if (!v.is_number()) bad(std::string("'") + key + "' must be a number", key);
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad(std::string("'") + key + "' must be between " + json(lo).dump() + " and " + json(hi).dump(), key);
  return x;
}

int64_t integer(const json& j, const char* key, int64_t lo, int64_t hi) {
  const json& v = j.at(key);
  if (!v.is_number_integer()) bad(std::string("'") + key + "' must be an integer", key);
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  if (x < lo || x > hi) bad(std::string("'") + key + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi), key);
  return x;
}

bool has(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

std::string content_text(const json& c, size_t i) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {  // [{"type": "text", "text": "..."}]
    std::string out;
    for (const json& part : c) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        bad("only text content parts are supported", param);
      out += part["text"].get<std::string>();
    }
    return out;
  }
  bad("'content' must be a string or an array of text parts", param);
}

// One chat message (see parse_completion_request).
ChatMessage parse_message(const json& m, size_t i) {
  const std::string where = "messages[" + std::to_string(i) + "]";
  if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
    bad("each message needs a string 'role' and a 'content'", where);
  std::string role = m["role"].get<std::string>();
  if (role == "developer") role = "system";
  if (role != "system" && role != "user" && role != "assistant" && role != "tool")
    bad("unsupported role '" + role + "'", where + ".role");
  const bool calls = role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null();
  if (!m.contains("content") && !calls) bad("each message needs a string 'role' and a 'content'", where);
  ChatMessage msg{role, !m.contains("content") || m["content"].is_null() ? "" : content_text(m["content"], i)};
  if (calls) {
    const json& tc = m["tool_calls"];
    if (!tc.is_array()) bad("'tool_calls' must be an array", where + ".tool_calls");
    for (const json& c : tc)
      if (!c.is_object() || !c.contains("function") || !c["function"].is_object() || !c["function"].contains("name") ||
          !c["function"]["name"].is_string())
        bad("each tool call needs a 'function' with a string 'name'", where + ".tool_calls");
    msg.tool_calls = tc.dump();
  }
  if (role == "tool") {
    if (m.contains("tool_call_id") && !m["tool_call_id"].is_string()) bad("'tool_call_id' must be a string", where + ".tool_call_id");
    if (m.contains("tool_call_id")) msg.tool_call_id = m["tool_call_id"].get<std::string>();
  }
  return msg;
}

// /v1/completions' `prompt`: a string, token ids, or a list of either (a batch: one choice per
// prompt and n).
// A JSON array of token ids (`param`: the field, for the message).
std::vector<int32_t> token_ids(const json& a, const std::string& param) {
  std::vector<int32_t> ids;
  for (const json& t : a) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
      bad("'" + param + "' token arrays must hold token ids (integers from 0)", param);
    ids.push_back(t.get<int32_t>());
  }
  return ids;
}

void parse_prompts(const json& p, CompletionRequest& r) {
  auto ids_of = [](const json& a) { return token_ids(a, "prompt"); };
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    r.prompt_ids = ids_of(p);
  } else if (p.is_array() && !p.empty() && p.size() <= size_t(kMaxChoices) && p[0].is_string()) {
    for (const json& x : p)
      if (!x.is_string()) bad("a list of prompts must hold only strings (or only token arrays)", "prompt");
    r.prompt = p[0].get<std::string>();
    for (size_t i = 1; i < p.size(); ++i) r.more_prompts.push_back(p[i].get<std::string>());
  } else if (p.is_array() && !p.empty() && p.size() <= size_t(kMaxChoices) && p[0].is_array()) {
    for (const json& x : p)
      if (!x.is_array() || x.empty()) bad("a list of token arrays must hold only non-empty arrays of token ids", "prompt");
    r.prompt_ids = ids_of(p[0]);
    for (size_t i = 1; i < p.size(); ++i) r.more_prompt_ids.push_back(ids_of(p[i]));
  } else {
    bad("'prompt' must be a string, an array of token ids, or a list of at most " + std::to_string(kMaxChoices) +
            " of either",
        "prompt");
  }
}

// `response_format` (OpenAI) or `grammar` (llama.cpp's server): the output's required shape.
void parse_output_format(const json& j, const std::string& body, CompletionRequest& r) {
  if (has(j, "grammar") && !j["grammar"].is_null()) {
    if (!j["grammar"].is_string() || j["grammar"].get<std::string>().empty())
      bad("'grammar' must be a non-empty GBNF string", "grammar");
    r.format.kind = OutputFormat::Kind::Grammar;
    r.format.spec = j["grammar"].get<std::string>();
  }
  if (!has(j, "response_format") || j["response_format"].is_null()) return;
  const json& f = j["response_format"];
  if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
    bad("'response_format' must be an object with a 'type'", "response_format");
  const std::string type = f["type"].get<std::string>();
  if (type != "text" && r.format.kind == OutputFormat::Kind::Grammar)
    bad("give either 'grammar' or a 'response_format' of type json_object / json_schema, not both", "response_format");
  if (type == "text") return;
  if (type == "json_object") {
    r.format = OutputFormat{};
    r.format.kind = OutputFormat::Kind::JsonObject;
  } else if (type == "json_schema") {
    const json& js = f.contains("json_schema") ? f["json_schema"] : json();
    if (!js.is_object() || !js.contains("schema") || !js["schema"].is_object())
      bad("'response_format.json_schema' must be an object with a 'schema' object", "response_format.json_schema");
    if (js.contains("strict") && !js["strict"].is_boolean() && !js["strict"].is_null())
      bad("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict");
    r.format = OutputFormat{};
    r.format.kind = OutputFormat::Kind::JsonSchema;
    r.format.spec = js["schema"].dump();
    r.format.strict = js.contains("strict") && js["strict"].is_boolean() && js["strict"].get<bool>();
    // The schema's property order is the output's key order: take it from the body as written
    // (json sorts keys; the body parsed once already, within the depth limit).
    if (!body.empty()) {
      const auto ordered = nlohmann::ordered_json::parse(body);
      r.format.spec = ordered["response_format"]["json_schema"]["schema"].dump();
    }
  } else {
    bad("'response_format.type' must be text, json_object or json_schema", "response_format.type");
  }
}

// `tools` and `tool_choice` of a chat request.
void parse_tools(const json& j, CompletionRequest& r) {
  if (has(j, "tools") && !j["tools"].is_null()) {
    const json& t = j["tools"];
    if (!t.is_array()) bad("'tools' must be an array", "tools");
    for (const json& f : t)
      if (!f.is_object() || f.value("type", "") != "function" || !f.contains("function") || !f["function"].is_object() ||
          !f["function"].contains("name") || !f["function"]["name"].is_string() ||
          (f["function"].contains("parameters") && !f["function"]["parameters"].is_object()))
        bad("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}", "tools");
    if (!t.empty()) r.tools = t.dump();
  }
  if (has(j, "tool_choice") && !j["tool_choice"].is_null()) {
    const json& c = j["tool_choice"];
    if (c == "none") {
      r.tool_choice_none = true;
    } else if (c == "required") {
      r.tool_choice_forced = true;
    } else if (c.is_object()) {
      if (c.value("type", "") != "function" || !c.contains("function") || !c["function"].is_object() ||
          !c["function"].contains("name") || !c["function"]["name"].is_string())
        bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            "tool_choice");
      r.tool_choice_forced = true;
      r.tool_choice_name = c["function"]["name"].get<std::string>();
    } else if (c != "auto") {
      bad("tool_choice must be \"none\", \"auto\", \"required\" or a named function", "tool_choice");
    }
    if (r.tool_choice_forced && r.tools.empty()) bad("tool_choice asks for a call but 'tools' is empty", "tool_choice");
  }
}

// /v1/completions' `echo` (the prompt in front of the text; with logprobs, the prompt's tokens
// and logprobs in front of the completion's, and max_tokens may be 0: scoring, as lm-eval does)
// and `suffix` (fill-in-the-middle, server/infill.h).
void parse_echo_suffix(const json& j, CompletionRequest& r) {
  if (has(j, "echo")) {
    if (!j["echo"].is_boolean()) bad("'echo' must be a boolean", "echo");
    r.echo = j["echo"].get<bool>();
  }
  if (r.max_tokens == 0 && !r.echo) bad("'max_tokens' must be at least 1 (0 only with 'echo': the prompt scored)", "max_tokens");
  if (has(j, "suffix") && !j["suffix"].is_null()) {
    if (!j["suffix"].is_string()) bad("'suffix' must be a string", "suffix");
    r.suffix = j["suffix"].get<std::string>();
    if (!r.suffix.empty() && !r.prompt_ids.empty()) bad("'suffix' needs a text prompt, not token ids", "suffix");
    if (!r.suffix.empty() && r.echo) bad("'echo' with 'suffix' is not supported", "suffix");
  }
}

}  // namespace

CompletionRequest CompletionRequest::with_prompt(size_t i) const {
  CompletionRequest r = *this;
  r.more_prompts.clear(), r.more_prompt_ids.clear();
  if (i == 0) return r;
  if (i - 1 < more_prompts.size()) {
    r.prompt = more_prompts[i - 1];
  } else {
    r.prompt.clear();
    r.prompt_ids = more_prompt_ids.at(i - 1 - more_prompts.size());
  }
  return r;
}

nlohmann::json parse_json_body(const std::string& body) {
  // The parser callback sees each value's depth as it starts; throwing stops the parse there.
  const json::parser_callback_t depth_guard = [](int depth, json::parse_event_t ev, json&) {
    if ((ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start) && depth >= kMaxJsonDepth)
      bad("malformed JSON: nested deeper than " + std::to_string(kMaxJsonDepth) + " levels", "");
    return true;
  };
  try {
    return json::parse(body, depth_guard);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999 (was a 500)
    bad(std::string("malformed JSON: ") + e.what(), "");
  }
}

namespace {

// The body as a JSON object, within max_body bytes (413), with `model`, if given, the served one
// (404); returns that model name.
json request_object(const std::string& body, const std::string& model_id, size_t max_body, std::string* model) {
  if (body.size() > max_body)
    throw ApiError(413, "request body of " + std::to_string(body.size()) + " bytes exceeds the limit of " + std::to_string(max_body));
  json j = parse_json_body(body);
  if (!j.is_object()) bad("the request body must be a JSON object", "");
  if (has(j, "model")) {
    if (!j["model"].is_string()) bad("'model' must be a string", "model");
    *model = j["model"].get<std::string>();
    if (*model != model_id)
      throw ApiError(404, "The model '" + *model + "' does not exist (this server serves '" + model_id + "')", "model",
                     "model_not_found");
  }
  return j;
}

}  // namespace

EmbeddingRequest parse_embedding_request(const std::string& body, const std::string& model_id, int64_t dim, size_t max_body) {
  std::string model;
  const json j = request_object(body, model_id, max_body, &model);
  EmbeddingRequest r;
  if (!has(j, "input")) bad("'input' is required", "input");
  const json& in = j["input"];
  auto ids_of = [](const json& a) {
    std::vector<int32_t> ids = token_ids(a, "input");
    if (ids.empty()) bad("'input' token arrays must not be empty", "input");
    return ids;
  };
  if (in.is_string()) {
    r.texts.push_back(in.get<std::string>());
  } else if (in.is_array() && !in.empty() && in[0].is_number_integer()) {
    r.ids.push_back(ids_of(in));
  } else if (in.is_array() && !in.empty() && in.size() <= kMaxEmbeddingInputs) {
    const bool text = in[0].is_string();
    for (const json& x : in) {
      if (text && x.is_string()) r.texts.push_back(x.get<std::string>());
      else if (!text && x.is_array()) r.ids.push_back(ids_of(x));
      else bad("a list of inputs must hold only strings or only arrays of token ids", "input");
    }
  } else {
    bad("'input' must be a string, an array of token ids, or a list of 1 to " + std::to_string(kMaxEmbeddingInputs) + " of either", "input");
  }
  for (const std::string& t : r.texts)
    if (t.empty()) bad("'input' must not contain empty strings", "input");
  if (has(j, "encoding_format")) {
    const json& f = j["encoding_format"];
    if (!f.is_string() || (f != "float" && f != "base64")) bad("'encoding_format' must be \"float\" or \"base64\"", "encoding_format");
    r.base64 = f == "base64";
  }
  if (has(j, "dimensions") && integer(j, "dimensions", 1, INT64_MAX) != dim)
    bad("'dimensions' must be the model's embedding width, " + std::to_string(dim) + " (its vectors are not shortened)", "dimensions");
  if (has(j, "user") && !j["user"].is_string()) bad("'user' must be a string", "user");
  return r;
}

namespace {

// The sampling fields: temperature, top_p, top_k, min_p, the penalties, logit_bias and seed, from
// OpenAI's defaults (temperature 1, top_p 1, no top_k or min_p; a random seed). Throws ApiError.
void parse_sampling(const json& j, SamplerParams& s) {
  s.temperature = 1.0f, s.top_k = 0, s.top_p = 1.0f, s.min_p = 0.0f;  // OpenAI defaults
  if (has(j, "temperature")) s.temperature = float(number(j, "temperature", 0, 2));
  if (has(j, "top_p")) s.top_p = float(number(j, "top_p", 0, 1));
  if (has(j, "top_k")) s.top_k = int32_t(integer(j, "top_k", 0, 1 << 20));
  if (has(j, "min_p")) s.min_p = float(number(j, "min_p", 0, 1));
  if (has(j, "presence_penalty")) s.presence_penalty = float(number(j, "presence_penalty", -2, 2));
  if (has(j, "frequency_penalty")) s.frequency_penalty = float(number(j, "frequency_penalty", -2, 2));
  if (has(j, "repetition_penalty")) s.repeat_penalty = float(number(j, "repetition_penalty", 0.01, 10));
  if (has(j, "logit_bias")) {
    const json& lb = j["logit_bias"];
    if (!lb.is_object() || lb.size() > 1024) bad("'logit_bias' must be an object of at most 1024 token ids", "logit_bias");
    for (const auto& [key, v] : lb.items()) {
      char* end = nullptr;
      const long long id = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || *end || id < 0 || id > INT32_MAX || !v.is_number() || v.get<double>() < -100 || v.get<double>() > 100)
        bad("'logit_bias' maps token ids (\"123\") to numbers in [-100, 100]", "logit_bias");
      s.logit_bias.emplace_back(int32_t(id), v.get<float>());
    }
  }
  s.seed = has(j, "seed") ? uint64_t(integer(j, "seed", INT64_MIN, INT64_MAX)) : uint64_t(std::random_device{}());
}

// stop (a string or up to 4 non-empty strings), stream and stream_options.include_usage.
void parse_stop_and_stream(const json& j, CompletionRequest& r) {
  if (has(j, "stop")) {
    const json& st = j["stop"];
    if (st.is_string()) r.stop.push_back(st.get<std::string>());
    else if (st.is_array() && st.size() <= 4) {
      for (const json& x : st) {
        if (!x.is_string() || x.get<std::string>().empty()) bad("'stop' entries must be non-empty strings", "stop");
        r.stop.push_back(x.get<std::string>());
      }
    } else bad("'stop' must be a string or an array of at most 4 strings", "stop");
  }
  if (has(j, "stream")) {
    if (!j["stream"].is_boolean()) bad("'stream' must be a boolean", "stream");
    r.stream = j["stream"].get<bool>();
  }
  if (has(j, "stream_options")) {
    const json& so = j["stream_options"];
    if (!so.is_object()) bad("'stream_options' must be an object", "stream_options");
    if (so.contains("include_usage")) {
      if (!so["include_usage"].is_boolean()) bad("'include_usage' must be a boolean", "stream_options.include_usage");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
}

// Log probabilities: chat's logprobs (a boolean) and top_logprobs (0-20, with logprobs: true);
// completions' logprobs (0-5 alternatives).
void parse_logprobs(const json& j, bool chat, CompletionRequest& r) {
  if (!chat) {
    if (has(j, "logprobs")) r.top_logprobs = int(integer(j, "logprobs", 0, 5));
    return;
  }
  if (has(j, "logprobs")) {
    if (!j["logprobs"].is_boolean()) bad("'logprobs' must be a boolean", "logprobs");
    if (j["logprobs"].get<bool>()) r.top_logprobs = 0;
  }
  if (has(j, "top_logprobs")) {
    const int64_t k = integer(j, "top_logprobs", 0, 20);
    if (r.top_logprobs < 0) bad("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    r.top_logprobs = int(k);
  }
}

}  // namespace

CompletionRequest parse_completion_request(const std::string& body, bool chat, const std::string& model_id, int64_t ctx,
                                           size_t max_body) {
  CompletionRequest r;
  const json j = request_object(body, model_id, max_body, &r.model);
  r.chat = chat;
  try {
    if (chat) {
      if (!has(j, "messages") || !j["messages"].is_array() || j["messages"].empty()) bad("'messages' must be a non-empty array", "messages");
      for (size_t i = 0; i < j["messages"].size(); ++i) r.messages.push_back(parse_message(j["messages"][i], i));
      parse_tools(j, r);
    } else {
      if (!has(j, "prompt")) bad("'prompt' is required", "prompt");
      parse_prompts(j["prompt"], r);
    }
    if (has(j, "n")) r.n = int(integer(j, "n", 1, kMaxChoices));
    if (int64_t(r.n) * int64_t(r.prompts()) > kMaxChoices)
      bad("n times the number of prompts is " + std::to_string(int64_t(r.n) * int64_t(r.prompts())) + "; at most " +
              std::to_string(kMaxChoices) + " choices per request",
          "n");
    const char* mt = has(j, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (has(j, mt)) r.max_tokens = std::min<int64_t>(integer(j, mt, chat ? 1 : 0, INT64_MAX), ctx);  // clamped, as OpenAI-compatible servers do
    parse_sampling(j, r.sampling);
    parse_stop_and_stream(j, r);
    parse_output_format(j, body, r);
    parse_logprobs(j, chat, r);
    if (!chat) parse_echo_suffix(j, r);
  } catch (const json::exception& e) {
    bad(std::string("invalid request: ") + e.what(), "");
  }
  return r;
}

}  // namespace llmq
