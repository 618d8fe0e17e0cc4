#include "text/chat.h"

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "text/jinja.h"

namespace llmq {

namespace {

// Collects segments; `+=` appends template markup, content() appends message text.
struct Out {
  std::vector<ChatTemplate::Segment> segs;
  Out& operator+=(const std::string& markup) {
    if (!markup.empty()) segs.push_back({markup, true});
    return *this;
  }
  void content(const std::string& text) {
    if (!text.empty()) segs.push_back({text, false});
  }
};

// What a built-in template renders: the system text (a leading system message, else the
// template's default), the other turns, and whether to open the assistant's turn.
struct Conversation {
  std::string system;
  std::vector<ChatMessage> turns;
  bool gen = false;
};

void render_chatml(Out& out, const Conversation& c) {
  if (!c.system.empty()) out += "<|im_start|>system\n", out.content(c.system), out += "<|im_end|>\n";
  for (const auto& m : c.turns) out += "<|im_start|>" + m.role + "\n", out.content(m.content), out += "<|im_end|>\n";
  if (c.gen) out += "<|im_start|>assistant\n";
}

void render_llama3(Out& out, const Conversation& c) {
  out += "<|begin_of_text|>";
  auto turn = [&](const std::string& role, const std::string& text) {
    out += "<|start_header_id|>" + role + "<|end_header_id|>\n\n";
    out.content(text);
    out += "<|eot_id|>";
  };
  if (!c.system.empty()) turn("system", c.system);
  for (const auto& m : c.turns) turn(m.role, m.content);
  if (c.gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

// <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>  (Llama-2)
// <s>[INST] {system}\n\n{user} [/INST] {assistant}</s>                       (Mistral)
void render_inst(Out& out, const Conversation& c, bool llama2) {
  bool first = true;
  for (const auto& m : c.turns) {
    if (m.role == "user") {
      out += (llama2 || first ? "<s>" : "") + std::string("[INST] ");
      if (first && !c.system.empty()) {
        if (llama2) out += "<<SYS>>\n", out.content(c.system), out += "\n<</SYS>>\n\n";
        else out.content(c.system + "\n\n");
      }
      out.content(m.content);
      out += " [/INST]";
      first = false;
    } else {
      out += " ";
      out.content(m.content);
      out += llama2 ? " </s>" : "</s>";
    }
  }
}

// <|system|>, <|user|>, <|assistant|> headers, each turn closed by `end` (Zephyr: </s>, Phi-3: <|end|>).
void render_tagged(Out& out, const Conversation& c, const std::string& end) {
  if (!c.system.empty()) out += "<|system|>\n", out.content(c.system), out += end + "\n";
  for (const auto& m : c.turns) out += "<|" + m.role + "|>\n", out.content(m.content), out += end + "\n";
  if (c.gen) out += "<|assistant|>\n";
}

// Gemma has no system role: the system text opens the first user turn.
void render_gemma(Out& out, const Conversation& c) {
  bool first = true;
  for (const auto& m : c.turns) {
    out += "<start_of_turn>" + std::string(m.role == "assistant" ? "model" : "user") + "\n";
    if (first && m.role == "user" && !c.system.empty()) out.content(c.system + "\n\n");
    first = false;
    out.content(m.content);
    out += "<end_of_turn>\n";
  }
  if (c.gen) out += "<start_of_turn>model\n";
}

// The built-in templates (--chat-template NAME), in the order `names()` lists them.
struct Builtin {
  const char* name;
  void (*render)(Out&, const Conversation&);
};
const Builtin kBuiltins[] = {
    {"chatml", render_chatml},
    {"llama2", [](Out& o, const Conversation& c) { render_inst(o, c, true); }},
    {"llama3", render_llama3},
    {"mistral", [](Out& o, const Conversation& c) { render_inst(o, c, false); }},
    {"zephyr", [](Out& o, const Conversation& c) { render_tagged(o, c, "</s>"); }},
    {"gemma", render_gemma},
    {"phi3", [](Out& o, const Conversation& c) { render_tagged(o, c, "<|end|>"); }},
};

std::string known_names() {
  std::string s;
  for (const Builtin& b : kBuiltins) s += (s.empty() ? "" : ", ") + std::string(b.name);
  return s;
}

// The built-in template called `name`; throws UsageError listing the known ones.
const Builtin& builtin(const std::string& name) {
  for (const Builtin& b : kBuiltins)
    if (name == b.name) return b;
  throw UsageError("unknown chat template '" + name + "' (known: " + known_names() + ")");
}

bool has(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

void check_role(const ChatMessage& m) {
  if (m.role != "system" && m.role != "user" && m.role != "assistant")
    throw UsageError("chat: unknown role '" + m.role + "' (system, user, assistant)");
}

// Moves a leading system message into `system` and returns the remaining messages.
std::vector<ChatMessage> split_system(const std::vector<ChatMessage>& in, std::string* system) {
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < in.size(); ++i) {
    check_role(in[i]);
    if (i == 0 && in[i].role == "system") *system = in[i].content;
    else out.push_back(in[i]);
  }
  return out;
}

}  // namespace

std::vector<std::string> ChatTemplate::names() {
  std::vector<std::string> v;
  for (const Builtin& b : kBuiltins) v.push_back(b.name);
  return v;
}

ChatTemplate ChatTemplate::by_name(const std::string& name) {
  ChatTemplate t;
  t.name_ = builtin(name).name;
  return t;
}

struct ChatTemplate::Jinja {
  jinja::Template tmpl;
  std::string bos, eos;
};

ChatTemplate ChatTemplate::from_jinja(const std::string& j, const std::string& bos, const std::string& eos) {
  try {
    ChatTemplate t;
    t.name_ = "jinja";
    t.jinja_ = std::make_shared<const Jinja>(Jinja{jinja::Template(j), bos, eos});
    return t;
  } catch (const UsageError&) {
    return recognise(j);
  }
}

ChatTemplate ChatTemplate::for_vocab(const std::string& j, const Vocab& v) {
  auto piece = [&](int32_t id) { return id >= 0 && size_t(id) < v.tokens.size() ? v.tokens[size_t(id)] : std::string(); };
  return from_jinja(j, piece(v.bos_id), piece(v.eos_id));
}

ChatTemplate ChatTemplate::recognise(const std::string& j) {
  std::string name;
  if (has(j, "<|im_start|>")) name = "chatml";
  else if (has(j, "<|start_header_id|>")) name = "llama3";
  else if (has(j, "<start_of_turn>")) name = "gemma";
  else if (has(j, "<|user|>") && has(j, "<|end|>")) name = "phi3";
  else if (has(j, "<|user|>")) name = "zephyr";
  else if (has(j, "[INST]") && has(j, "<<SYS>>")) name = "llama2";
  else if (has(j, "[INST]")) name = "mistral";
  else
    throw UsageError("the model's chat template is not one llmq recognises (known: " + known_names() +
                     "); choose one with --chat-template NAME");
  ChatTemplate t = by_name(name);
  // A ChatML template that inserts a system turn when the first message is not one
  // (SmolLM2, Qwen2): take the inserted text as the default system prompt.
  if (name == "chatml" && has(j, "!= 'system'")) {
    const std::string open = "<|im_start|>system\n";
    const size_t a = j.find(open);
    const size_t b = a == std::string::npos ? a : j.find("<|im_end|>", a);
    if (b != std::string::npos) t.default_system_ = j.substr(a + open.size(), b - a - open.size());
  }
  return t;
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool gen, const std::string& tools) const {
  std::string out;
  for (const Segment& s : apply_segments(messages, gen, tools)) out += s.text;
  return out;
}

namespace {

// The template's variables: messages (role, content), add_generation_prompt, bos/eos_token.
// `contents` replaces each message's content when not null (the placeholders).
// JSON text (already validated by the caller) as a template value, key order kept; a call's
// "arguments" given as JSON text becomes the object it spells (as transformers expects).
jinja::Value json_value(const std::string& text, bool tool_calls) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(std::string("chat: malformed JSON given to the template: ") + e.what());
  }
  if (tool_calls && j.is_array())
    for (auto& c : j)
      if (c.is_object() && c.contains("function") && c["function"].is_object() && c["function"].contains("arguments") &&
          c["function"]["arguments"].is_string()) {
        auto args = nlohmann::ordered_json::parse(c["function"]["arguments"].get<std::string>(), nullptr, false);
        if (!args.is_discarded()) c["function"]["arguments"] = args;
      }
  return jinja::Value::from_json(j);
}

jinja::Value jinja_context(const std::vector<ChatMessage>& messages, bool gen, const std::string& bos, const std::string& eos,
                           const std::vector<std::string>* contents, const std::string& tools) {
  jinja::Value ms = jinja::Value::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    jinja::Value m = jinja::Value::object();
    m.set("role", messages[i].role);
    m.set("content", contents ? (*contents)[i] : messages[i].content);
    if (!messages[i].tool_calls.empty()) m.set("tool_calls", json_value(messages[i].tool_calls, true));
    if (!messages[i].tool_call_id.empty()) m.set("tool_call_id", messages[i].tool_call_id);
    ms.push_back(std::move(m));
  }
  jinja::Value ctx = jinja::Value::object();
  ctx.set("messages", std::move(ms));
  ctx.set("tools", tools.empty() ? jinja::Value(nullptr) : json_value(tools, false));
  ctx.set("add_generation_prompt", gen);
  ctx.set("bos_token", bos);
  ctx.set("eos_token", eos);
  return ctx;
}

// A placeholder no template prints by itself: private-use characters around the index.
std::string placeholder(size_t i) { return "\xee\x80\x80" + std::to_string(i) + "\xee\x80\x81"; }

// Splits `marked` at the placeholders into the markup between them; false if one is missing or
// out of order.
bool split_markup(const std::string& marked, size_t n, std::vector<std::string>& markup, std::vector<size_t>& order) {
  size_t pos = 0;
  for (;;) {
    const size_t a = marked.find("\xee\x80\x80", pos);
    if (a == std::string::npos) break;
    const size_t b = marked.find("\xee\x80\x81", a);
    if (b == std::string::npos) return false;
    markup.push_back(marked.substr(pos, a - pos));
    const std::string digits = marked.substr(a + 3, b - a - 3);  // a template may print the markers itself
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
    const size_t idx = std::stoul(digits);
    if (idx >= n) return false;
    order.push_back(idx);
    pos = b + 3;
  }
  markup.push_back(marked.substr(pos));
  return true;
}

}  // namespace

