// Hugging Face checkpoints ([hf]): safetensors, config.json, tokenizer files, through the real
// llmq-convert.
//
//  * stories260K-hf (../shared: the stories260K weights in HF layout, F32, q/k rows permuted
//    as HF's Llama conversion does, tied) converts to a model whose logits equal the llama2.c
//    route's within 1e-5 (16 positions of the golden sequence) and whose 64 greedy tokens are
//    the same;
//  * a BF16 copy in two shards + model.safetensors.index.json, written by the safetensors
//    library itself (tests/make_bf16_sharded.py, in a venv made here; skipped with a warning
//    when pip cannot install the packages), converts as BF16 and stays close to the F32 route;
//  * a hand-written byte-level BPE tokenizer.json + tokenizer_config.json +
//    generation_config.json are carried into the .llmq (vocabulary, merges, special ids,
//    chat template), and the reader's variants (merges as pairs, template lists, Llama-3 and
//    Qwen2 regexes, a SentencePiece tokenizer.model) are read as documented;
//  * attention biases (Qwen2 q/k/v; Llama attention_bias with o) convert and the engine's
//    logits equal an independent NumPy forward pass (tests/ref_llama_numpy.py) within 1e-5,
//    the reference itself checked against the golden logits;
//  * 40 hostile directories (bad safetensors headers, offsets, dtypes, shapes, shards, index,
//    config.json and tokenizer files) make llmq-convert exit 2 with one message naming the
//    file at fault, never crash or hang, and leave no output behind.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/model.h"
#include "engine/sampler.h"
#include "base/error.h"
#include "formats/readers/hf_model.h"
#include "formats/readers/hf_tokenizer.h"
#include "formats/llmq_file.h"
#include "formats/quant.h"
#include "formats/readers/safetensors.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Bytes = std::vector<uint8_t>;
using llmq::test::shared;

const std::string& hf_dir() {
  static const std::string d = shared("models/stories260K-hf");
  return d;
}
const std::string& tok512() {
  static const std::string t = shared("models/stories260K/tok512.bin");
  return t;
}

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}
void write_text(const std::string& path, const std::string& s) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << s;
}
bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

// ------------------------------------------------------------------ running the real tool

using llmq::test::ToolRun;
using llmq::test::run_tool;

ToolRun convert(const std::string& dir, const std::string& out, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv{llmq::test::bin("llmq-convert"), dir, "-o", out, "--no-progress"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run_tool(argv);
}

// ------------------------------------------------------------------ running the model

const json& golden() {
  static const json j = [] {
    std::ifstream in(shared("reference/stories260K_golden.json"));
    return json::parse(in);
  }();
  return j;
}
std::vector<int32_t> golden_ids() { return golden()["greedy_token_ids"].get<std::vector<int32_t>>(); }

// Logits [16, vocab] of the first 16 golden positions, as one prefill batch.
// A venv with safetensors and numpy (made once per test run), for the tests that use those
// libraries as independent writers/references; "" (with a warning) when pip cannot get them.
std::string python_venv() {
  static const std::string venv = [] {
    const std::string dir = llmq::test::scratch("hf_venv"), v = dir + "/venv", log = dir + "/pip.log";
    const int rc = llmq::test::run("python3 -m venv --system-site-packages " + v + " >" + log + " 2>&1 && timeout 90 " +
                                   v + "/bin/pip install --disable-pip-version-check -q --timeout 15 --retries 1 "
                                       "safetensors numpy >>" + log + " 2>&1");
    if (rc == 0) return v;
    const Bytes pip_log = read_bytes(log);
    WARN("skipped: could not make a venv with safetensors and numpy (no network?); pip said:\n"
         << std::string(pip_log.begin(), pip_log.end()));
    return std::string();
  }();
  return venv;
}

std::vector<float> logits16(const llmq::Model& m) {
  llmq::ThreadPool pool(2);
  llmq::Session s(m, pool, 64);
  const auto ids = golden_ids();
  const float* l = s.forward(ids.data(), 16, /*all_logits=*/true);
  return std::vector<float>(l, l + 16 * m.config.vocab_size);
}

// Greedy decode from BOS, n tokens in all (BOS included).
std::vector<int32_t> greedy(const llmq::Model& m, int64_t n) {
  llmq::ThreadPool pool(2);
  llmq::Session s(m, pool, n);
  std::vector<int32_t> ids{m.vocab.bos_id};
  while (int64_t(ids.size()) < n) {
    const float* logits = s.forward(&ids.back(), 1);
    ids.push_back(llmq::Sampler::argmax(logits, m.config.vocab_size));
  }
  return ids;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
  return worst;
}
double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d2 += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r2 += double(ref[i]) * ref[i];
  }
  return std::sqrt(d2 / r2);
}

// stories260K-hf converted by the real tool (F32, as stored), once per run.
const std::string& hf_f32() {
  static const std::string out = [] {
    const std::string o = llmq::test::scratch("hf_f32") + "/stories260K-hf.llmq";
    const ToolRun r = convert(hf_dir(), o, {"--tokenizer", tok512()});
    if (!r.exited || r.code != 0) throw std::runtime_error("conversion of stories260K-hf failed: " + r.describe());
    WARN("llmq-convert stories260K-hf (F32, 1 file): peak RSS " << r.max_rss_kib << " KiB");
    return o;
  }();
  return out;
}

// ------------------------------------------------------------------ writing checkpoints

// A safetensors file taken apart: its header (JSON) and its byte buffer.
struct StImage {
  json header;
  Bytes data;

  static StImage load(const std::string& path) {
    const Bytes b = read_bytes(path);
    uint64_t n = 0;
    std::memcpy(&n, b.data(), 8);
    StImage im;
    im.header = json::parse(b.begin() + 8, b.begin() + 8 + long(n));
    im.data.assign(b.begin() + 8 + long(n), b.end());
    return im;
  }
  // The file with `header_text` as its header (length field `len` unless overridden).
  Bytes bytes_with(const std::string& header_text, std::optional<uint64_t> len = std::nullopt) const {
    Bytes b(8 + header_text.size() + data.size());
    const uint64_t n = len ? *len : header_text.size();
    std::memcpy(b.data(), &n, 8);
    std::memcpy(b.data() + 8, header_text.data(), header_text.size());
    if (!data.empty()) std::memcpy(b.data() + 8 + header_text.size(), data.data(), data.size());
    return b;
  }
  Bytes bytes() const { return bytes_with(header.dump()); }
  void save(const std::string& path) const { write_bytes(path, bytes()); }
  // Appends a tensor to the buffer.
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape, const Bytes& bytes) {
    const uint64_t begin = data.size();
    data.insert(data.end(), bytes.begin(), bytes.end());
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  }
};

