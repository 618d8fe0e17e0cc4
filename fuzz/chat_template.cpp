// Fuzz target chat_template: chat templates (engine/chat.*): ChatTemplate::from_jinja on
// arbitrary text, then apply / apply_segments on fuzzed conversations.
//
// Input layout: byte 0 holds flags, the rest is split at NUL bytes into fields.
//   bit 0     add_generation_prompt
//   bits 1-3  template: 0-6 by_name(names()[i]); 7: from_jinja(first field)
// The remaining fields come in pairs (role, content). The role field's first byte picks the
// role: 0 system, 1 user, 2 assistant (modulo 4), 3: the rest of the field is the role text
// (an unknown role must be a UsageError).
// Checked: only UsageError is thrown; apply() equals the concatenation of apply_segments();
// for the built-in formats every user or assistant message's content appears in a non-special
// segment; for a Jinja template (which may print a content transformed, twice or not at all) no
// segment holds the placeholder characters that find the contents (U+E000, U+E001) unless the
// template or a message holds them.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/chat.h"
#include "base/error.h"
#include "fuzz/fuzz_common.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  std::vector<std::string> fields;
  {
    const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
    size_t a = 0;
    for (;;) {
      const size_t b = rest.find('\0', a);
      fields.emplace_back(rest.substr(a, b == std::string_view::npos ? std::string_view::npos : b - a));
      if (b == std::string_view::npos) break;
      a = b + 1;
    }
  }
  const unsigned which = (flags >> 1) & 7u;
  size_t next = 0;
  ChatTemplate t;
  try {
    if (which < 7) {
      t = ChatTemplate::by_name(ChatTemplate::names().at(which));
    } else {
      t = ChatTemplate::from_jinja(fields[next++]);
    }
  } catch (const UsageError&) {
    return 0;
  }
  std::vector<ChatMessage> messages;
  static const char* roles[] = {"system", "user", "assistant"};
  for (; next + 1 < fields.size(); next += 2) {
    const std::string& r = fields[next];
    ChatMessage m;
    const unsigned k = r.empty() ? 1u : uint8_t(r[0]) % 4u;
    m.role = k < 3 ? roles[k] : r.substr(1);
    m.content = fields[next + 1];
    messages.push_back(std::move(m));
  }
  const bool gen = flags & 1u;
  try {
    const std::string text = t.apply(messages, gen);
    const auto segs = t.apply_segments(messages, gen);
    std::string joined;
    for (const auto& s : segs) joined += s.text;
    if (joined != text) fuzz::fail(t.name() + ": apply() differs from its segments");
    if (t.name() == "jinja") {
      const std::string mark = "\xee\x80";
      bool given = fields[0].find(mark) != std::string::npos;
      for (const ChatMessage& m : messages) given = given || m.content.find(mark) != std::string::npos || m.role.find(mark) != std::string::npos;
      if (!given && text.find(mark) != std::string::npos) fuzz::fail("jinja: a placeholder leaked into the prompt");
      return 0;
    }
    for (const ChatMessage& m : messages) {
      if (m.content.empty() || m.role == "system") continue;  // a system text may be dropped or merged
      bool found = false;
      for (const auto& s : segs) found = found || (!s.special && s.text.find(m.content) != std::string::npos);
      if (!found) fuzz::fail(t.name() + ": a message's content is missing from the plain-text segments");
    }
  } catch (const UsageError&) {
  }
  return 0;
}
