#include "engine/parallel/comm_mpi.h"

// MPI's C API only: not the C++ bindings (deprecated, and a library of their own).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "base/error.h"

namespace llmq {

namespace {

constexpr uint64_t kMaxCommand = uint64_t(1) << 30;  // larger than any command (a batch and its block tables)
constexpr int kInline = 1024;                        // a broadcast's first collective: [u64 n][up to 1016 bytes]
constexpr int64_t kPiece = int64_t(1) << 28;         // floats per all-reduce call (MPI counts are int)

// A non-negative integer from the environment variable `name`; -2 when unset or malformed.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -2;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end || x < 0 || x > INT_MAX) ? -2 : int(x);
}

// Waits for a nonblocking request: polls for 2 ms, then sleeps 50 us, doubling to 1 ms, between
// tests (a follower waiting for the next request of an idle server does not spin a core).
void wait_polling(MPI_Request& req) {
  using clock = std::chrono::steady_clock;
  const auto spin_until = clock::now() + std::chrono::milliseconds(2);
  int done = 0;
  for (int us = 50;;) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (clock::now() < spin_until) continue;
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    us = std::min(us * 2, 1000);
  }
}

}  // namespace

int mpi_launch_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const int n = env_int(name); n >= 0) return n;
  return env_int("PMIX_RANK") >= 0 ? -1 : 0;
}

int mpi_launch_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const int r = env_int(name); r >= 0) return r;
  return 0;
}

void end_mpi_job(int code) {
  if (code == 0) code = 1;
  if (env_int("OMPI_COMM_WORLD_SIZE") >= 0) std::_Exit(code);  // Open MPI's mpirun ends the others
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; in case a library does
}

void abort_mpi_job_if_running(int code) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) end_mpi_job(code);
}

std::unique_ptr<MpiComm> MpiComm::init_world() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) throw UsageError("MPI: initialised twice in one process");
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, size = 1, local = 0, local_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm node;  // the ranks on this machine
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  std::unique_ptr<MpiComm> c(new MpiComm(rank, size, local, local_size));
  if (provided < MPI_THREAD_SERIALIZED) c->abort_job("the MPI library gives no MPI_THREAD_SERIALIZED (calls from more than one thread)");
  return c;
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (done_) {
    MPI_Finalize();
    return;
  }
  if (std::uncaught_exceptions() > 0) return;  // the tool prints the error, then abort_mpi_job_if_running
  abort_job("leaving before the group's orderly end (rank 0 did not tell the ranks to stop)");
}

void MpiComm::abort_job(const std::string& why) {
  std::fprintf(stderr, "llmq: rank %d of %d: %s; ending the MPI job\n", rank_, size_, why.c_str());
  std::fflush(stderr);
  end_mpi_job(1);
}

void MpiComm::abort() {
  std::string why = "a rank failed";
  if (const std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      why = x.what();
    } catch (...) {
    }
  }
  abort_job(why);
}

void MpiComm::all_reduce_sum(float* buf, int64_t n) {
  if (size_ == 1 || n <= 0) return;
  for (int64_t at = 0; at < n; at += kPiece) all_reduce_piece(buf + at, int(std::min(kPiece, n - at)));
}