const StImage& original() {
  static const StImage im = StImage::load(hf_dir() + "/model.safetensors");
  return im;
}

// A checkpoint directory: config.json and generation_config.json as in stories260K-hf, and
// model.safetensors from `im` (none when im is null).
std::string make_dir(const std::string& dir, const StImage* im) {
  fs::create_directories(dir);
  fs::copy_file(hf_dir() + "/config.json", dir + "/config.json", fs::copy_options::overwrite_existing);
  fs::copy_file(hf_dir() + "/generation_config.json", dir + "/generation_config.json",
                fs::copy_options::overwrite_existing);
  fs::permissions(dir + "/generation_config.json", fs::perms::owner_write, fs::perm_options::add);
  if (im) im->save(dir + "/model.safetensors");
  return dir;
}

json config_json() {
  std::ifstream in(hf_dir() + "/config.json");
  return json::parse(in);
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others (control, space,
// DEL, NBSP, soft hyphen, ...) for U+0100 + their rank among the non-printable bytes. UTF-8.
std::string byte_char(int b) {
  auto printable = [](int x) { return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255); };
  int cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int x = 0; x < b; ++x) cp += !printable(x);
  }
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

const char* kChatML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// A tiny byte-level BPE tokenizer.json (SmolLM-style pre-tokenizer): ids 0-255 the bytes, 256-259
// four merges' results, 260 <|im_start|> and 261 <|im_end|> (special), 262 <tool> (not special).
json tiny_tokenizer_json(bool merges_as_pairs = false) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  const std::string G = byte_char(' ');  // "Ġ"
  vocab[G + "t"] = 256;
  vocab["he"] = 257;
  vocab[G + "the"] = 258;
  vocab["in"] = 259;
  json merges = json::array();
  const std::vector<std::pair<std::string, std::string>> m{{G, "t"}, {"h", "e"}, {G + "t", "he"}, {"i", "n"}};
  for (const auto& [a, b] : m) merges.push_back(merges_as_pairs ? json::array({a, b}) : json(a + " " + b));
  json added = json::array();
  added.push_back({{"id", 260}, {"content", "<|im_start|>"}, {"special", true}, {"normalized", false}});
  added.push_back({{"id", 261}, {"content", "<|im_end|>"}, {"special", true}, {"normalized", false}});
  added.push_back({{"id", 262}, {"content", "<tool>"}, {"special", false}, {"normalized", false}});
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Digits"}, {"individual_digits", true}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}}}}},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
        {"vocab", vocab}, {"merges", merges}}},
  };
}

std::vector<std::string> tiny_merges() {
  const std::string G = byte_char(' ');
  return {G + " t", "h e", G + "t he", "i n"};
}

// A directory with the stories260K-hf weights (linked) and the tiny tokenizer files.
std::string make_tokenizer_dir(const std::string& dir) {
  make_dir(dir, nullptr);
  fs::create_symlink(hf_dir() + "/model.safetensors", dir + "/model.safetensors");
  write_text(dir + "/tokenizer.json", tiny_tokenizer_json().dump(2));
  write_text(dir + "/tokenizer_config.json",
             json{{"add_bos_token", false},
                  {"bos_token", "<|im_start|>"},
                  {"eos_token", {{"content", "<|im_end|>"}, {"special", true}}},
                  {"pad_token", "<|im_end|>"},
                  {"unk_token", nullptr},
                  {"chat_template", kChatML}}
                 .dump(2));
  write_text(dir + "/generation_config.json", R"({"bos_token_id": 260, "eos_token_id": 261})");
  return dir;
}

std::vector<std::string> tmp_siblings(const std::string& out) {
  std::vector<std::string> v;
  const std::string stem = "." + fs::path(out).filename().string() + ".tmp";
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    if (e.path().filename().string().rfind(stem, 0) == 0) v.push_back(e.path().string());
  return v;
}

}  // namespace

// ================================================================== real weights

TEST_CASE("hf: stories260K-hf gives the llama2.c route's logits (1e-5) and greedy tokens", "[hf]") {
  auto hf = llmq::Model::load(hf_f32());
  auto ref = llmq::Model::load(llmq::test::stories("f32"));
  const llmq::Metadata& meta = hf->file->meta();
  CHECK(meta.get_string("llama.rope.layout") == "rotate_half");
  CHECK(meta.get_bool("llama.tied_embeddings", false));
  CHECK(contains(meta.get_string("general.source.format"), "Hugging Face safetensors (llama, F32, 1 file)"));
  CHECK(meta.get_string("general.source.file") == "stories260K-hf");  // the checkpoint directory's name, no path
  CHECK(hf->file->find("output.weight") == nullptr);
  for (const auto& t : hf->file->tensors()) CHECK(t.type == llmq::DType::F32);
  CHECK(hf->config.dim == 64);
  CHECK(hf->config.n_kv_heads == 4);
  CHECK(hf->config.context_length == 512);

  const auto a = logits16(*hf), b = logits16(*ref);
  const double d = max_abs_diff(a, b);
  WARN("stories260K-hf vs llama2.c route, 16 positions: max |logit diff| = " << d);
  CHECK(d < 1e-5);
  const auto rows = golden()["logits_first16"];
  double g = 0;
  for (size_t p = 0; p < 16; ++p)
    for (size_t v = 0; v < 512; ++v) g = std::max(g, std::fabs(double(a[p * 512 + v]) - rows[p][v].get<double>()));
  CHECK(g < 1e-4);

  const auto ga = greedy(*hf, 64), gb = greedy(*ref, 64);
  CHECK(ga == gb);
  const auto want = golden_ids();
  CHECK(ga == std::vector<int32_t>(want.begin(), want.begin() + 64));
}

