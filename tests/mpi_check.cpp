// llmq-mpi-check: run under mpirun by tests/test_tp_process.cpp (every rank runs it; rank 0
// prints the verdict). Exit 0 and "mpi check: ok" on rank 0 when every check passed; a failed
// check ends the job (MpiComm::abort_job) with a message and a non-zero exit.
//
//   mpirun -np N llmq-mpi-check comm          MpiComm's all_reduce_sum / gather / broadcast give
//                                             HostComm's bits (N in-process ranks on the same data)
//   mpirun -np N llmq-mpi-check overflow      rank 0 gathers into too little room: the job ends
//   mpirun -np N llmq-mpi-check model FILE    ranks as processes (TensorParallel over MpiComm,
//                                             ProcessGroupRunner / serve_process_group) give the
//                                             logits of N in-process ranks bit for bit
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/comm_host.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/parallel/tp_process.h"
#include "engine/tp.h"

using namespace llmq;

namespace {

// Rank r's input of length n for case `k`: gaussians over 7 decades, so the order of addition
// shows in the low bits.
std::vector<float> input(int r, int64_t n, int k) {
  std::mt19937 rng(uint32_t(1000003 * k + 7919 * r + n));
  std::normal_distribution<float> g;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = g(rng) * std::pow(10.0f, float(int((i + r) % 7) - 3));
  return v;
}

// Runs f(comm of rank r) on N threads of one HostCommGroup.
template <class F>
void host_ranks(int N, F f) {
  HostCommGroup g(N);
  std::vector<std::thread> ts;
  for (int r = 0; r < N; ++r) ts.emplace_back([&, r] { f(g.rank(r), r); });
  for (auto& t : ts) t.join();
}

void check_all_reduce(MpiComm& c) {
  const int N = c.size();
  const int64_t edge = kAllgatherBytes / 4;
  int k = 0;
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(3), int64_t(1000), edge - 1, edge, edge + 1, int64_t(100003), int64_t(1 << 20) + 7}) {
    std::vector<float> got = input(c.rank(), n, k), want;
    c.all_reduce_sum(got.data(), n);
    host_ranks(N, [&](HostComm& h, int r) {
      std::vector<float> v = input(r, n, k);
      h.all_reduce_sum(v.data(), n);
      if (r == c.rank()) want = std::move(v);
    });
    if (n > 0 && std::memcmp(got.data(), want.data(), size_t(n) * sizeof(float)) != 0)
      c.abort_job("all_reduce_sum of " + std::to_string(n) + " floats differs from HostComm's bits");
    ++k;
  }
}

void check_gather(MpiComm& c) {
  const int N = c.size();
  for (int root : {0, N - 1}) {
    auto count = [&](int r) { return int64_t((r * 37 + root * 11) % 50); };  // rank 0 of root 0 sends none
    int64_t total = 0;
    for (int r = 0; r < N; ++r) total += count(r);
    const std::vector<float> send = input(c.rank(), count(c.rank()), 100 + root);
    std::vector<float> got(size_t(total) + 1, -1.0f), want(size_t(total) + 1, -1.0f);
    c.gather(send.data(), count(c.rank()), got.data(), total, root);
    host_ranks(N, [&](HostComm& h, int r) {
      const std::vector<float> s = input(r, count(r), 100 + root);
      h.gather(s.data(), count(r), r == root ? want.data() : nullptr, total, root);
    });
    if (c.rank() == root && std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0)
      c.abort_job("gather to rank " + std::to_string(root) + " differs from HostComm's");
  }
}

void check_broadcast(MpiComm& c) {
  for (uint64_t n : {0, 5, 1016, 1017, 100000}) {
    std::vector<uint8_t> msg(n);
    for (uint64_t i = 0; i < n; ++i) msg[i] = uint8_t(i * 7 + n);
    if (c.rank() == 0) c.broadcast(msg.data(), n);
    else if (c.recv_broadcast() != msg) c.abort_job("broadcast of " + std::to_string(n) + " bytes arrived changed");
  }
}

int argmax(const float* x, int64_t n) { return int(std::max_element(x, x + n) - x); }

