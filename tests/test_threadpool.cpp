// The thread pool: every index covered exactly once, chunks contiguous and balanced, exceptions
// rethrown to the caller, with polling threads (the default) and with sleeping threads
// (LLMQ_SPIN_US=0), over many back-to-back operations as a decode step issues them.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <vector>

#include "base/threadpool.h"

namespace {

void check_pool(llmq::ThreadPool& pool) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int64_t> pick(0, 5000);
  std::vector<std::atomic<int>> hits(5001);
  for (int op = 0; op < 3000; ++op) {
    const int64_t n = op < 20 ? op : pick(rng);  // 0, 1, tiny and large ranges
    for (int64_t i = 0; i < n; ++i) hits[size_t(i)].store(0);
    std::atomic<int> calls{0}, faults{0};  // (Catch2's assertions are not for worker threads)
    pool.parallel_for(n, [&](int64_t b, int64_t e, int thread) {
      if (thread < 0 || thread >= pool.size() || e - b > n / pool.size() + 1) faults.fetch_add(1);  // balanced
      calls.fetch_add(1);
      for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) REQUIRE(hits[size_t(i)].load() == 1);
    REQUIRE(calls.load() <= pool.size());
    REQUIRE(faults.load() == 0);
  }
  // An exception in any chunk reaches the caller, and the pool keeps working afterwards.
  for (int bad = 0; bad < pool.size(); ++bad) {
    CHECK_THROWS_WITH(pool.parallel_for(pool.size() * 10,
                                        [&](int64_t, int64_t, int thread) {
                                          if (thread == bad) throw std::runtime_error("chunk failed");
                                        }),
                      "chunk failed");
    std::atomic<int64_t> sum{0};
    pool.parallel_for(1000, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) sum.fetch_add(i);
    });
    CHECK(sum.load() == 999 * 1000 / 2);
  }
}

}  // namespace

TEST_CASE("thread pool: polling threads (default)", "[threadpool]") {
  for (int threads : {1, 2, 3, 5}) {
    llmq::ThreadPool pool(threads);
    CHECK(pool.spins());
    check_pool(pool);
  }
}

TEST_CASE("thread pool: sleeping threads (LLMQ_SPIN_US=0)", "[threadpool]") {
  setenv("LLMQ_SPIN_US", "0", 1);
  for (int threads : {2, 4}) {
    llmq::ThreadPool pool(threads);
    CHECK_FALSE(pool.spins());
    check_pool(pool);
  }
  unsetenv("LLMQ_SPIN_US");
}
