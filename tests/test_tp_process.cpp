// Tensor parallelism over processes (engine/parallel/comm_socket.h, engine/parallel/tp_process.h, and
// TensorParallel holding one rank of a group): the socket communicator's collectives give the host
// communicator's bits; ranks joined through a rendezvous give the logits of the same ranks in one
// process bit for bit (threads stand in for the processes here, the tools run real processes);
// bad rendezvous, mismatched ranks and ranks that die end with one clear message.
#include <catch2/catch.hpp>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "engine/comm_host.h"
#include "engine/parallel/comm_socket.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"
#include "base/error.h"
#include "test_util.h"

using namespace llmq;
using namespace std::chrono_literals;

namespace {

// A TCP port nobody listens on now (the kernel's pick for port 0, released again).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET, a.sin_addr.s_addr = htonl(INADDR_LOOPBACK), a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Joins ranks 0 .. n-1 on threads; returns them in rank order.
std::vector<std::unique_ptr<SocketComm>> join_all(const std::string& init, int n, const std::string& sig = "job") {
  std::vector<std::future<std::unique_ptr<SocketComm>>> fs;
  for (int r = 0; r < n; ++r) fs.push_back(std::async(std::launch::async, [=] { return SocketComm::join(init, r, n, sig, 20s); }));
  std::vector<std::unique_ptr<SocketComm>> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

// What `init` makes `rank` of `n` throw (UsageError expected), joined alone within `timeout`.
std::string join_error(const std::string& init, int rank, int n, std::chrono::milliseconds timeout) {
  try {
    SocketComm::join(init, rank, n, "job", timeout);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

int32_t argmax(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }

// Logits of `prompt` (all rows) then `steps` greedy steps, with a truncation in the middle (the
// KV cache drops the last 3 positions and they are run again): what Session does through the
// runner, every row copied.
std::vector<float> session_logits(BatchRunner& runner, const std::vector<int32_t>& prompt, int steps) {
  const int64_t V = runner.model().config.vocab_size;
  Session s(runner, 64);
  std::vector<float> out;
  const float* l = s.forward(prompt.data(), int64_t(prompt.size()), true);
  out.insert(out.end(), l, l + int64_t(prompt.size()) * V);
  std::vector<int32_t> toks = prompt;
  for (int k = 0; k < steps; ++k) {
    if (k == steps / 2) {  // rewind 3 positions and feed them again
      s.truncate(s.pos() - 3);
      l = s.forward(toks.data() + toks.size() - 3, 3);
    }
    toks.push_back(argmax(out.data() + out.size() - size_t(V), V));
    l = s.forward(&toks.back(), 1);
    out.insert(out.end(), l, l + V);
  }
  return out;
}

// A mixed batch (continuous batching): sequence 0 decodes beside the prompts of 1 and 2, each with
// its own block table; every row's logits.
std::vector<float> mixed_batch_logits(BatchRunner& runner) {
  KVCache kv = runner.make_cache(16, 16, KvType::F32);
  const std::vector<std::vector<int32_t>> prompts{{1, 40, 72, 9, 300}, {1, 17, 18, 19, 20, 21, 22, 23, 24}, {1, 400, 20}};
  std::vector<int32_t> seq;
  for (const auto& p : prompts) {
    seq.push_back(kv.add_sequence());
    REQUIRE(kv.reserve(seq.back(), int64_t(p.size())));
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

// Runs `body(rank 0's runner)` with ranks 1 .. n-1 served (serve_process_group) on threads, each
// rank a TensorParallel holding its shard over the group's SocketComm, one thread each.
template <class F>
void with_process_ranks(const Model& m, int n, const std::string& init, F body) {
  std::vector<std::future<void>> workers;
  for (int r = 1; r < n; ++r)
    workers.push_back(std::async(std::launch::async, [&m, n, r, init] {
      auto c = SocketComm::join(init, r, n, tp_signature(m, n), 20s);
      TensorParallel local(m, n, r, *c, 1, 64);
      serve_process_group(local, *c);
    }));
  auto c0 = SocketComm::join(init, 0, n, tp_signature(m, n), 20s);
  {
    TensorParallel local(m, n, 0, *c0, 1, 64);
    ProcessGroupRunner p(local, *c0);
    body(p, local);
  }  // the destructor stops the workers
  for (auto& w : workers) REQUIRE_NOTHROW(w.get());
}

}  // namespace

TEST_CASE("socket communicator: all-reduce gives the host communicator's bits - gather and barrier and broadcast", "[tp][tp_process]") {
  const int N = 3;
  std::mt19937_64 rng(test::fresh_seed());
  std::vector<std::vector<float>> in(N);
  for (auto& v : in) v = test::gaussian(1001, rng);
  auto reduce = [&](auto&& comm_of) {  // every rank's result of one all-reduce
    std::vector<std::vector<float>> out = in;
    std::vector<std::thread> ts;
    for (int r = 0; r < N; ++r) ts.emplace_back([&, r] { comm_of(r).all_reduce_sum(out[size_t(r)].data(), 1001); });
    for (auto& t : ts) t.join();
    return out;
  };
  HostCommGroup host(N);
  const auto want = reduce([&](int r) -> Communicator& { return host.rank(r); });
  for (const std::string& init : {"file://" + test::scratch("tp_sock") + "/rendezvous", "tcp://127.0.0.1:" + std::to_string(free_port())}) {
    INFO(init);
    auto c = join_all(init, N);
    const auto got = reduce([&](int r) -> Communicator& { return *c[size_t(r)]; });
    for (int r = 0; r < N; ++r) CHECK(std::memcmp(got[size_t(r)].data(), want[0].data(), 1001 * sizeof(float)) == 0);

    // gather (counts differ per rank), barrier, broadcast, many times over the same sockets
    std::vector<std::thread> ts;
    std::vector<std::vector<float>> recv(N, std::vector<float>(6, -1.0f));
    std::vector<std::vector<uint8_t>> heard(N);
    for (int r = 0; r < N; ++r)
      ts.emplace_back([&, r] {
        for (int it = 0; it < 20; ++it) {
          std::vector<float> send(size_t(r + 1), float(r + it));
          c[size_t(r)]->gather(send.data(), int64_t(send.size()), recv[size_t(r)].data(), int64_t(recv[size_t(r)].size()), 0);
          c[size_t(r)]->barrier();
          const std::string msg = "step " + std::to_string(it);
          if (r == 0) c[0]->broadcast(msg.data(), msg.size());
          else heard[size_t(r)] = c[size_t(r)]->recv_broadcast();
        }
      });
    for (auto& t : ts) t.join();
    CHECK(recv[0] == std::vector<float>{19, 20, 20, 21, 21, 21});
    CHECK(recv[1] == std::vector<float>(6, -1.0f));
    CHECK(std::string(heard[2].begin(), heard[2].end()) == "step 19");
  }
  // The rendezvous file is rank 0's to remove when the group ends.
  CHECK_FALSE(std::filesystem::exists(test::scratch_root() / "tp_sock" / "rendezvous"));
}

TEST_CASE("socket communicator: bad rendezvous, refused ranks and timeouts fail with one clear message", "[tp][tp_process]") {
  CHECK_THAT(join_error("bogus", 0, 2, 200ms), Catch::Contains("expected tcp://HOST:PORT or file://PATH"));
  CHECK_THAT(join_error("tcp://127.0.0.1:http", 0, 2, 200ms), Catch::Contains("port must be a number"));
  CHECK_THAT(join_error("tcp://127.0.0.1:1", 2, 2, 200ms), Catch::Contains("is not a rank of --tp 2"));
  CHECK_THAT(join_error("tcp://127.0.0.1:1", 0, 1, 200ms), Catch::Contains("--tp 2 or more"));
  // Alone: rank 0 waits for the others, the others for rank 0, then each gives up.
  const std::string port = std::to_string(free_port());
  CHECK_THAT(join_error("tcp://127.0.0.1:" + port, 0, 3, 300ms), Catch::Contains("0 of 2 other ranks joined within 0.3 s"));
  CHECK_THAT(join_error("tcp://127.0.0.1:" + port, 1, 3, 300ms), Catch::Contains("cannot reach rank 0"));
  const std::string file = test::scratch("tp_refuse") + "/rendezvous";
  CHECK_THAT(join_error("file://" + file, 1, 2, 300ms), Catch::Contains("did not publish its address"));

  // A rank with another model (signature) or another --tp is refused, on both sides.
  for (int other_size : {2, 3}) {
    const std::string init = "tcp://127.0.0.1:" + std::to_string(free_port());
    auto r0 = std::async(std::launch::async, [&] { return join_error(init, 0, 2, 5s); });
    std::string r1;
    try {
      SocketComm::join(init, 1, other_size, other_size == 2 ? "another model" : "job", 5s);
    } catch (const UsageError& e) {
      r1 = e.what();
    }
    const std::string why = other_size == 2 ? "its model or options differ" : "started with --tp 3, rank 0 with --tp 2";
    CHECK_THAT(r1, Catch::Contains("rank 0 refused rank 1") && Catch::Contains(why));
    CHECK_THAT(r0.get(), Catch::Contains(why));
  }
}

TEST_CASE("socket communicator: strangers at the rendezvous are dropped - the ranks still join", "[tp][tp_process]") {
  const std::string port = std::to_string(free_port()), init = "tcp://127.0.0.1:" + port;
  struct TokenGuard {  // LLMQ_TP_TOKEN for this test only, however it ends
    ~TokenGuard() { ::unsetenv("LLMQ_TP_TOKEN"); }
  } token_guard;
  ::setenv("LLMQ_TP_TOKEN", "s3cret", 1);
  auto r0 = std::async(std::launch::async, [&] { return SocketComm::join(init, 0, 2, "job", 20s); });
  auto connect_raw = [&] {  // a plain TCP client, retried until rank 0 listens
    for (int i = 0; i < 200; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET, a.sin_addr.s_addr = htonl(INADDR_LOOPBACK), a.sin_port = htons(uint16_t(std::stoi(port)));
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
      ::close(fd);
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  };
  const int junk = connect_raw();  // another protocol: dropped
  REQUIRE(junk >= 0);
  CHECK(::send(junk, "GET / HTTP/1.0\r\n\r\n", 18, MSG_NOSIGNAL) == 18);
  ::close(junk);
  ::setenv("LLMQ_TP_TOKEN", "guess", 1);  // a rank with the wrong secret: refused and dropped
  CHECK_THAT(join_error(init, 1, 2, 5s), Catch::Contains("wrong secret"));
  ::setenv("LLMQ_TP_TOKEN", "s3cret", 1);
  auto c1 = SocketComm::join(init, 1, 2, "job", 20s);  // the real rank 1 still joins
  auto c0 = r0.get();
  ::unsetenv("LLMQ_TP_TOKEN");
  float x = 1.0f, y = 2.0f;
  auto f = std::async(std::launch::async, [&] { c1->all_reduce_sum(&y, 1); });
  c0->all_reduce_sum(&x, 1);
  f.get();
  CHECK((x == 3.0f && y == 3.0f));
  CHECK(c0->peers_alive());
  c1.reset();  // rank 1 goes away: rank 0 can tell without blocking (the NCCL watch)
  std::this_thread::sleep_for(50ms);
  CHECK_FALSE(c0->peers_alive());
}

TEST_CASE("socket communicator: a gather larger than the room given is refused, not written", "[tp][tp_process]") {
  auto c = join_all("file://" + test::scratch("tp_gather") + "/rendezvous", 2);
  std::vector<float> send(100, 1.0f), recv(50, -1.0f);
  auto f = std::async(std::launch::async, [&] { c[1]->gather(send.data(), 100, nullptr, 0, 0); });
  CHECK_THROWS_AS(c[0]->gather(send.data(), 10, recv.data(), int64_t(recv.size()), 0), CommAborted);
  f.wait();
  CHECK(recv[10] == -1.0f);  // nothing of rank 1's was written
}

TEST_CASE("socket communicator: a file rendezvous left by an earlier run does not mislead the ranks", "[tp][tp_process]") {
  const std::string file = test::scratch("tp_stale") + "/rendezvous";
  std::ofstream(file) << "127.0.0.1:" << free_port() << " 0123\n";  // nobody listens there any more
  auto r1 = std::async(std::launch::async, [&] { return SocketComm::join("file://" + file, 1, 2, "job", 20s); });
  std::this_thread::sleep_for(300ms);  // rank 1 has read the stale address and failed to connect
  auto r0 = SocketComm::join("file://" + file, 0, 2, "job", 20s);
  auto c1 = r1.get();
  float x = 1.0f, y = 2.0f;
  auto f = std::async(std::launch::async, [&] { c1->all_reduce_sum(&y, 1); });
  r0->all_reduce_sum(&x, 1);
  f.get();
  CHECK(x == 3.0f);
  CHECK(y == 3.0f);
}

TEST_CASE("socket communicator: a rank that aborts or goes away releases the others", "[tp][tp_process]") {
  auto c = join_all("tcp://127.0.0.1:" + std::to_string(free_port()), 3);
  // Rank 2 aborts while ranks 0 and 1 are in an all-reduce: both throw CommAborted.
  std::vector<float> b0(8, 1.0f), b1(8, 1.0f);
  auto f0 = std::async(std::launch::async, [&] { c[0]->all_reduce_sum(b0.data(), 8); });
  auto f1 = std::async(std::launch::async, [&] { c[1]->all_reduce_sum(b1.data(), 8); });
  std::this_thread::sleep_for(20ms);
  c[2]->abort();
  CHECK_THROWS_AS(f0.get(), CommAborted);
  c[0]->abort();  // rank 0 failed: rank 1, waiting on it, is released too
  CHECK_THROWS_AS(f1.get(), CommAborted);
  CHECK_THROWS_AS(c[2]->barrier(), CommAborted);

  // A worker whose rank 0 closes (the process ended) gets a message naming rank 0.
  auto d = join_all("tcp://127.0.0.1:" + std::to_string(free_port()), 2);
  d[0].reset();
  try {
    d[1]->recv_broadcast();
    FAIL("no error");
  } catch (const CommAborted& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("rank 0 is gone"));
  }
}

TEST_CASE("TP over processes: ranks joined through a rendezvous give the in-process ranks' logits bit for bit", "[tp][tp_process][model]") {
  for (const char* type : {"f32", "q8_0"}) {
    auto m = Model::load(test::stories(type));
    const std::vector<int> ns = std::string(type) == "f32" ? std::vector<int>{2, 4} : std::vector<int>{2};  // Q8_0 blocks: --tp 4 cuts one
    for (int n : ns) {
      INFO(type << ", --tp " << n);
      TensorParallel in_process(*m, n, n, 64);  // one thread per rank, as each process below
      const std::vector<int32_t> prompt{1, 403, 407, 261, 378, 175, 79};
      const std::vector<float> want = session_logits(in_process, prompt, 24), want_mixed = mixed_batch_logits(in_process);
      std::vector<float> got, got_mixed;
      with_process_ranks(*m, n, "file://" + test::scratch("tp_proc") + "/rendezvous", [&](ProcessGroupRunner& p, TensorParallel& local) {
        got = session_logits(p, prompt, 24);
        got_mixed = mixed_batch_logits(p);
        CHECK(p.workspace_bytes() == in_process.rank_workspace_bytes(0));
        CHECK(local.shard(0).weight_bytes() == in_process.shard(0).weight_bytes());
      });
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
      REQUIRE(got_mixed.size() == want_mixed.size());
      CHECK(std::memcmp(got_mixed.data(), want_mixed.data(), want_mixed.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("TP over processes: a worker that fails ends rank 0's forward pass with CommAborted", "[tp][tp_process][model]") {
  auto m = Model::load(test::stories("f32"));
  const std::string init = "tcp://127.0.0.1:" + std::to_string(free_port());
  // Rank 1 joins, then leaves without serving (as a process that crashed would).
  auto worker = std::async(std::launch::async, [&] { SocketComm::join(init, 1, 2, tp_signature(*m, 2), 20s); });
  auto c0 = SocketComm::join(init, 0, 2, tp_signature(*m, 2), 20s);
  worker.get();
  std::this_thread::sleep_for(50ms);
  try {
    TensorParallel local(*m, 2, 0, *c0, 1, 16);
    ProcessGroupRunner runner(local, *c0);
    Session s(runner, 32);
    const int32_t toks[3] = {1, 40, 72};
    CHECK_THROWS_AS(s.forward(toks, 3), CommAborted);
    CHECK_THROWS_AS(s.forward(toks, 3), UsageError);  // the group is unusable afterwards
  } catch (const CommAborted& e) {  // the constructor's or make_cache's command already found rank 1 gone
    CHECK_THAT(std::string(e.what()), Catch::Contains("rank 1 is gone"));
  }
}

TEST_CASE("TP over processes: llmq-run --tp 2 --tp-init in two processes generates --tp 1's greedy text", "[tp][tp_process][cli]") {
  const std::string dir = test::scratch("tp_procs");
  const std::string model = test::stories("f32");
  const std::string run_bin = test::bin("llmq-run") + " -m " + model + " -t 1";
  const std::string base = "LLMQ_TP_TIMEOUT=60 " + run_bin;  // a rank whose partner failed gives up within a minute
  const std::string gen = " -p 'Once upon a time' -n 48 --temp 0";
  REQUIRE(test::run(base + gen + " >" + dir + "/one.txt 2>/dev/null") == 0);
  const std::string init = " --tp 2 --tp-init file://" + dir + "/rendezvous";
  // rank 1 in the background (its exit code into a file), rank 0 in the foreground
  const std::string worker = "(" + base + init + " --tp-rank 1 >/dev/null 2>" + dir + "/w.err; echo $? >" + dir + "/w.rc) &";
  REQUIRE(test::run(worker + " " + base + gen + init + " >" + dir + "/two.txt 2>" + dir + "/two.err; rc=$?; wait; exit $rc") == 0);
  CHECK(test::run("cmp -s " + dir + "/one.txt " + dir + "/two.txt") == 0);
  CHECK(test::run("grep -q 'tensor parallel over 2 processes' " + dir + "/two.err") == 0);
  CHECK(test::run("grep -qx 0 " + dir + "/w.rc") == 0);
  CHECK(test::run("grep -q 'rank 1 done' " + dir + "/w.err") == 0);

  // Flags checked before anything is loaded or joined.
  CHECK(test::run(base + " --tp-rank 1 2>" + dir + "/e1 >/dev/null") == 1);
  CHECK(test::run("grep -q 'needs --tp-init' " + dir + "/e1") == 0);
  CHECK(test::run(base + " --tp 2 --tp-init bogus -p x 2>" + dir + "/e2 >/dev/null") == 1);
  CHECK(test::run("grep -q 'expected tcp://HOST:PORT or file://PATH' " + dir + "/e2") == 0);
  // A rank alone gives up after LLMQ_TP_TIMEOUT with one line.
  CHECK(test::run("LLMQ_TP_TIMEOUT=0.3 " + run_bin + init + "-none --tp-rank 1 2>" + dir + "/e3 >/dev/null") == 1);
  CHECK(test::run("grep -q 'did not publish its address' " + dir + "/e3") == 0);
}

TEST_CASE("TP over processes: a rank given a malformed command fails clearly and releases rank 0", "[tp][tp_process]") {
  auto m = Model::load(test::stories("f32"));
  const std::vector<std::vector<uint8_t>> bad{
      {},                                   // no command at all
      {9, 0, 0, 0},                         // an unknown command
      {3, 0, 0, 0, 1, 0},                   // a forward pass cut short
      {3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0},  // a forward pass before any KV cache
      {4, 0, 0, 0, 0},                      // stop, with a byte too many
  };
  for (const auto& msg : bad) {
    const std::string init = "tcp://127.0.0.1:" + std::to_string(free_port());
    auto worker = std::async(std::launch::async, [&] {
      auto c = SocketComm::join(init, 1, 2, "job", 20s);
      TensorParallel local(*m, 2, 1, *c, 1, 16);
      serve_process_group(local, *c);
    });
    auto c0 = SocketComm::join(init, 0, 2, "job", 20s);
    c0->broadcast(msg.data(), msg.size());
    CHECK_THROWS_AS(worker.get(), UsageError);
    CHECK_THROWS_AS(c0->barrier(), CommAborted);  // rank 1 aborted the group: rank 0 is not left waiting
  }
}

TEST_CASE("TP over processes: llmq-bench --tp 2 --tp-init measures rank 0's group against TP=1", "[tp][tp_process][cli]") {
  const std::string dir = test::scratch("tp_bench");
  const std::string base = "LLMQ_TP_TIMEOUT=60 " + test::bin("llmq-bench") + " -m " + test::stories("f32") +
                           " -t 1 --tp 2 --tp-init file://" + dir + "/rendezvous";
  const std::string worker = "(" + base + " --tp-rank 1 >/dev/null 2>" + dir + "/w.err; echo $? >" + dir + "/w.rc) &";
  REQUIRE(test::run(worker + " " + base + " -p 16 -n 4 -r 1 --bandwidth-mib 0 >" + dir + "/out.json 2>" + dir +
                    "/err; rc=$?; wait; exit $rc") == 0);
  std::ifstream f(dir + "/out.json");
  const std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK_THAT(out, Catch::Contains("\"tp_processes\": true") && Catch::Contains("\"speedup_decode\"") && Catch::Contains("\"tp\": 2"));
  CHECK(test::run("grep -qx 0 " + dir + "/w.rc") == 0);
}
