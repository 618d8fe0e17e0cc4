#include "text/chat.h"

#include "base/error.h"

namespace llmq {

namespace {

const std::vector<std::string> kNames = {"chatml", "llama2", "llama3", "mistral", "zephyr", "gemma", "phi3"};

std::string known_names() {
  std::string s;
  for (const auto& n : kNames) s += (s.empty() ? "" : ", ") + n;
  return s;
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

std::vector<std::string> ChatTemplate::names() { return kNames; }

ChatTemplate ChatTemplate::by_name(const std::string& name) {
  for (const auto& n : kNames)
    if (n == name) {
      ChatTemplate t;
      t.name_ = name;
      return t;
    }
  throw UsageError("unknown chat template '" + name + "' (known: " + known_names() + ")");
}

ChatTemplate ChatTemplate::from_jinja(const std::string& j) {
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

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool gen) const {
  std::string out;
  for (const Segment& s : apply_segments(messages, gen)) out += s.text;
  return out;
}

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
}  // namespace

std::vector<ChatTemplate::Segment> ChatTemplate::apply_segments(const std::vector<ChatMessage>& messages, bool gen) const {
  std::string system;
  std::vector<ChatMessage> turns = split_system(messages, &system);
  if (system.empty()) system = default_system_;
  Out out;
  if (name_ == "chatml") {
    if (!system.empty()) out += "<|im_start|>system\n", out.content(system), out += "<|im_end|>\n";
    for (const auto& m : turns) out += "<|im_start|>" + m.role + "\n", out.content(m.content), out += "<|im_end|>\n";
    if (gen) out += "<|im_start|>assistant\n";
  } else if (name_ == "llama3") {
    out += "<|begin_of_text|>";
    auto turn = [&](const std::string& role, const std::string& text) {
      out += "<|start_header_id|>" + role + "<|end_header_id|>\n\n";
      out.content(text);
      out += "<|eot_id|>";
    };
    if (!system.empty()) turn("system", system);
    for (const auto& m : turns) turn(m.role, m.content);
    if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  } else if (name_ == "llama2" || name_ == "mistral") {
    // <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>  (Llama-2)
    // <s>[INST] {system}\n\n{user} [/INST] {assistant}</s>                       (Mistral)
    bool first = true;
    for (const auto& m : turns) {
      if (m.role == "user") {
        out += (name_ == "llama2" || first ? "<s>" : "") + std::string("[INST] ");
        if (first && !system.empty()) {
          if (name_ == "llama2") out += "<<SYS>>\n", out.content(system), out += "\n<</SYS>>\n\n";
          else out.content(system + "\n\n");
        }
        out.content(m.content);
        out += " [/INST]";
        first = false;
      } else {
        out += " ";
        out.content(m.content);
        out += name_ == "llama2" ? " </s>" : "</s>";
      }
    }
  } else if (name_ == "zephyr" || name_ == "phi3") {
    const std::string end = name_ == "zephyr" ? "</s>" : "<|end|>";
    if (!system.empty()) out += "<|system|>\n", out.content(system), out += end + "\n";
    for (const auto& m : turns) out += "<|" + m.role + "|>\n", out.content(m.content), out += end + "\n";
    if (gen) out += "<|assistant|>\n";
  } else if (name_ == "gemma") {
    // Gemma has no system role: the system text opens the first user turn.
    bool first = true;
    for (const auto& m : turns) {
      out += "<start_of_turn>" + std::string(m.role == "assistant" ? "model" : "user") + "\n";
      if (first && m.role == "user" && !system.empty()) out.content(system + "\n\n");
      first = false;
      out.content(m.content);
      out += "<end_of_turn>\n";
    }
    if (gen) out += "<start_of_turn>model\n";
  }
  return out.segs;
}

}  // namespace llmq
