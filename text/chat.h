// Chat templates: the common formats, recognised from a model's Jinja template text and
// applied natively (no Jinja interpreter).
#pragma once
#include <string>
#include <vector>

namespace llmq {

/// One turn of a conversation; role is "system", "user" or "assistant".
struct ChatMessage {
  std::string role;
  std::string content;
};

/// A chat format. Output strings contain the special-token text (e.g. "<|im_start|>"), to be
/// tokenized with special-token parsing on.
class ChatTemplate {
 public:
  /// The template named `name` (see names()); throws UsageError listing the known names.
  static ChatTemplate by_name(const std::string& name);
  /// Recognises the template from the Jinja text stored in a model (tokenizer.chat_template)
  /// by its distinctive markers; throws UsageError listing the known names if it matches none.
  static ChatTemplate from_jinja(const std::string& jinja);
  /// Known names: chatml, llama2, llama3, mistral, zephyr, gemma, phi3.
  static std::vector<std::string> names();

  const std::string& name() const { return name_; }
  /// System prompt the template inserts when the conversation has none (e.g. SmolLM2's
  /// "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); may be empty.
  const std::string& default_system() const { return default_system_; }

  /// The conversation as prompt text; with add_generation_prompt it ends with the opening of
  /// an assistant turn. Formats per the models' published templates (ChatML: OpenAI/Qwen;
  /// Llama-2 [INST] with <<SYS>>; Llama-3 header ids; Mistral [INST]; Zephyr; Gemma turns;
  /// Phi-3). Throws UsageError for an unknown role.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

  /// The same text as apply(), cut into segments: `special` segments are template markup
  /// (tokenize with special-token parsing), the others are message contents (plain text, so a
  /// user typing "<|im_start|>" gets ordinary tokens).
  struct Segment {
    std::string text;
    bool special;
  };
  std::vector<Segment> apply_segments(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  std::string name_;
  std::string default_system_;
};

}  // namespace llmq
