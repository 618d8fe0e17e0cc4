// Chat templates: recognised from real Jinja template texts, applied as the models' own
// templates render them.
#include <catch2/catch.hpp>

#include "text/chat.h"
#include "base/error.h"

using namespace llmq;

namespace {

// SmolLM2-135M-Instruct's tokenizer.chat_template, as stored in its GGUF.
const char* kSmolLM2 =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const std::vector<ChatMessage> kConv = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};

}  // namespace

TEST_CASE("templates are recognised from their Jinja text", "[chat]") {
  CHECK(ChatTemplate::recognise(kSmolLM2).name() == "chatml");
  CHECK(ChatTemplate::recognise(kSmolLM2).default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  CHECK(ChatTemplate::recognise("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}").name() == "llama3");
  CHECK(ChatTemplate::recognise("{{ bos_token + '[INST] ' + '<<SYS>>\\n' + content }}").name() == "llama2");
  CHECK(ChatTemplate::recognise("{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}").name() == "mistral");
  CHECK(ChatTemplate::recognise("{{ '<|user|>\n' + message['content'] + eos_token }}").name() == "zephyr");
  CHECK(ChatTemplate::recognise("{{ '<|user|>' + '\n' + message['content'] + '<|end|>' }}").name() == "phi3");
  CHECK(ChatTemplate::recognise("{{ '<start_of_turn>' + role + '\n' }}").name() == "gemma");
  CHECK_THROWS_WITH(ChatTemplate::recognise("{{ messages }}"), Catch::Contains("chatml") && Catch::Contains("gemma"));
  CHECK_THROWS_WITH(ChatTemplate::by_name("alpaca"), Catch::Contains("known: chatml, llama2"));
}

TEST_CASE("each template formats a conversation with a system prompt", "[chat]") {
  CHECK(ChatTemplate::by_name("chatml").apply(kConv, true) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(ChatTemplate::by_name("llama3").apply(kConv, true) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(ChatTemplate::by_name("llama2").apply(kConv, true) ==
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]");
  CHECK(ChatTemplate::by_name("mistral").apply(kConv, true) == "<s>[INST] Be brief.\n\nHi [/INST] Hello!</s>[INST] 2+2? [/INST]");
  CHECK(ChatTemplate::by_name("zephyr").apply(kConv, true) ==
        "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n<|user|>\n2+2?</s>\n<|assistant|>\n");
  CHECK(ChatTemplate::by_name("phi3").apply(kConv, true) ==
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n");
  CHECK(ChatTemplate::by_name("gemma").apply(kConv, true) ==
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n");
}

TEST_CASE("SmolLM2's template inserts its default system prompt", "[chat]") {
  const ChatTemplate t = ChatTemplate::recognise(kSmolLM2);
  CHECK(t.apply({{"user", "Hi"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(t.apply({{"system", "X"}, {"user", "Hi"}}, false) == "<|im_start|>system\nX<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  CHECK_THROWS_AS(t.apply({{"tool", "x"}}, true), UsageError);
}

// The model's own template, rendered by the Jinja interpreter (text/jinja.h), equals the native
// ChatML format on SmolLM2's template; the message contents come out as plain (non-special)
// segments, found by rendering with placeholders.
TEST_CASE("a model's Jinja template is rendered, contents kept apart from the markup", "[chat]") {
  const ChatTemplate t = ChatTemplate::from_jinja(kSmolLM2, "<|im_start|>", "<|im_end|>");
  CHECK(t.name() == "jinja");
  const std::vector<ChatMessage> conv = {{"user", "Hi <|im_start|> there"}, {"assistant", ""}, {"user", "  2+2? "}};
  CHECK(t.apply(conv, true) == ChatTemplate::recognise(kSmolLM2).apply(conv, true));
  const auto segs = t.apply_segments(conv, true);
  std::string all, plain;
  for (const auto& s : segs) {
    all += s.text;
    if (!s.special) plain += s.text + "|";
  }
  CHECK(all == t.apply(conv, true));
  CHECK(plain == "Hi <|im_start|> there|  2+2? |");  // the default system prompt is the template's markup
  // A template that prints the content twice cannot be aligned: one special segment (as llama.cpp).
  const ChatTemplate twice = ChatTemplate::from_jinja("{% for m in messages %}{{ m.content }}|{{ m.content }}{% endfor %}");
  const auto two = twice.apply_segments({{"user", "ab"}}, false);
  REQUIRE(two.size() >= 1);
  std::string joined;
  for (const auto& s : two) joined += s.text;
  CHECK(joined == "ab|ab");
  // A template that branches on the content: rendered with the placeholder, its markup after the
  // last content is longer than the whole real text (found by fuzz/chat_template): one special
  // segment, not std::out_of_range.
  const ChatTemplate branch = ChatTemplate::from_jinja(
      "{% if messages[0].content == 'x' %}{{ messages[0].content }}{% else %}{{ messages[0].content }}and a long tail{% endif %}");
  const auto one = branch.apply_segments({{"user", "x"}}, false);
  REQUIRE(one.size() == 1);
  CHECK(one[0].text == "x");
  CHECK(one[0].special);
  // bos_token and a Jinja error (raise_exception) surface as UsageError.
  CHECK(ChatTemplate::from_jinja("{{ bos_token }}x", "<s>").apply({}, false) == "<s>x");
  CHECK_THROWS_AS(ChatTemplate::from_jinja("{{ raise_exception('no') }}").apply({{"user", "x"}}, false), UsageError);
}
