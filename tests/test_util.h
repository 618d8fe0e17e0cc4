// Helpers shared by the tests: where the real data and the built tools are.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>

namespace llmq::test {

/// Path inside ../shared (the real models, tokenizers, reference outputs).
inline std::string shared(const std::string& rel) { return std::string(LLMQ_SHARED_DIR) + "/" + rel; }
/// Path of a built tool, e.g. bin("llmq-run").
inline std::string bin(const std::string& name) { return std::string(LLMQ_BIN_DIR) + "/" + name; }
/// A fresh scratch folder for one test (removed and re-created).
inline std::string scratch(const std::string& name) {
  std::filesystem::path p = std::filesystem::path(LLMQ_TEST_TMP) / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

/// Runs a shell command; returns its exit status (-1 if it died from a signal).
inline int run(const std::string& cmd) {
  const int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// stories260K (../shared) converted by the real llmq-convert to `type`, once per test run.
inline std::string stories(const std::string& type) {
  static std::map<std::string, std::string> done;
  auto it = done.find(type);
  if (it != done.end()) return it->second;
  // One folder per process (CTest may run test cases in parallel), removed at exit.
  struct Dir {
    std::string path = scratch("stories-" + std::to_string(::getpid()));
    ~Dir() { std::filesystem::remove_all(path); }
  };
  static const Dir d;
  const std::string& dir = d.path;
  const std::string out = dir + "/stories260K-" + type + ".llmq";
  const std::string cmd = bin("llmq-convert") + " " + shared("models/stories260K/stories260K.bin") + " --tokenizer " +
                          shared("models/stories260K/tok512.bin") + " --type " + type + " -o " + out + " -f 2>/dev/null";
  if (run(cmd) != 0) throw std::runtime_error("conversion failed: " + cmd);
  return done[type] = out;
}

}  // namespace llmq::test