void MpiComm::all_reduce_piece(float* buf, int n) {
  const int N = size_;
  if (int64_t(n) * int64_t(sizeof(float)) <= kAllgatherBytes) {  // every buffer to every rank, added here
    scratch_.resize(size_t(n) * size_t(N));
    MPI_Allgather(buf, n, MPI_FLOAT, scratch_.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
    std::memcpy(buf, scratch_.data(), size_t(n) * sizeof(float));  // ((b_0 + b_1) + b_2) + ...: HostComm's order
    for (int r = 1; r < N; ++r) {
      const float* src = scratch_.data() + size_t(r) * size_t(n);
      for (int i = 0; i < n; ++i) buf[i] += src[i];
    }
    return;
  }
  // Chunk c = [displs_[c], displs_[c] + counts_[c]) is summed by rank c.
  counts_.resize(size_t(N)), displs_.resize(size_t(N)), rcounts_.resize(size_t(N)), rdispls_.resize(size_t(N));
  for (int c = 0; c < N; ++c) {
    displs_[size_t(c)] = int(int64_t(n) * c / N);
    counts_[size_t(c)] = int(int64_t(n) * (c + 1) / N) - displs_[size_t(c)];
  }
  const int mine = counts_[size_t(rank_)];
  for (int q = 0; q < N; ++q) rcounts_[size_t(q)] = mine, rdispls_[size_t(q)] = q * mine;
  scratch_.resize(size_t(mine) * size_t(N));
  MPI_Alltoallv(buf, counts_.data(), displs_.data(), MPI_FLOAT, scratch_.data(), rcounts_.data(), rdispls_.data(), MPI_FLOAT,
                MPI_COMM_WORLD);
  float* out = buf + displs_[size_t(rank_)];
  std::memcpy(out, scratch_.data(), size_t(mine) * sizeof(float));
  for (int q = 1; q < N; ++q) {
    const float* src = scratch_.data() + size_t(q) * size_t(mine);
    for (int i = 0; i < mine; ++i) out[i] += src[i];
  }
  MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts_.data(), displs_.data(), MPI_FLOAT, MPI_COMM_WORLD);
}

void MpiComm::gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) {
  if (root < 0 || root >= size_) throw UsageError("MpiComm::gather: root " + std::to_string(root) + " is not a rank");
  if (count < 0 || count > INT_MAX) abort_job("gather: a count of " + std::to_string(count) + " values");
  std::vector<int64_t> all(rank_ == root ? size_t(size_) : 0);
  MPI_Gather(&count, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, root, MPI_COMM_WORLD);
  if (rank_ == root) {
    int64_t total = 0;
    counts_.resize(size_t(size_)), displs_.resize(size_t(size_));
    for (int r = 0; r < size_; ++r) {
      const int64_t c = all[size_t(r)];
      if (c < 0 || c > INT_MAX || total + c > capacity)
        abort_job("gather: " + std::to_string(total + c) + " values into room for " + std::to_string(capacity) + " (ranks out of step)");
      displs_[size_t(r)] = int(total), counts_[size_t(r)] = int(c);
      total += c;
    }
    if (total > INT_MAX) abort_job("gather: " + std::to_string(total) + " values in all");
  }
  MPI_Gatherv(send, int(count), MPI_FLOAT, recv, counts_.data(), displs_.data(), MPI_FLOAT, root, MPI_COMM_WORLD);
}

void MpiComm::barrier() { MPI_Barrier(MPI_COMM_WORLD); }

void MpiComm::bcast(void* p, int bytes) {
  MPI_Request req;
  MPI_Ibcast(p, bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
  wait_polling(req);
}

void MpiComm::broadcast(const void* bytes, uint64_t n) {
  if (rank_ != 0) throw UsageError("MpiComm::broadcast: only rank 0 broadcasts");
  if (n > kMaxCommand) throw UsageError("MpiComm::broadcast: a message of " + std::to_string(n) + " bytes");
  uint8_t head[kInline];
  const uint64_t first = std::min<uint64_t>(n, kInline - 8);
  std::memcpy(head, &n, 8);
  if (first) std::memcpy(head + 8, bytes, size_t(first));
  bcast(head, kInline);
  if (n > first) bcast(const_cast<uint8_t*>(static_cast<const uint8_t*>(bytes) + first), int(n - first));
}

std::vector<uint8_t> MpiComm::recv_broadcast() {
  if (rank_ == 0) throw UsageError("MpiComm::recv_broadcast: rank 0 broadcasts");
  uint8_t head[kInline];
  bcast(head, kInline);
  uint64_t n = 0;
  std::memcpy(&n, head, 8);
  if (n > kMaxCommand) abort_job("ranks out of step (a command of " + std::to_string(n) + " bytes)");
  const uint64_t first = std::min<uint64_t>(n, kInline - 8);
  std::vector<uint8_t> out(head + 8, head + 8 + first);
  out.resize(size_t(n));
  if (n > first) bcast(out.data() + first, int(n - first));
  return out;
}

}  // namespace llmq