// Every logits row of a prompt and greedy steps, with a truncation in the middle.
std::vector<float> session_logits(BatchRunner& runner) {
  const int64_t V = runner.model().config.vocab_size;
  const std::vector<int32_t> prompt{1, 403, 407, 261, 378, 175, 79};
  Session s(runner, 64);
  const float* l = s.forward(prompt.data(), int64_t(prompt.size()), true);
  std::vector<float> out(l, l + int64_t(prompt.size()) * V);
  std::vector<int32_t> toks = prompt;
  for (int k = 0; k < 24; ++k) {
    if (k == 12) {  // rewind 3 positions and feed them again
      s.truncate(s.pos() - 3);
      s.forward(toks.data() + toks.size() - 3, 3);
    }
    toks.push_back(argmax(out.data() + out.size() - size_t(V), V));
    l = s.forward(&toks.back(), 1);
    out.insert(out.end(), l, l + V);
  }
  return out;
}

// Sequence 0 decodes beside the prompts of 1 and 2 (continuous batching); every row's logits.
std::vector<float> mixed_batch_logits(BatchRunner& runner) {
  KVCache kv = runner.make_cache(16, 16, KvType::F32);
  const std::vector<std::vector<int32_t>> prompts{{1, 40, 72, 9, 300}, {1, 17, 18, 19, 20, 21, 22, 23, 24}, {1, 400, 20}};
  std::vector<int32_t> seq;
  for (const auto& p : prompts) {
    seq.push_back(kv.add_sequence());
    if (!kv.reserve(seq.back(), int64_t(p.size()))) throw std::runtime_error("KV cache too small");
  }
  std::vector<BatchToken> first, mixed;
  for (size_t i = 0; i + 1 < prompts[0].size(); ++i) first.push_back({seq[0], prompts[0][i], false});
  runner.forward(kv, first.data(), int64_t(first.size()));
  mixed.push_back({seq[0], prompts[0].back(), true});
  for (size_t s = 1; s < prompts.size(); ++s)
    for (int32_t t : prompts[s]) mixed.push_back({seq[s], t, true});
  const float* l = runner.forward(kv, mixed.data(), int64_t(mixed.size()));
  return std::vector<float>(l, l + int64_t(mixed.size()) * runner.model().config.vocab_size);
}

void check_model(MpiComm& c, const std::string& path) {
  auto m = Model::load(path);
  const int N = c.size();
  TensorParallel local(*m, N, c.rank(), c, 1, 64);
  if (c.rank() > 0) return serve_process_group(local, c);
  std::vector<float> want, want_mixed;
  {
    TensorParallel in_process(*m, N, N, 64);  // one thread per rank, as each process here
    want = session_logits(in_process), want_mixed = mixed_batch_logits(in_process);
  }
  ProcessGroupRunner p(local, c);
  const std::vector<float> got = session_logits(p), got_mixed = mixed_batch_logits(p);
  if (got.size() != want.size() || std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0)
    c.abort_job("the ranks' session logits differ from N in-process ranks'");
  if (got_mixed.size() != want_mixed.size() || std::memcmp(got_mixed.data(), want_mixed.data(), want_mixed.size() * sizeof(float)) != 0)
    c.abort_job("the ranks' mixed-batch logits differ from N in-process ranks'");
}  // ~ProcessGroupRunner: the others stop

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mpi_launch_size() == 0) {
    std::fprintf(stderr, "llmq-mpi-check: run me under mpirun\n");
    return 1;
  }
  std::unique_ptr<MpiComm> c = MpiComm::init_world();
  try {
    if (mode == "comm") {
      check_all_reduce(*c);
      check_gather(*c);
      check_broadcast(*c);
      c->barrier();
      c->mark_done();
    } else if (mode == "overflow") {  // root's room is one value short
      const std::vector<float> send(10, 1.0f);
      std::vector<float> recv(size_t(10 * c->size()));
      c->gather(send.data(), 10, recv.data(), 10 * c->size() - 1, 0);
      c->mark_done();
    } else if (mode == "model" && argc > 2) {
      check_model(*c, argv[2]);
    } else {
      c->abort_job("usage: llmq-mpi-check comm | overflow | model FILE");
    }
  } catch (const std::exception& e) {
    c->abort_job(e.what());
  }
  if (c->rank() == 0) std::printf("mpi check: ok (%s, %d ranks)\n", mode.c_str(), c->size());
  return 0;
}