std::vector<ChatTemplate::Segment> ChatTemplate::jinja_segments(const std::vector<ChatMessage>& messages, bool gen,
                                                                const std::string& tools) const {
  const std::string text = jinja_->tmpl.render(jinja_context(messages, gen, jinja_->bos, jinja_->eos, nullptr, tools));
  std::vector<std::string> holders;
  for (size_t i = 0; i < messages.size(); ++i) holders.push_back(messages[i].content.empty() ? "" : placeholder(i));
  std::vector<Segment> segs;
  std::vector<std::string> markup;
  std::vector<size_t> order;
  std::string marked;
  try {
    marked = jinja_->tmpl.render(jinja_context(messages, gen, jinja_->bos, jinja_->eos, &holders, tools));
  } catch (const UsageError&) {
    return {{text, true}};
  }
  if (!split_markup(marked, messages.size(), markup, order)) return {{text, true}};
  // text = markup[0] c_0 markup[1] c_1 ... markup[n]: each c_k ends where markup[k+1] is next found.
  size_t pos = 0;
  if (text.compare(0, markup[0].size(), markup[0]) != 0) return {{text, true}};
  if (!markup[0].empty()) segs.push_back({markup[0], true});
  pos = markup[0].size();
  for (size_t k = 0; k < order.size(); ++k) {
    const std::string& next = markup[k + 1];
    size_t at = std::string::npos;  // where markup[k + 1] starts in text: the last one ends it
    if (k + 1 == order.size()) at = next.size() <= text.size() ? text.size() - next.size() : std::string::npos;
    else if (!next.empty()) at = text.find(next, pos);
    if (at == std::string::npos || at < pos || text.compare(at, next.size(), next) != 0) return {{text, true}};
    if (at > pos) segs.push_back({text.substr(pos, at - pos), false});
    if (!next.empty()) segs.push_back({next, true});
    pos = at + next.size();
  }
  if (pos != text.size()) return {{text, true}};
  return segs;
}

std::vector<ChatTemplate::Segment> ChatTemplate::apply_segments(const std::vector<ChatMessage>& messages, bool gen,
                                                                const std::string& tools) const {
  if (jinja_) return jinja_segments(messages, gen, tools);
  if (!tools.empty()) throw UsageError("the built-in chat template '" + name_ + "' cannot render tools");
  Conversation c;
  c.turns = split_system(messages, &c.system);
  if (c.system.empty()) c.system = default_system_;
  c.gen = gen;
  Out out;
  builtin(name_).render(out, c);
  return out.segs;
}

}  // namespace llmq
