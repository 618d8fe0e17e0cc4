// The old TCP star's all-reduce (SocketComm, removed in issue 26) timed as llmq-bench times
// MpiComm's ("all_reduce" under mpirun): sizes 4 KiB to 64 MiB by 4x, 2 warm-up calls, then
// 256 MiB of messages (5 to 1000 calls) between two barriers, time per call on rank 0. For
// bench/RESULTS.md's comparison; it builds against the star's last tree:
//
//   git worktree add /tmp/star d53c065 && cp bench/star_allreduce.cpp /tmp/star/ && cd /tmp/star &&
//   g++ -std=c++20 -O2 -I. star_allreduce.cpp engine/parallel/comm_socket.cpp -o starbench -pthread
//   ./starbench 1 2 tcp://127.0.0.1:29633 & ./starbench 0 2 tcp://127.0.0.1:29633   # rank, size, rendezvous
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "engine/parallel/comm_socket.h"
using namespace llmq;
int main(int argc, char** argv) {
  const int rank = std::atoi(argv[1]), size = std::atoi(argv[2]);
  auto c = SocketComm::join(argv[3], rank, size, "bench");
  if (rank == 0) std::printf("bytes,iters,latency_us,algbw_GBps,busbw_GBps\n");
  for (int64_t bytes = 4096; bytes <= (int64_t(64) << 20); bytes *= 4) {
    const int64_t n = bytes / 4;
    const int iters = int(std::clamp<int64_t>((int64_t(256) << 20) / bytes, 5, 1000));
    std::vector<float> buf(size_t(n), 1.0f);
    for (int w = 0; w < 2; ++w) c->all_reduce_sum(buf.data(), n);
    c->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) c->all_reduce_sum(buf.data(), n);
    c->barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    if (rank == 0) std::printf("%lld,%d,%.1f,%.3f,%.3f\n", (long long)bytes, iters, s * 1e6, bytes / s / 1e9, bytes / s / 1e9 * 2.0 * (size - 1) / size);
  }
}
