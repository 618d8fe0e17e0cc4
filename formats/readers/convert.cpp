#include "formats/readers/convert.h"
#include "base/mapped_file.h"

#include <fnmatch.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "formats/readers/hf_model.h"
#include "formats/llmq_file.h"

namespace llmq {

std::optional<QuantMix> quant_mix_from_name(const std::string& name) {
  if (name == "q4_k_m" || name == "Q4_K_M") return QuantMix{DType::Q4_K, "q4_k_m"};
  if (name == "q5_k_m" || name == "Q5_K_M") return QuantMix{DType::Q5_K, "q5_k_m"};
  if (name == "q3_k_m" || name == "Q3_K_M") return QuantMix{DType::Q3_K, "q3_k_m"};
  if (name == "q2_k" || name == "Q2_K") return QuantMix{DType::Q2_K, "q2_k"};
  return std::nullopt;
}

bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

DType k_quant_fallback(DType t) {
  switch (t) {
    case DType::Q2_K: case DType::Q3_K: return DType::Q4_0;
    case DType::Q4_K: return DType::Q5_0;
    case DType::Q5_K: return DType::Q5_1;
    case DType::Q6_K: return DType::Q8_0;
    default: return t;
  }
}

namespace {

// The mix's type for a 2-D tensor (ConvertOptions::mix).
DType mix_type(const QuantMix& mix, const std::string& name, const ConvertOptions& opts) {
  if (name == "output.weight" || (opts.tied_output && name == "token_embd.weight")) return DType::Q6_K;
  const auto it = opts.mix_types.find(name);
  return it != opts.mix_types.end() ? it->second : mix.base;
}

enum class MixRole { AttnV, FfnDown, AttnOutput };

// QuantMix's rule for the i-th of n tensors of a role (nullopt: the base type).
std::optional<DType> mix_role_type(const QuantMix& mix, MixRole role, int i, int n, int64_t gqa) {
  switch (mix.base) {
    case DType::Q3_K:
      if (role == MixRole::AttnV) return i < 2 ? DType::Q5_K : DType::Q4_K;
      if (role == MixRole::FfnDown) return i < n / 16 ? DType::Q5_K : DType::Q4_K;
      return DType::Q4_K;
    case DType::Q2_K:
      return role == MixRole::AttnV && gqa >= 4 ? DType::Q4_K : DType::Q3_K;
    default:
      if (role != MixRole::AttnOutput && use_more_bits(i, n)) return DType::Q6_K;
      return std::nullopt;
  }
}

}  // namespace

std::map<std::string, DType> mix_tensor_types(const QuantMix& mix, const std::vector<SourceTensor>& ts, int64_t gqa) {
  std::map<std::string, DType> out;
  for (auto [kind, role] : {std::pair{".attn_v.weight", MixRole::AttnV}, std::pair{".ffn_down.weight", MixRole::FfnDown},
                            std::pair{".attn_output.weight", MixRole::AttnOutput}}) {
    std::vector<const SourceTensor*> of;
    for (const SourceTensor& t : ts)
      if (t.name.find(kind) != std::string::npos) of.push_back(&t);
    std::stable_sort(of.begin(), of.end(), [](auto* a, auto* b) { return a->file_order < b->file_order; });
    for (size_t i = 0; i < of.size(); ++i)
      if (auto t = mix_role_type(mix, role, int(i), int(of.size()), gqa)) out[of[i]->name] = *t;
  }
  return out;
}

namespace {

}  // namespace

DType choose_type(const SourceTensor& src, const ConvertOptions& opts, bool* fell_back) {
  *fell_back = false;
  if (src.shape.size() < 2) return DType::F32;
  DType t = opts.type ? *opts.type : opts.mix ? mix_type(*opts.mix, src.name, opts) : src.raw ? src.raw_type : DType::F16;
  for (const auto& [pattern, type] : opts.overrides)
    if (fnmatch(pattern.c_str(), src.name.c_str(), 0) == 0) {
      t = type;
      break;
    }
  if (!row_fits(t, src.shape.back())) t = k_quant_fallback(t);
  if (!row_fits(t, src.shape.back())) {
    *fell_back = true;
    return DType::F16;
  }
  return t;
}

std::string file_xxh64(const std::string& path) {
  std::ifstream in = open_regular_file(path);
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    if (in.gcount() > 0) XXH64_update(st, buf.data(), size_t(in.gcount()));
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

namespace {

void draw_progress(size_t done, size_t total, const std::string& name) {
  const int width = 30;
  const int filled = total ? int(width * done / total) : width;
  std::fprintf(stderr, "\r[%.*s%*s] %zu/%zu %-40.40s", filled, "==============================", width - filled, "", done,
               total, name.c_str());
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

// The file's metadata: the model's hyper-parameters, the vocabulary, the chat template, where
// it came from (format, file, its xxh64) and how it was converted.
void write_metadata(LlmqWriter& w, const SourceModel& src, const Vocab& vocab, const ConvertOptions& opts) {
  src.config.to_metadata(w.meta);
  vocab_to_metadata(vocab, w.meta);
  if (!opts.chat_template.empty()) w.meta.set("tokenizer.chat_template", opts.chat_template);
  w.meta.set("general.source.format", src.format);
  if (!opts.source_path.empty()) {
    // The file's (or checkpoint directory's) name, not the path as typed: a shared .llmq file
    // should not carry the converting machine's directories; the hash identifies the content.
    const std::filesystem::path src_path = std::filesystem::absolute(opts.source_path).lexically_normal();
    w.meta.set("general.source.file", (src_path.has_filename() ? src_path.filename() : src_path.parent_path().filename()).string());
    // A Hugging Face checkpoint is a directory: hash its checkpoint files (formats/readers/hf_model.h).
    w.meta.set("general.source.xxh64", std::filesystem::is_directory(opts.source_path) ? hf_checkpoint_xxh64(opts.source_path)
                                                                                       : file_xxh64(opts.source_path));
  }
  w.meta.set("general.converter", std::string("llmq-convert ") + LLMQ_VERSION);
  w.meta.set("general.file_type", std::string(opts.type ? dtype_name(*opts.type) : opts.mix ? opts.mix->name.c_str() : "as source"));
}

// Declares every tensor with the type choose_type gives it (a mix's per-tensor types resolved
// here); returns per tensor whether that type is a fallback from the one asked for.
std::vector<bool> declare_tensors(LlmqWriter& w, const SourceModel& src, const ConvertOptions& opts) {
  ConvertOptions o = opts;
  if (o.mix) o.mix_types = mix_tensor_types(*o.mix, src.tensors, src.config.n_heads / std::max<int64_t>(1, src.config.n_kv_heads));
  o.tied_output = true;
  for (const SourceTensor& t : src.tensors) o.tied_output = o.tied_output && t.name != "output.weight";
  std::vector<bool> fallback;
  for (const SourceTensor& t : src.tensors) {
    bool fb = false;
    w.declare(t.name, choose_type(t, o, &fb), t.shape);
    fallback.push_back(fb);
  }
  return fallback;
}

std::string source_name(const ConvertOptions& opts) { return opts.source_path.empty() ? "source" : opts.source_path; }

// Tensor i's stored bytes written as they are (a lossless repack), after checking every row's
// weights and scales are finite. Throws FileError naming the first row that is not.
void repack_tensor(LlmqWriter& w, size_t i, const SourceTensor& t, const ConvertOptions& opts) {
  const TensorInfo& info = w.tensors()[i];
  const int64_t cols = t.shape.back(), rows = t.numel() / cols;
  const size_t rb = row_bytes(info.type, cols);
  for (int64_t r = 0; r < rows; ++r)
    if (const int64_t j = first_nonfinite(info.type, t.raw + size_t(r) * rb, cols); j >= 0)
      throw FileError(source_name(opts), "tensor '" + t.name + "' row " + std::to_string(r) + ": weight " + std::to_string(j) +
                                             " is not finite (NaN or infinite value or scale)");
  w.write_tensor(i, t.raw, info.nbytes);
  if (t.release) t.release();
}

// Tensor i read as fp32, quantized row by row to its declared type and written; returns the
// relative RMS error of the round trip. data, packed, back: reused buffers. Throws FileError
// for a row the type cannot hold (NaN, Inf, overflow).
double quantize_tensor(LlmqWriter& w, size_t i, const SourceTensor& t, const ConvertOptions& opts, std::vector<float>& data,
                       std::vector<uint8_t>& packed, std::vector<float>& back) {
  const TensorInfo& info = w.tensors()[i];
  const int64_t n = t.numel(), cols = t.shape.back(), rows = n / cols;
  data.resize(size_t(n));
  t.read(data.data());
  if (t.release) t.release();
  packed.resize(info.nbytes);
  back.resize(size_t(cols));
  const size_t rb = row_bytes(info.type, cols);
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = data.data() + r * cols;
    try {
      quantize_row(info.type, x, packed.data() + size_t(r) * rb, cols);
    } catch (const UsageError& e) {  // NaN/Inf/overflow: the source file is at fault
      throw FileError(source_name(opts), "tensor '" + t.name + "' row " + std::to_string(r) + ": " + e.what());
    }
    dequantize_row(info.type, packed.data() + size_t(r) * rb, back.data(), cols);
    for (int64_t j = 0; j < cols; ++j) {
      const double d = double(back[size_t(j)]) - double(x[j]);
      err2 += d * d;
      ref2 += double(x[j]) * double(x[j]);
    }
  }
  w.write_tensor(i, packed.data(), packed.size());
  return ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
}

}  // namespace

ConvertReport convert_to_llmq(const SourceModel& src, const Vocab& vocab, const std::string& out, const ConvertOptions& opts) {
  if (int64_t(vocab.size()) != src.config.vocab_size)
    throw UsageError("the tokenizer has " + std::to_string(vocab.size()) + " tokens but the model's vocabulary is " +
                     std::to_string(src.config.vocab_size));
  LlmqWriter w(out, opts.overwrite);
  write_metadata(w, src, vocab, opts);
  const std::vector<bool> fallback = declare_tensors(w, src, opts);
  // Filled in as tensors are written (same encoded size, so it may change after begin()).
  w.meta.set("llmq.quantization.rel_rms_error", std::vector<float>(src.tensors.size(), 0.0f));
  w.begin();
  ConvertReport rep;
  std::vector<float> data, back, errors;
  std::vector<uint8_t> packed;
  for (size_t i = 0; i < src.tensors.size(); ++i) {
    const SourceTensor& t = src.tensors[i];
    const TensorInfo& info = w.tensors()[i];
    if (opts.progress) draw_progress(i, src.tensors.size(), t.name);
    double rel = 0.0;
    if (t.raw && t.raw_type == info.type) repack_tensor(w, i, t, opts);  // lossless repack: the stored bytes
    else rel = quantize_tensor(w, i, t, opts, data, packed, back);
    errors.push_back(float(rel));
    rep.tensors.push_back({t.name, info.type, fallback[i], rel, info.nbytes, t.numel()});
    rep.weight_bytes += info.nbytes;
    rep.weights += t.numel();
  }
  if (opts.progress) draw_progress(src.tensors.size(), src.tensors.size(), "done");
  w.meta.set("llmq.quantization.rel_rms_error", errors);
  w.finish();
  rep.file_bytes = std::filesystem::file_size(out);
  return rep;
}

}  // namespace llmq
