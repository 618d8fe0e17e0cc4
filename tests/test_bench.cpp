// llmq-bench and the roofline it reports (engine/roofline.h): the arithmetic count of a forward
// pass, the int8 peak loop, and the tool's JSON on a real model.
#include <catch2/catch.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/cpu/cpu_ops.h"
#include "engine/model.h"
#include "engine/roofline.h"
#include "test_util.h"

using namespace llmq;

TEST_CASE("forward_cost counts what the engine computes", "[bench]") {
  auto m = Model::load(test::stories("q8_0"));
  const ModelConfig& c = m->config;
  // Weights of every layer matrix, the last layer's Q, output and FFN matrices, and the output.
  double per_layer = 0, kv = 0;
  for (const char* what : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
    const TensorInfo* t = m->file->find(layer_tensor(0, what));
    REQUIRE(t);
    per_layer += double(t->numel());
    if (std::string(what) == "attn_k" || std::string(what) == "attn_v") kv += double(t->numel());
  }
  const double out = double(c.vocab_size) * double(c.dim);
  const double L = double(c.n_layers), q = double(c.q_dim());
  // One token at position p: every weight once, attention over p + 1 positions in every layer.
  const ForwardCost d = forward_cost(*m, 1, 10);
  CHECK(d.flops == Approx(2.0 * (L * per_layer + out) + 4.0 * q * L * 11.0).epsilon(1e-12));
  // n tokens from position 0 with the last token's logits: the last layer's Q, output and FFN
  // matrices and the output projection see one token; attention in the last layer one token.
  const int64_t n = 20;
  const ForwardCost p = forward_cost(*m, n, 0);
  const double attended = double(n) * double(n + 1) / 2;
  const double want = 2.0 * (double(n) * ((L - 1) * per_layer + kv) + (per_layer - kv) + out) +
                      4.0 * q * ((L - 1) * attended + double(n));
  CHECK(p.flops == Approx(want).epsilon(1e-12));
}

TEST_CASE("the int8 peak loop reports its multiply-adds", "[bench]") {
  const uint64_t macs = int8_dot_peak_loop(100);
  if (macs == 0) {
    WARN("SKIPPED: the active CPU level (" << cpu_kernels_name() << ") has no int8 peak loop");
    return;
  }
  CHECK(macs == 100u * 12 * 64);
  ThreadPool pool(2);
  const double peak = measure_int8_peak(pool, 0.02);
  CHECK(peak > 1e9);  // any AVX-512 VNNI core does far more than 1 G int8 ops/s
}

TEST_CASE("llmq-bench prints prefill and decode speed, bandwidth and peak fractions as JSON", "[bench]") {
  const std::string out = test::scratch("bench") + "/out.json";
  // The model positional (-m works as well; llmq-run and llmq-server take it either way too).
  REQUIRE(test::run(test::bin("llmq-bench") + " " + test::stories("q8_0") + " -p 32 -n 8 -r 1 -t 2 --bandwidth-mib 64 > " + out) == 0);
  std::FILE* f = std::fopen(out.c_str(), "r");
  REQUIRE(f);
  const nlohmann::json j = nlohmann::json::parse(f);
  std::fclose(f);
  CHECK(j.at("prompt_tokens") == 32);
  CHECK(j.at("gen_tokens") == 8);
  CHECK(j.at("prefill_tok_s").get<double>() > 0);
  CHECK(j.at("decode_tok_s").get<double>() > 0);
  CHECK(j.at("prefill_gflop_s").get<double>() > 0);
  CHECK(j.at("read_bandwidth_gb_s").get<double>() > 0);
  CHECK(j.at("decode_bandwidth_fraction").get<double>() > 0);
  if (int8_dot_peak_loop(1) > 0) {
    CHECK(j.at("int8_peak_gop_s").get<double>() > 0);
    CHECK(j.at("prefill_fraction_of_int8_peak").get<double>() > 0);
  }
}