TEST_CASE("hf: a BF16 copy in two shards (written by the safetensors library) converts and stays close", "[hf]") {
  const std::string dir = llmq::test::scratch("hf_bf16");
  const std::string venv = python_venv(), log = dir + "/py.log";
  if (venv.empty()) return;
  const std::string script = (fs::path(__FILE__).parent_path() / "make_bf16_sharded.py").string();
  const std::string sharded = dir + "/stories260K-hf-bf16";
  REQUIRE(llmq::test::run(venv + "/bin/python " + script + " " + hf_dir() + " " + sharded + " >>" + log + " 2>&1") == 0);
  REQUIRE(fs::exists(sharded + "/model-00001-of-00002.safetensors"));
  REQUIRE(fs::exists(sharded + "/model-00002-of-00002.safetensors"));
  REQUIRE_FALSE(fs::exists(sharded + "/model.safetensors"));
  {  // the library's files, as our reader sees them
    auto s1 = llmq::SafetensorsFile::open(sharded + "/model-00001-of-00002.safetensors");
    auto s2 = llmq::SafetensorsFile::open(sharded + "/model-00002-of-00002.safetensors");
    CHECK(s1->tensors().size() + s2->tensors().size() == 47);
    CHECK(s1->metadata().at("format") == "pt");
    for (const auto& t : s1->tensors()) CHECK(t.dtype == "BF16");
  }

  const std::string out = dir + "/bf16.llmq";
  const ToolRun r = convert(sharded, out, {"--tokenizer", tok512()});
  INFO(r.describe());
  REQUIRE(r.exited);
  REQUIRE(r.code == 0);
  WARN("llmq-convert BF16 sharded copy (2 shards): peak RSS " << r.max_rss_kib << " KiB");

  auto bf = llmq::Model::load(out);
  CHECK(contains(bf->file->meta().get_string("general.source.format"), "(llama, BF16, 2 shards)"));
  for (const auto& t : bf->file->tensors()) {
    INFO(t.name);
    CHECK(t.type == (t.shape.size() == 1 ? llmq::DType::F32 : llmq::DType::BF16));
  }
  auto f32 = llmq::Model::load(hf_f32());
  const auto a = logits16(*bf), ref = logits16(*f32);
  const double rel = rel_l2(a, ref), worst = max_abs_diff(a, ref);
  double ref_max = 0;
  for (float x : ref) ref_max = std::max(ref_max, std::fabs(double(x)));
  const auto ga = greedy(*bf, 32), gr = greedy(*f32, 32);
  int same = 0, prefix = 0;
  for (size_t i = 0; i < 32; ++i) same += ga[i] == gr[i];
  while (prefix < 32 && ga[size_t(prefix)] == gr[size_t(prefix)]) ++prefix;
  WARN("BF16 sharded vs F32: logits rel. L2 error " << rel << ", max |diff| " << worst << " (max |logit| " << ref_max
                                                    << "); greedy: " << same << "/32 tokens equal, first "
                                                    << prefix << " identical");
  CHECK(rel < 2e-2);
  CHECK(worst < 2e-2 * ref_max);
  CHECK(same >= 24);

  // The same shards through read() (BF16 -> fp32 is exact): equal to the raw copy.
  const std::string out32 = dir + "/bf16-as-f32.llmq";
  REQUIRE(convert(sharded, out32, {"--tokenizer", tok512(), "--type", "f32"}).code == 0);
  auto bf32 = llmq::Model::load(out32);
  for (const auto& t : bf32->file->tensors()) CHECK(t.type == llmq::DType::F32);
  CHECK(max_abs_diff(logits16(*bf32), a) < 1e-5);
}

TEST_CASE("hf: F16 tensors are offered raw and read() converts them exactly", "[hf]") {
  const StImage& orig = original();
  StImage im;
  im.header["__metadata__"] = {{"format", "pt"}};
  std::map<std::string, std::vector<float>> want;
  for (auto it = orig.header.begin(); it != orig.header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const uint64_t b = it.value()["data_offsets"][0].get<uint64_t>(), e = it.value()["data_offsets"][1].get<uint64_t>();
    std::vector<float> x((e - b) / 4);
    std::memcpy(x.data(), orig.data.data() + b, e - b);
    Bytes h(x.size() * 2);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t v = llmq::fp32_to_fp16(x[i]);
      std::memcpy(h.data() + 2 * i, &v, 2);
      x[i] = llmq::fp16_to_fp32(v);
    }
    im.add(it.key(), "F16", it.value()["shape"].get<std::vector<int64_t>>(), h);
    want[it.key()] = x;
  }
  // A tied checkpoint that stores lm_head anyway (some exports do): the copy is ignored.
  im.add("lm_head.weight", "F16", {512, 64},
         Bytes(im.data.begin() + long(im.header["model.embed_tokens.weight"]["data_offsets"][0].get<uint64_t>()),
               im.data.begin() + long(im.header["model.embed_tokens.weight"]["data_offsets"][1].get<uint64_t>())));
  const std::string dir = make_dir(llmq::test::scratch("hf_f16") + "/model", &im);
  {  // untied: lm_head.weight becomes output.weight, last in the table
    const std::string untied = make_dir(llmq::test::scratch("hf_f16_untied") + "/model", &im);
    json cfg = config_json();
    cfg["tie_word_embeddings"] = false;
    write_text(untied + "/config.json", cfg.dump());
    const llmq::SourceModel u = llmq::read_hf_model(untied);
    REQUIRE(u.tensors.size() == 48);
    CHECK(u.tensors.back().name == "output.weight");
    CHECK_FALSE(u.config.tied_embeddings);
    std::vector<float> out(512 * 64);
    u.tensors.back().read(out.data());
    CHECK(out == want.at("model.embed_tokens.weight"));
  }
  const llmq::SourceModel sm = llmq::read_hf_model(dir);
  CHECK(sm.format == "Hugging Face safetensors (llama, F16, 1 file)");
  REQUIRE(sm.tensors.size() == 47);
  CHECK(sm.config.rope_layout == llmq::RopeLayout::RotateHalf);
  CHECK_FALSE(sm.has_vocab);
  const std::map<std::string, std::string> hf_names{{"token_embd.weight", "model.embed_tokens.weight"},
                                                    {"blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"},
                                                    {"blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"},
                                                    {"output_norm.weight", "model.norm.weight"}};
  int checked = 0;
  for (const llmq::SourceTensor& t : sm.tensors) {
    CHECK(t.raw_type == llmq::DType::F16);
    CHECK(t.raw != nullptr);
    auto it = hf_names.find(t.name);
    if (it == hf_names.end()) continue;
    std::vector<float> got(size_t(t.numel()));
    t.read(got.data());
    CHECK(got == want.at(it->second));
    ++checked;
  }
  CHECK(checked == 4);

  const std::string out = dir + "/../f16.llmq";
  const ToolRun r = convert(dir, out, {"--tokenizer", tok512()});
  INFO(r.describe());
  REQUIRE(r.code == 0);
  auto m = llmq::Model::load(out);
  for (const auto& t : m->file->tensors()) CHECK(t.type == (t.shape.size() == 1 ? llmq::DType::F32 : llmq::DType::F16));
  auto f32 = llmq::Model::load(hf_f32());
  const auto a = logits16(*m), ref = logits16(*f32);
  WARN("F16 copy vs F32: logits rel. L2 error " << rel_l2(a, ref));
  CHECK(rel_l2(a, ref) < 2e-3);
}

