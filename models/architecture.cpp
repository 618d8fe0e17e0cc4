#include "models/architecture.h"

namespace llmq {

namespace {

// Every architecture this build runs: the built-in table, then any registered at run time.
std::vector<Architecture>& registry() {
  static std::vector<Architecture> all = {kLlama, kQwen2, kQwen3, kGemma3, kMistral, kPhi3};
  return all;
}

}  // namespace

const Architecture* find_architecture(const std::string& name) {
  for (const Architecture& a : registry())
    if (name == a.name) return &a;
  return nullptr;
}

std::string architecture_names() {
  std::string s;
  for (const Architecture& a : registry()) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

void register_architecture(const Architecture& a) {
  for (Architecture& old : registry())
    if (std::string(old.name) == a.name) {
      old = a;
      return;
    }
  registry().push_back(a);
}

}  // namespace llmq
