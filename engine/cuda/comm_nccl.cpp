#include "engine/cuda/comm_nccl.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <string>
#include <vector>

#include "base/error.h"

namespace llmq {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("NCCL: ") + what + ": " + ncclGetErrorString(r));
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace

ncclUniqueId NcclComm::make_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

NcclComm::NcclComm(int rank, int size, const ncclUniqueId& id, int device) : rank_(rank), size_(size), device_(device) {
  const int gpus = gpu_count();  // (ranks in other processes may be on other machines: size is not checked against it)
  if (rank < 0 || rank >= size || device < 0 || device >= gpus)
    throw UsageError("NCCL: rank " + std::to_string(rank) + " of " + std::to_string(size) + " on device " + std::to_string(device) +
                     " does not exist");
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = s;
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&counts_), sizeof(int64_t) * size_t(size)), "cudaMalloc");
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(float)), "cudaMalloc");
  check_nccl(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  if (comm_) ncclCommDestroy(comm_);  // abort() already released an aborted one
  cudaFree(counts_);
  cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(as_stream(stream_));
}

void NcclComm::sync() {
  if (aborted_) throw CommAborted("NCCL: the communicator was aborted");
  // With a watch (ranks in other processes), poll rather than block in cudaStreamSynchronize: a
  // peer that died leaves its collectives waiting forever, so between polls NCCL's asynchronous
  // error and the watch on the peers are checked, and the communicator is aborted when either
  // fails. Without one (ranks in this process), block as before.
  if (!watch_) check_cuda(cudaStreamSynchronize(as_stream(stream_)), "cudaStreamSynchronize");
  auto next_watch = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  for (int spins = 0; watch_; ++spins) {
    const cudaError_t q = cudaStreamQuery(as_stream(stream_));
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) check_cuda(q, "cudaStreamQuery");
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress) {
      abort();
      throw CommAborted(std::string("NCCL: ") + ncclGetErrorString(async));
    }
    if (std::chrono::steady_clock::now() >= next_watch) {
      if (!watch_() && cudaStreamQuery(as_stream(stream_)) == cudaErrorNotReady) {  // gone, and the collective still waits
        abort();
        throw CommAborted("NCCL: another rank's process is gone; the collective cannot finish");
      }
      next_watch = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    }
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));  // spin first: all-reduces are short
  }
  ncclResult_t async = ncclSuccess;
  check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
  if (async != ncclSuccess) throw CommAborted(std::string("NCCL: ") + ncclGetErrorString(async));
}

void NcclComm::all_reduce_sum(float* buf, int64_t n) {
  if (aborted_) throw CommAborted("NCCL: the communicator was aborted");
  if (n <= 0) return;
  check_nccl(ncclAllReduce(buf, buf, size_t(n), ncclFloat32, ncclSum, comm_, as_stream(stream_)), "ncclAllReduce");
  sync();
}

void NcclComm::gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) {
  if (aborted_) throw CommAborted("NCCL: the communicator was aborted");
  // Every rank learns every count (one int64 each), so root knows where each block goes.
  check_cuda(cudaMemcpyAsync(counts_ + rank_, &count, sizeof(int64_t), cudaMemcpyHostToDevice, as_stream(stream_)), "cudaMemcpyAsync");
  check_nccl(ncclAllGather(counts_ + rank_, counts_, 1, ncclInt64, comm_, as_stream(stream_)), "ncclAllGather");
  std::vector<int64_t> counts(static_cast<size_t>(size_));
  check_cuda(cudaMemcpyAsync(counts.data(), counts_, sizeof(int64_t) * counts.size(), cudaMemcpyDeviceToHost, as_stream(stream_)),
             "cudaMemcpyAsync");
  sync();
  if (rank_ == root) {
    int64_t total = 0;
    for (int64_t c : counts) total += std::max<int64_t>(c, 0);
    if (total > capacity) {
      abort();
      throw CommAborted("NCCL gather: " + std::to_string(total) + " values into room for " + std::to_string(capacity) + " (ranks out of step)");
    }
  }
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  if (rank_ == root) {
    int64_t off = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t c = counts[size_t(r)];
      if (r == root) {
        if (c > 0)
          check_cuda(cudaMemcpyAsync(recv + off, send, size_t(c) * sizeof(float), cudaMemcpyDeviceToDevice, as_stream(stream_)),
                     "cudaMemcpyAsync");
      } else if (c > 0) {
        check_nccl(ncclRecv(recv + off, size_t(c), ncclFloat32, r, comm_, as_stream(stream_)), "ncclRecv");
      }
      off += c;
    }
  } else if (count > 0) {
    check_nccl(ncclSend(send, size_t(count), ncclFloat32, root, comm_, as_stream(stream_)), "ncclSend");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  sync();
}

void NcclComm::barrier() {
  if (aborted_) throw CommAborted("NCCL: the communicator was aborted");
  check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, as_stream(stream_)), "ncclAllReduce");
  sync();
}

void NcclComm::abort() {
  aborted_ = true;  // collectives throw from now on
  if (comm_) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

}  // namespace llmq