TEST_CASE("hf: hf_checkpoint_xxh64 hashes the checkpoint files of a directory", "[hf]") {
  const std::string h = llmq::hf_checkpoint_xxh64(hf_dir());
  CHECK(h.size() == 16);
  CHECK(h == llmq::hf_checkpoint_xxh64(hf_dir()));
  const std::string dir = llmq::test::scratch("hf_hash");
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
    fs::copy_file(hf_dir() + "/" + f, dir + "/" + f);
  write_text(dir + "/README.md", "not hashed");
  CHECK(llmq::hf_checkpoint_xxh64(dir) == h);
  fs::permissions(dir + "/config.json", fs::perms::owner_write, fs::perm_options::add);
  {
    std::ofstream(dir + "/config.json", std::ios::app) << " ";
  }
  CHECK(llmq::hf_checkpoint_xxh64(dir) != h);
}

TEST_CASE("hf: config.json variants (Mistral sliding window, architectures without model_type)", "[hf]") {
  const std::string dir = llmq::test::scratch("hf_config") + "/model";
  make_dir(dir, nullptr);
  fs::create_symlink(hf_dir() + "/model.safetensors", dir + "/model.safetensors");
  json cfg = config_json();
  cfg["model_type"] = "mistral";
  cfg["sliding_window"] = 256;
  cfg["head_dim"] = nullptr;  // null: hidden_size / num_attention_heads
  write_text(dir + "/config.json", cfg.dump());
  llmq::SourceModel sm = llmq::read_hf_model(dir);
  CHECK(sm.config.sliding_window == 256);  // every layer (was: the context cut to the window)
  CHECK(sm.config.is_sliding(0));
  CHECK(sm.config.head_dim == 8);
  CHECK(sm.format == "Hugging Face safetensors (mistral, F32, 1 file)");

  cfg = config_json();
  cfg.erase("model_type");
  cfg.erase("rope_theta");  // default 10000
  write_text(dir + "/config.json", cfg.dump());
  sm = llmq::read_hf_model(dir);
  CHECK(sm.format == "Hugging Face safetensors (llama, F32, 1 file)");
  CHECK(sm.config.rope_theta == 10000.0);
  CHECK(sm.config.norm_eps == 1e-5);
  CHECK(sm.config.tied_embeddings);
  CHECK(sm.tensors.size() == 47);
}

// ================================================================== tokenizer files

TEST_CASE("hf: tokenizer.json, tokenizer_config.json and generation_config.json go into the .llmq", "[hf]") {
  const std::string dir = make_tokenizer_dir(llmq::test::scratch("hf_tok") + "/model");
  const std::string out = llmq::test::scratch("hf_tok_out") + "/tok.llmq";
  const ToolRun r = convert(dir, out);  // no --tokenizer: the directory's own
  INFO(r.describe());
  REQUIRE(r.exited);
  REQUIRE(r.code == 0);

  auto f = llmq::LlmqFile::open(out);
  const llmq::Metadata& m = f->meta();
  CHECK(m.get_string("tokenizer.model") == "gpt2");
  CHECK(m.get_string("tokenizer.pre") == "smollm");
  CHECK(m.get_string("tokenizer.chat_template") == kChatML);
  CHECK(m.get_string_array("tokenizer.merges") == tiny_merges());
  const auto& tokens = m.get_string_array("tokenizer.tokens");
  const auto& types = m.get_i32_array("tokenizer.token_type");
  REQUIRE(tokens.size() == 512);  // padded to config.json's vocab_size
  CHECK(tokens[32] == "\xC4\xA0");  // "Ġ", GPT-2's space
  CHECK(tokens[65] == "A");
  CHECK(tokens[258] == "\xC4\xA0the");
  CHECK(tokens[260] == "<|im_start|>");
  CHECK(tokens[261] == "<|im_end|>");
  CHECK(tokens[262] == "<tool>");
  CHECK(tokens[300] == "[PAD300]");
  CHECK(types[65] == int32_t(llmq::TokenType::Normal));
  CHECK(types[260] == int32_t(llmq::TokenType::Control));
  CHECK(types[261] == int32_t(llmq::TokenType::Control));
  CHECK(types[262] == int32_t(llmq::TokenType::UserDefined));
  CHECK(types[300] == int32_t(llmq::TokenType::Unused));
  CHECK(m.get_int("tokenizer.bos_token_id") == 260);
  CHECK(m.get_int("tokenizer.eos_token_id") == 261);
  CHECK(m.get_int("tokenizer.eot_token_id") == 261);
  CHECK(m.get_int("tokenizer.padding_token_id") == 261);
  CHECK(m.get_int("tokenizer.unknown_token_id") == -1);
  CHECK_FALSE(m.get_bool("tokenizer.add_bos_token", true));
  CHECK_FALSE(m.get_bool("tokenizer.add_space_prefix", true));

  // The engine takes the vocabulary as it is: " the in" is "Ġthe" (merges 0, 1, 2) then "Ġ",
  // "in" (merge 3).
  auto model = llmq::Model::load(out);
  const std::vector<int32_t> ids = model->tokenizer->encode(" the in", false);
  CHECK(ids == std::vector<int32_t>{258, 32, 259});
  CHECK(model->tokenizer->decode(ids) == " the in");
  CHECK(model->chat_template == kChatML);
}

