// Chat templates: the model's own Jinja template (tokenizer.chat_template) rendered by llmq's
// Jinja interpreter (text/jinja.h) as Hugging Face transformers renders it, or one of the common
// formats applied natively (--chat-template NAME, and models whose template does not parse).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "formats/vocab.h"

namespace llmq {

/// One turn of a conversation; role is "system", "user", "assistant" or "tool" (the last only
/// through a Jinja template that knows it).
struct ChatMessage {
  std::string role;
  std::string content;
  /// assistant turns that called tools: the calls as a JSON array in OpenAI's form
  /// ([{"id", "type": "function", "function": {"name", "arguments"}}], arguments an object or
  /// the JSON text of one), given to the template as message.tool_calls; empty: none.
  std::string tool_calls = {};
  std::string tool_call_id = {};  ///< tool turns: the id of the call answered (message.tool_call_id)
};

/// A chat format. Output strings contain the special-token text (e.g. "<|im_start|>"), to be
/// tokenized with special-token parsing on.
class ChatTemplate {
 public:
  /// The template named `name` (see names()); throws UsageError listing the known names.
  static ChatTemplate by_name(const std::string& name);
  /// The model's own template (tokenizer.chat_template), rendered with `messages`,
  /// `add_generation_prompt`, `bos_token` and `eos_token` (the vocabulary's BOS/EOS piece text);
  /// name() is "jinja". A template the interpreter cannot parse is recognised instead by its
  /// distinctive markers as one of the native formats (recognise()); throws UsageError listing
  /// the known names if it is neither.
  static ChatTemplate from_jinja(const std::string& jinja, const std::string& bos_token = "", const std::string& eos_token = "");
  /// The native format whose markers the Jinja text holds (ChatML, Llama-3 headers, Gemma turns,
  /// …); throws UsageError listing the known names if it matches none.
  static ChatTemplate recognise(const std::string& jinja);
  /// from_jinja with the BOS and EOS piece text of `vocab` (empty where it has none).
  static ChatTemplate for_vocab(const std::string& jinja, const Vocab& vocab);
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
  /// `tools`: the request's tools as a JSON array (OpenAI's form), given to a Jinja template as
  /// `tools`; a built-in format takes none (throws UsageError when it is not empty).
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt, const std::string& tools = "") const;

  /// The same text as apply(), cut into segments: `special` segments are template markup
  /// (tokenize with special-token parsing), the others are message contents (plain text, so a
  /// user typing "<|im_start|>" gets ordinary tokens). For a Jinja template the contents are
  /// found by rendering once more with each non-empty content replaced by a placeholder and
  /// aligning the two texts; where that fails (a template whose markup depends on the content's
  /// value) the whole text is one special segment, as llama.cpp tokenizes every chat prompt.
  struct Segment {
    std::string text;
    bool special;
  };
  std::vector<Segment> apply_segments(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                      const std::string& tools = "") const;

  struct Jinja;  // the parsed template and its token strings (chat.cpp)

 private:
  std::string name_;
  std::string default_system_;
  std::shared_ptr<const Jinja> jinja_;
  std::vector<Segment> jinja_segments(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                      const std::string& tools) const;
};

}  // namespace llmq
