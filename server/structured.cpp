#include "server/structured.h"

#include <algorithm>

#include "base/error.h"
#include "text/tokenizer.h"

#ifdef LLMQ_HAVE_XGRAMMAR
#include <xgrammar/xgrammar.h>
#endif

namespace llmq {

#ifdef LLMQ_HAVE_XGRAMMAR

namespace {

// One request's matcher: the mask of its state, advanced token by token.
class GrammarConstraint : public TokenConstraint {
 public:
  explicit GrammarConstraint(const xgrammar::CompiledGrammar& g, int vocab) : matcher_(g), vocab_(vocab) {}
  bool fill_mask(uint32_t* mask) override {
    int64_t shape = xgrammar::GetBitmaskSize(vocab_);
    DLTensor t{};
    t.data = mask;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = xgrammar::GetBitmaskDLType();
    t.shape = &shape;
    return matcher_.FillNextTokenBitmask(&t);
  }
  bool accept(int32_t id) override { return matcher_.AcceptToken(id); }
  // True when the current state allows some token (a grammar whose language is empty, such as
  // `root ::= item  item ::= root ")"`, compiles but allows nothing).
  bool allows_some_token() {
    std::vector<uint32_t> mask(size_t(xgrammar::GetBitmaskSize(vocab_)));
    if (!fill_mask(mask.data())) return true;
    for (int i = 0; i < vocab_; ++i)
      if (mask[size_t(i) / 32] >> (i % 32) & 1u) return true;
    return false;
  }

 private:
  xgrammar::GrammarMatcher matcher_;
  int vocab_;
};

// `text` as an EBNF string literal.
std::string ebnf_literal(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else out += c;
  }
  return out + "\"";
}

// The schema's JSON, with the format's literal prefix and suffix around it.
xgrammar::Grammar wrapped_schema(const OutputFormat& f) {
  std::vector<xgrammar::Grammar> parts;
  if (!f.prefix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(f.prefix)));
  parts.push_back(xgrammar::Grammar::FromJSONSchema(f.spec, /*any_whitespace=*/false, std::nullopt, std::nullopt, f.strict));
  if (!f.suffix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(f.suffix)));
  return xgrammar::Grammar::Concat(parts);
}

xgrammar::TokenizerInfo tokenizer_info(const Tokenizer& tok, const std::vector<int32_t>& stop_ids) {
  std::vector<std::string> pieces(tok.n_vocab());
  // After a token that is not BOS, so SentencePiece's leading space is kept; control and unused
  // tokens decode to "" and count as special (never allowed by a grammar, stop ids aside).
  const int32_t after = tok.bos() == 0 ? 1 : 0;
  for (size_t i = 0; i < pieces.size(); ++i) pieces[i] = tok.decode_piece(after, int32_t(i));
  return xgrammar::TokenizerInfo(pieces, xgrammar::VocabType::RAW, int(pieces.size()), stop_ids, false);
}

}  // namespace

struct StructuredOutputs::Impl {
  Impl(const Tokenizer& tok, const std::vector<int32_t>& stop, size_t cache_bytes)
      : vocab(int(tok.n_vocab())),
        compiler(tokenizer_info(tok, stop), /*max_threads=*/2, /*cache_enabled=*/cache_bytes > 0,
                 /*max_memory_bytes=*/cache_bytes > 0 ? int64_t(std::min<size_t>(cache_bytes, size_t(1) << 40)) : -1) {}
  int vocab;
  xgrammar::GrammarCompiler compiler;
};

StructuredOutputs::StructuredOutputs(const Tokenizer& tok, const std::vector<int32_t>& stop_ids, size_t cache_bytes)
    : tok_(tok), stop_ids_(stop_ids), cache_bytes_(cache_bytes) {}

bool StructuredOutputs::available() { return true; }

std::shared_ptr<TokenConstraint> StructuredOutputs::constraint(const OutputFormat& f) {
  if (f.kind == OutputFormat::Kind::Text) return nullptr;
  try {
    std::lock_guard<std::mutex> lk(mu_);
    if (!impl_) impl_ = std::make_unique<Impl>(tok_, stop_ids_, cache_bytes_);
    // json_object is OpenAI's "any JSON object" (xgrammar's built-in grammar takes any value).
    const std::string schema = f.kind == OutputFormat::Kind::JsonObject ? std::string(R"({"type": "object"})") : f.spec;
    const bool wrapped = !f.prefix.empty() || !f.suffix.empty();
    xgrammar::CompiledGrammar g = f.kind == OutputFormat::Kind::Grammar ? impl_->compiler.CompileGrammar(f.spec, "root")
                                  : wrapped ? impl_->compiler.CompileGrammar(wrapped_schema(f))
                                            : impl_->compiler.CompileJSONSchema(schema, /*any_whitespace=*/false, std::nullopt,
                                                                                std::nullopt, f.strict);
    auto c = std::make_shared<GrammarConstraint>(g, impl_->vocab);
    if (!c->allows_some_token()) throw UsageError("it matches no output (no token of the vocabulary can start one)");
    return c;
  } catch (const std::exception& e) {
    // xgrammar's messages start "[hh:mm:ss] /path/file.cc:123: "; the reason follows.
    std::string what = e.what();
    if (const size_t at = what.find(".cc:"); at != std::string::npos)
      if (const size_t colon = what.find(": ", at); colon != std::string::npos) what.erase(0, colon + 2);
    if (const size_t nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw UsageError(std::string(f.kind == OutputFormat::Kind::Grammar ? "grammar" : "JSON schema") + ": " + what);
  }
}

#else  // no grammar engine in this build

struct StructuredOutputs::Impl {};
StructuredOutputs::StructuredOutputs(const Tokenizer& tok, const std::vector<int32_t>& stop_ids, size_t cache_bytes)
    : tok_(tok), stop_ids_(stop_ids), cache_bytes_(cache_bytes) {}
bool StructuredOutputs::available() { return false; }
std::shared_ptr<TokenConstraint> StructuredOutputs::constraint(const OutputFormat& f) {
  if (f.kind == OutputFormat::Kind::Text) return nullptr;
  throw UsageError("structured outputs need xgrammar, which this build lacks (run scripts/fetch_xgrammar.sh and rebuild)");
}

#endif

StructuredOutputs::~StructuredOutputs() = default;

}  // namespace llmq