TEST_CASE("hf: llmq-run takes a checkpoint directory through one cached conversion", "[hf][tools]") {
  const std::string dir = make_tokenizer_dir(llmq::test::scratch("hf_cache") + "/model");
  const std::string work = llmq::test::scratch("hf_cache_work"), out = work + "/tok.llmq", cache = work + "/cache";
  REQUIRE(convert(dir, out).code == 0);
  auto run = [&](const std::string& model, const std::string& tag) {
    const llmq::test::CachedRun r = llmq::test::run_with_cache(cache, model, "the thin", 8, work + "/" + tag);
    return std::make_tuple(r.code, r.out, r.err);
  };
  const auto [c0, want, e0] = run(out, "file");
  REQUIRE(c0 == 0);
  const auto [c1, first, e1] = run(dir, "dir");
  INFO(e1);
  REQUIRE(c1 == 0);
  CHECK(first == want);
  CHECK(e1.find("converted") != std::string::npos);
  const auto [c2, second, e2] = run(dir + "/", "again");  // the same directory, spelled with a slash
  CHECK(c2 == 0);
  CHECK(second == want);
  CHECK(e2.find("converted") == std::string::npos);
  CHECK(llmq::test::files_with_extension(cache, ".llmq") == 1);
}

TEST_CASE("hf: tokenizer reader variants (pre-tokenizer regexes, merge pairs, template lists, tokenizer.model)", "[hf]") {
  SECTION("pre-tokenizer names") {
    const std::string llama3 =
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    const std::string qwen2 =
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    auto split_then_bytelevel = [](const std::string& re) {
      return json{{"type", "Sequence"},
                  {"pretokenizers",
                   {{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    };
    CHECK(llmq::hf_pre_tokenizer_name(json{{"type", "ByteLevel"}, {"add_prefix_space", false}}) == "gpt2");
    CHECK(llmq::hf_pre_tokenizer_name(tiny_tokenizer_json()["pre_tokenizer"]) == "smollm");
    CHECK(llmq::hf_pre_tokenizer_name(split_then_bytelevel(llama3)) == "llama-bpe");
    CHECK(llmq::hf_pre_tokenizer_name(split_then_bytelevel(qwen2)) == "qwen2");
    CHECK(llmq::hf_pre_tokenizer_name(split_then_bytelevel("\\s+")) == "default");
    CHECK(llmq::hf_pre_tokenizer_name(json{{"type", "Metaspace"}}) == "default");
    CHECK(llmq::hf_pre_tokenizer_name(json()) == "default");
  }
  SECTION("merges as pairs, a list of templates, Llama-3-style EOS list, BOS from the post-processor") {
    const std::string dir = llmq::test::scratch("hf_tok_variants");
    json tj = tiny_tokenizer_json(/*merges_as_pairs=*/true);
    tj["post_processor"] = {
        {"type", "Sequence"},
        {"processors",
         {{{"type", "ByteLevel"}},
          {{"type", "TemplateProcessing"},
           {"single", {{{"SpecialToken", {{"id", "<|im_start|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}}}}};
    write_text(dir + "/tokenizer.json", tj.dump());
    write_text(dir + "/tokenizer_config.json",
               json{{"chat_template", {{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}}}}
                   .dump());
    write_text(dir + "/generation_config.json", R"({"eos_token_id": [5, 261, 7]})");
    const llmq::HfTokenizer t = llmq::read_hf_tokenizer(dir, json::object(), 263);
    REQUIRE(t.found);
    CHECK(t.source == dir + "/tokenizer.json");
    CHECK(t.vocab.merges == tiny_merges());
    CHECK(t.chat_template == "D");
    CHECK(t.vocab.eos_id == 5);
    CHECK(t.vocab.eot_id == 261);
    CHECK(t.vocab.bos_id == 260);  // from the TemplateProcessing special token
    CHECK(t.vocab.add_bos);
    CHECK(t.vocab.size() == 263);
  }
  SECTION("chat_template.jinja beside a config without a template") {
    const std::string dir = llmq::test::scratch("hf_tok_jinja");
    write_text(dir + "/tokenizer.json", tiny_tokenizer_json().dump());
    write_text(dir + "/chat_template.jinja", "J{{ x }}");
    const llmq::HfTokenizer t = llmq::read_hf_tokenizer(dir, json{{"eos_token_id", 261}}, 300);
    CHECK(t.chat_template == "J{{ x }}");
    CHECK(t.vocab.eos_id == 261);
    CHECK(t.vocab.size() == 300);
  }
  SECTION("a SentencePiece tokenizer.model") {
    const std::string dir = llmq::test::scratch("hf_tok_spm");
    fs::create_symlink(shared("tokenizers/llama2/tokenizer.model"), dir + "/tokenizer.model");
    write_text(dir + "/tokenizer_config.json", R"({"add_bos_token": false, "bos_token": {"content": "<s>"}})");
    const llmq::HfTokenizer t = llmq::read_hf_tokenizer(dir, json::object(), 32000);
    REQUIRE(t.found);
    CHECK(t.vocab.model == "llama");
    CHECK(t.vocab.size() == 32000);
    CHECK(t.vocab.bos_id == 1);
    CHECK(t.vocab.eos_id == 2);
    CHECK_FALSE(t.vocab.add_bos);
    CHECK(t.chat_template.empty());
  }
  SECTION("no tokenizer file") {
    const llmq::HfTokenizer t = llmq::read_hf_tokenizer(llmq::test::scratch("hf_tok_none"), json::object(), 512);
    CHECK_FALSE(t.found);
  }
}

// ================================================================== attention biases

// The NumPy reference (tests/ref_llama_numpy.py, float64) on `dir`: logits [16, vocab] for the
// first 16 golden tokens.
std::vector<float> numpy_logits16(const std::string& venv, const std::string& dir) {
  const auto ids = golden_ids();
  std::string list;
  for (size_t i = 0; i < 16; ++i) {
    if (i) list += ',';
    list += std::to_string(ids[i]);
  }
  const std::string script = (fs::path(__FILE__).parent_path() / "ref_llama_numpy.py").string();
  const std::string out = dir + "/numpy_logits.f32", log = dir + "/numpy.log";
  const int rc = llmq::test::run(venv + "/bin/python " + script + " " + dir + " " + list + " " + out + " >" + log + " 2>&1");
  const Bytes err = read_bytes(log);
  INFO(std::string(err.begin(), err.end()));
  REQUIRE(rc == 0);
  const Bytes b = read_bytes(out);
  REQUIRE(b.size() == 16 * 512 * sizeof(float));
  std::vector<float> v(16 * 512);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

TEST_CASE("hf: attention biases (Qwen2 q/k/v - Llama attention_bias q/k/v/o) match a NumPy reference", "[hf]") {
  const std::string venv = python_venv();
  if (venv.empty()) return;

  // The reference itself, on the checkpoint without biases: the golden logits (llama2.c's run.c).
  {
    const auto np = numpy_logits16(venv, make_dir(llmq::test::scratch("hf_bias_plain"), &original()));
    const auto rows = golden()["logits_first16"];
    double g = 0;
    for (size_t p = 0; p < 16; ++p)
      for (size_t v = 0; v < 512; ++v) g = std::max(g, std::fabs(double(np[p * 512 + v]) - rows[p][v].get<double>()));
    WARN("NumPy reference vs llama2.c golden logits (no biases): max |diff| " << g);
    REQUIRE(g < 1e-4);
  }
  const auto plain = logits16(*llmq::Model::load(hf_f32()));

  struct Case {
    std::string label, model_type;
    bool with_o;  // Llama's attention_bias also biases o_proj; Qwen2 does not
  };
  for (const Case& k : {Case{"qwen2", "qwen2", false}, Case{"llama", "llama", true}}) {
    INFO(k.label);
    // Fresh random biases (seeded per case), about the size of the projections' outputs.
    std::mt19937 rng(k.with_o ? 7 : 3);
    std::normal_distribution<float> nd(0.0f, 0.3f);
    auto random_bias = [&](int64_t n) {
      Bytes b(size_t(n) * 4);
      for (int64_t i = 0; i < n; ++i) {
        const float x = nd(rng);
        std::memcpy(b.data() + i * 4, &x, 4);
      }
      return b;
    };
    StImage im = original();
    for (int l = 0; l < 5; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
      im.add(p + "q_proj.bias", "F32", {64}, random_bias(64));
      im.add(p + "k_proj.bias", "F32", {32}, random_bias(32));
      im.add(p + "v_proj.bias", "F32", {32}, random_bias(32));
      if (k.with_o) im.add(p + "o_proj.bias", "F32", {64}, random_bias(64));
    }
    const std::string dir = make_dir(llmq::test::scratch("hf_bias_" + k.label), &im);
    json cfg = config_json();
    cfg["model_type"] = k.model_type;
    if (k.with_o) cfg["attention_bias"] = true;
    write_text(dir + "/config.json", cfg.dump());

    const std::string out = dir + "/bias.llmq";
    const ToolRun r = convert(dir, out, {"--tokenizer", tok512()});
    INFO(r.describe());
    REQUIRE(r.code == 0);
    auto m = llmq::Model::load(out);
    CHECK(m->config.attn_qkv_bias);
    CHECK(m->config.attn_out_bias == k.with_o);
    CHECK(m->file->find("blk.4.attn_v.bias") != nullptr);
    CHECK((m->file->find("blk.0.attn_output.bias") != nullptr) == k.with_o);

    const auto ours = logits16(*m), ref = numpy_logits16(venv, dir);
    const double rel = rel_l2(ours, ref), moved = rel_l2(plain, ref);
    WARN(k.label << " biases: engine vs NumPy rel. L2 " << rel << " (the biases move the logits by " << moved << ")");
    CHECK(moved > 1e-2);  // the biases matter...
    CHECK(rel < 1e-5);    // ...and the engine applies them as the reference does
  }

  SECTION("a layer without its bias is refused") {
    StImage im = original();
    for (int l = 0; l < 4; ++l) {  // layer 4 has none
      const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
      im.add(p + "q_proj.bias", "F32", {64}, Bytes(256));
      im.add(p + "k_proj.bias", "F32", {32}, Bytes(128));
      im.add(p + "v_proj.bias", "F32", {32}, Bytes(128));
    }
    const std::string dir = make_dir(llmq::test::scratch("hf_bias_missing"), &im);
    const std::string out = dir + "/m.llmq";
    const ToolRun r = convert(dir, out, {"--tokenizer", tok512()});
    INFO(r.describe());
    CHECK(r.code == 2);
    CHECK(contains(r.err, "model.layers.4.self_attn.q_proj.bias"));
    CHECK(contains(r.err, "is missing"));
    CHECK_FALSE(fs::exists(out));
  }
}

// ================================================================== hostile inputs

TEST_CASE("hf: hostile checkpoint directories make llmq-convert exit 2 naming the file", "[hf]") {
  const std::string root = llmq::test::scratch("hf_hostile");
  const StImage& orig = original();
  const std::string emb = "model.embed_tokens.weight", up2 = "model.layers.2.mlp.up_proj.weight";
  const std::string q0 = "model.layers.0.self_attn.q_proj.weight", k0 = "model.layers.0.self_attn.k_proj.weight";

  struct Case {
    std::string label;
    std::function<void(const std::string& dir)> make;  // fills the directory
    std::string file;                                  // the file the message must name (relative)
    std::string words;                                 // and words it must hold
  };
  auto with_header = [&](std::function<void(json&)> edit) {
    return [&orig, edit](const std::string& dir) {
      StImage im = orig;
      edit(im.header);
      make_dir(dir, &im);
    };
  };
  auto with_bytes = [&](std::function<Bytes()> bytes) {
    return [bytes](const std::string& dir) {
      make_dir(dir, nullptr);
      write_bytes(dir + "/model.safetensors", bytes());
    };
  };
  auto with_config = [&](std::function<void(json&)> edit) {
    return [&orig, edit](const std::string& dir) {
      make_dir(dir, &orig);
      json c = config_json();
      edit(c);
      write_text(dir + "/config.json", c.dump());
    };
  };
  // Two shards: "a" holds everything; the index is edited by `edit`.
  auto with_index = [&](std::function<void(json&)> edit) {
    return [&orig, edit](const std::string& dir) {
      make_dir(dir, nullptr);
      orig.save(dir + "/model-a.safetensors");
      json idx{{"metadata", {{"total_size", orig.data.size()}}}, {"weight_map", json::object()}};
      for (auto it = orig.header.begin(); it != orig.header.end(); ++it)
        if (it.key() != "__metadata__") idx["weight_map"][it.key()] = "model-a.safetensors";
      edit(idx);
      write_text(dir + "/model.safetensors.index.json", idx.dump(2));
    };
  };
  const uint64_t file_size = orig.bytes().size();

  std::vector<Case> cases{
      // --- the safetensors container
      {"header length past the end", with_bytes([&] { return orig.bytes_with(orig.header.dump(), file_size); }),
       "model.safetensors", "past the end"},
      {"header length 2^60", with_bytes([&] { return orig.bytes_with(orig.header.dump(), uint64_t(1) << 60); }),
       "model.safetensors", "absurd"},
      {"header length 2^64-1", with_bytes([&] { return orig.bytes_with(orig.header.dump(), ~uint64_t(0)); }),
       "model.safetensors", "absurd"},
      {"header length 0", with_bytes([&] { return orig.bytes_with(orig.header.dump(), 0); }), "model.safetensors",
       "too small"},
      {"empty file", with_bytes([] { return Bytes{}; }), "model.safetensors", "too short"},
      {"5 bytes", with_bytes([] { return Bytes{1, 2, 3, 4, 5}; }), "model.safetensors", "too short"},
      {"header not JSON", with_bytes([&] {
         std::string h = orig.header.dump();
         for (size_t i = 1; i < h.size(); i += 7) h[i] = '#';
         return orig.bytes_with(h);
       }),
       "model.safetensors", "not valid JSON"},
      {"header is a JSON array", with_bytes([&] { return orig.bytes_with("[1, 2, 3]"); }), "model.safetensors",
       "header does not start"},
      {"header is truncated JSON", with_bytes([&] {
         const std::string h = orig.header.dump();
         return orig.bytes_with(h.substr(0, h.size() / 2));
       }),
       "model.safetensors", "not valid JSON"},
      {"data truncated", with_bytes([&] {
         Bytes b = orig.bytes();
         b.resize(b.size() / 2);
         return b;
       }),
       "model.safetensors", "past the end"},
      {"data_offsets past the end", with_header([&](json& h) {
         h["model.norm.weight"]["data_offsets"] = {orig.data.size(), orig.data.size() + 256};
       }),
       "model.safetensors", "past the end"},
      {"data_offsets inconsistent with the shape", with_header([&](json& h) { h[emb]["shape"] = {512, 63}; }),
       "model.safetensors", "needs"},
      {"data_offsets inconsistent with the dtype", with_header([&](json& h) { h[emb]["dtype"] = "F16"; }),
       "model.safetensors", "needs"},
      {"data_offsets end before begin", with_header([&](json& h) {
         h[emb]["data_offsets"] = {131072, 0};
       }),
       "model.safetensors", "end before"},
      {"data_offsets not integers", with_header([&](json& h) { h[emb]["data_offsets"] = {0.5, 131072}; }),
       "model.safetensors", "data_offsets"},
      {"data_offsets negative", with_header([&](json& h) { h[emb]["data_offsets"] = {-8, 131064}; }),
       "model.safetensors", "data_offsets"},
      {"overlapping tensors", with_header([&](json& h) {
         const uint64_t b = h[q0]["data_offsets"][0].get<uint64_t>();
         h[k0]["data_offsets"] = {b, b + 8192};
       }),
       "model.safetensors", "overlap"},
      {"unknown dtype", with_header([&](json& h) { h[emb]["dtype"] = "F42"; }), "model.safetensors",
       "unknown or unsupported dtype 'F42'"},
      {"negative dimension", with_header([&](json& h) { h[emb]["shape"] = {-512, -64}; }), "model.safetensors",
       "shape"},
      {"absurd dimensions", with_header([&](json& h) { h[emb]["shape"] = {uint64_t(1) << 40, uint64_t(1) << 40}; }),
       "model.safetensors", "absurdly large"},
      {"tensor entry without dtype", with_header([&](json& h) { h[emb].erase("dtype"); }), "model.safetensors",
       "lacks dtype"},
      {"__metadata__ value not a string", with_header([&](json& h) { h["__metadata__"]["format"] = 7; }),
       "model.safetensors", "__metadata__"},
      {"a tensor name repeated", with_bytes([&] {
         std::string h = orig.header.dump();
         const std::string entry = "\"model.norm.weight\":" + orig.header["model.norm.weight"].dump();
         h.insert(h.size() - 1, "," + entry);
         return orig.bytes_with(h);
       }),
       "model.safetensors", "repeats the key 'model.norm.weight'"},
      // --- valid safetensors that do not hold this model
      {"dtype I32 (valid container, not read)", with_header([&](json& h) { h[up2]["dtype"] = "I32"; }),
       "model.safetensors", "dtype I32; only F32, F16 and BF16"},
      {"missing tensor", with_header([&](json& h) { h.erase(up2); }), "model.safetensors",
       "tensor '" + up2 + "' (blk.2.ffn_up.weight [172, 64]) is missing"},
      {"missing embedding", with_header([&](json& h) { h.erase(emb); }), "model.safetensors",
       "tensor 'model.embed_tokens.weight'"},
      {"wrong shape", with_header([&](json& h) { h[up2]["shape"] = {64, 172}; }), "model.safetensors",
       "has shape [64, 172] but"},
      {"unexpected tensor", with_header([&](json& h) {
         h["model.layers.0.mlp.extra.weight"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
       }),
       "model.safetensors", "no place in a llama model"},
      {"layer beyond num_hidden_layers", with_header([&](json& h) {
         h["model.layers.5.input_layernorm.weight"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
       }),
       "model.safetensors", "model.layers.5.input_layernorm.weight"},
      {"attention bias of the wrong shape", with_header([&](json& h) {
         h["model.layers.0.self_attn.q_proj.bias"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
       }),
       "model.safetensors", "q_proj.bias' has shape [0]"},
      {"no weights at all", [](const std::string& dir) { make_dir(dir, nullptr); }, "", "no model.safetensors"},
      // --- the shard index
      {"index names a missing shard", with_index([](json& idx) {
         idx["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
       }),
       "model.safetensors.index.json", "shard 'model-00002-of-00002.safetensors'"},
      {"index not JSON", [&](const std::string& dir) {
         with_index([](json&) {})(dir);
         write_text(dir + "/model.safetensors.index.json", "{\"weight_map\": {\"a\": ");
       },
       "model.safetensors.index.json", "not valid JSON"},
      {"index without weight_map", with_index([](json& idx) { idx.erase("weight_map"); }), "model.safetensors.index.json",
       "weight_map"},
      {"index shard path leaves the directory", with_index([](json& idx) {
         idx["weight_map"]["model.norm.weight"] = "../model-a.safetensors";
       }),
       "model.safetensors.index.json", "not a plain file name"},
      {"index places a tensor in a shard without it", with_index([](json& idx) {
         idx["weight_map"]["model.layers.0.mlp.phantom.weight"] = "model-a.safetensors";
       }),
       "model-a.safetensors", "is not in it"},
      {"a shard is not safetensors", [&](const std::string& dir) {
         with_index([](json&) {})(dir);
         write_text(dir + "/model-a.safetensors", "this is not a safetensors file at all");
       },
       "model-a.safetensors", "absurd"},
      // --- config.json
      {"config.json missing", [&](const std::string& dir) {
         make_dir(dir, &orig);
         fs::remove(dir + "/config.json");
       },
       "config.json", "not found"},
      {"config.json not JSON", [&](const std::string& dir) {
         make_dir(dir, &orig);
         write_text(dir + "/config.json", "{\"hidden_size\": 64,");
       },
       "config.json", "not valid JSON"},
      {"config.json missing hidden_size", with_config([](json& c) { c.erase("hidden_size"); }), "config.json",
       "missing key \"hidden_size\""},
      {"config.json missing rms_norm_eps", with_config([](json& c) { c.erase("rms_norm_eps"); }), "config.json",
       "rms_norm_eps"},
      {"config.json hidden_size a string", with_config([](json& c) { c["hidden_size"] = "64"; }), "config.json",
       "hidden_size"},
      {"config.json num_key_value_heads 3", with_config([](json& c) { c["num_key_value_heads"] = 3; }), "config.json",
       "n_kv_heads"},
      {"config.json unsupported model_type", with_config([](json& c) { c["model_type"] = "gpt2"; }), "config.json",
       "model_type 'gpt2' is not supported"},
      {"config.json llama3 rope_scaling without its factors", with_config([](json& c) {
         c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
       }),
       "config.json", "missing key \"low_freq_factor\""},
      {"config.json rope_scaling of an unknown type", with_config([](json& c) {
         c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       }),
       "config.json", "RoPE scaling type 'yarn' is not supported"},
      {"config.json longrope factors of the wrong length", with_config([](json& c) {
         c["model_type"] = "phi3";
         c["rope_scaling"] = {{"type", "longrope"}, {"short_factor", {1.0, 2.0}}, {"long_factor", {1.0, 2.0}}};
       }),
       "config.json", "must be a list of head_dim/2"},
      {"config.json gemma3 layer_types without a period", with_config([](json& c) {
         c["model_type"] = "gemma3_text";
         c["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"};
       }),
       "config.json", "not a repeating pattern"},
      {"config.json hidden_act gelu", with_config([](json& c) { c["hidden_act"] = "gelu"; }), "config.json",
       "hidden_act"},
      {"config.json vocab_size 1000 (shapes disagree)", with_config([](json& c) { c["vocab_size"] = 1000; }),
       "model.safetensors", "[512, 64] but"},
      // --- tokenizer files
      {"tokenizer.json not JSON", [&](const std::string& dir) {
         make_dir(dir, &orig);
         write_text(dir + "/tokenizer.json", "{\"model\": [");
       },
       "tokenizer.json", "not valid JSON"},
      {"tokenizer.json a Unigram model", [&](const std::string& dir) {
         make_dir(dir, &orig);
         json t = tiny_tokenizer_json();
         t["model"]["type"] = "Unigram";
         write_text(dir + "/tokenizer.json", t.dump());
       },
       "tokenizer.json", "Unigram"},
      // Issue 22 item 9: an id far past the entries (before: 2 GB and 30 s of allocation) and a
      // JSON nested a million deep (before: 2.3 GB as a document) are refused before either.
      {"tokenizer.json with one id of 16 million", [&](const std::string& dir) {
         make_dir(dir, &orig);
         json t = tiny_tokenizer_json();
         t["model"]["vocab"]["far"] = 16000000;
         write_text(dir + "/tokenizer.json", t.dump());
       },
       "tokenizer.json", "outside 0.."},
      {"config.json nested a million deep", [&](const std::string& dir) {
         make_dir(dir, &orig);
         write_text(dir + "/config.json", std::string(1000000, '[') + std::string(1000000, ']'));
       },
       "config.json", "nested deeper"},
      {"tokenizer.json with a repeated id", [&](const std::string& dir) {
         make_dir(dir, &orig);
         json t = tiny_tokenizer_json();
         t["model"]["vocab"]["he"] = 256;
         write_text(dir + "/tokenizer.json", t.dump());
       },
       "tokenizer.json", "id 256 is given to both"},
      {"tokenizer.json with an id of 2^40", [&](const std::string& dir) {
         make_dir(dir, &orig);
         json t = tiny_tokenizer_json();
         t["model"]["vocab"]["he"] = int64_t(1) << 40;
         write_text(dir + "/tokenizer.json", t.dump());
       },
       "tokenizer.json", "outside"},
      {"tokenizer.model with more pieces than vocab_size", [&](const std::string& dir) {
         make_dir(dir, &orig);
         fs::create_symlink(shared("tokenizers/llama2/tokenizer.model"), dir + "/tokenizer.model");
       },
       "tokenizer.model", "more than config.json's vocab_size 512"},
      {"generation_config.json eos_token_id out of range", [&](const std::string& dir) {
         make_tokenizer_dir(dir);
         write_text(dir + "/generation_config.json", R"({"eos_token_id": [261, 9999]})");
       },
       "generation_config.json", "eos_token_id 9999 is outside the vocabulary"},
      {"tokenizer_config.json eos_token a number", [&](const std::string& dir) {
         make_tokenizer_dir(dir);
         write_text(dir + "/tokenizer_config.json", R"({"eos_token": 5})");
       },
       "tokenizer_config.json", "eos_token"},
  };

  int n = 0;
  for (const Case& c : cases) {
    const std::string dir = root + "/case" + std::to_string(n) + "/model";
    const std::string out = root + "/case" + std::to_string(n) + "/out.llmq";
    ++n;
    c.make(dir);
    const ToolRun r = convert(dir, out, {"--tokenizer", tok512()});
    INFO("case: " << c.label << "\n" << r.describe());
    CHECK(r.exited);
    CHECK(r.code == 2);
    CHECK(contains(r.err, "error"));
    CHECK(contains(r.err, c.file.empty() ? dir : dir + "/" + c.file));
    CHECK(contains(r.err, c.words));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK_FALSE(fs::exists(out));
    CHECK(tmp_siblings(out).empty());
  }
  CHECK(n >= 20);
}
