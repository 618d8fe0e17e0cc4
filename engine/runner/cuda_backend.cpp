// The CUDA backend's entry points (engine/runner/cuda_backend.h): the GPU side of device.h's
// make_cuda_session, make_cuda_batch_runner and make_cuda_rank_runner. Built into the plugin
// libllmq-cuda.so and, for the programs that use engine/cuda/ directly, linked in.
#include "engine/runner/cuda_backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/cuda/cuda.h"
#include "engine/cuda/session.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/runner/device.h"
#ifdef LLMQ_HAVE_NCCL
#include <exception>
#include <thread>

#include "engine/cuda/comm_nccl.h"
#endif

namespace llmq {

namespace {

// LLMQ_TP_COMM: auto (default), host or nccl. Throws UsageError for anything else, and for nccl
// in a build without NCCL.
std::string tp_comm_mode() {
  const char* env = std::getenv("LLMQ_TP_COMM");
  const std::string mode = env ? env : "auto";
  if (mode != "auto" && mode != "host" && mode != "nccl") throw UsageError("LLMQ_TP_COMM must be auto, host or nccl, not '" + mode + "'");
#ifndef LLMQ_HAVE_NCCL
  if (mode == "nccl") throw UsageError("LLMQ_TP_COMM=nccl: this build has no NCCL communicator (NCCL was not found when it was configured)");
#endif
  return mode;
}

// One NCCL communicator per GPU for `tp` ranks when the build has NCCL and the machine has tp
// GPUs (the ranks join at once: ncclCommInitRank blocks until all have); else none, and the
// ranks share GPU 0 over a host all-reduce. LLMQ_TP_COMM=host forces the latter, =nccl the
// former (an error without NCCL or with fewer GPUs than ranks).
cuda::CudaComms nccl_comms(int tp) {
  cuda::CudaComms c;
  if (tp < 2) return c;
  const std::string mode = tp_comm_mode();
  if (mode == "host") return c;
  const int gpus = cuda::device_count();
#ifdef LLMQ_HAVE_NCCL
  if (gpus < tp) {
    if (mode == "nccl")
      throw UsageError("--tp " + std::to_string(tp) + " over NCCL needs " + std::to_string(tp) + " GPUs (one rank per GPU): this machine has " +
                       std::to_string(gpus));
    return c;
  }
  const ncclUniqueId id = NcclComm::make_id();
  c.comms.resize(size_t(tp));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(tp));
  std::vector<std::thread> joins;
  for (int r = 0; r < tp; ++r)
    joins.emplace_back([&, r] {
      try {
        c.comms[size_t(r)] = std::make_unique<NcclComm>(r, tp, id, r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : joins) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < tp; ++r) c.devices.push_back(r);
#else
  (void)gpus;
#endif
  return c;
}

// A communicator owned elsewhere (the tool's MpiComm), handed to CudaComms, which owns its
// communicators.
class BorrowedComm final : public Communicator {
 public:
  explicit BorrowedComm(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void all_reduce_sum(float* buf, int64_t n) override { c_.all_reduce_sum(buf, n); }
  void gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) override {
    c_.gather(send, count, recv, capacity, root);
  }
  void barrier() override { c_.barrier(); }
  void abort() override { c_.abort(); }

 private:
  Communicator& c_;
};

// Makes GPU `device` current and creates its CUDA context (so a load measured after this does
// not count it); returns its memory then.
cuda::MemInfo open_gpu(int device = 0) {
  cuda::check(cudaSetDevice(device), "cudaSetDevice");
  cuda::check(cudaFree(nullptr), "CUDA context");
  return cuda::mem_info();
}

double mib(uint64_t bytes) { return double(bytes) / double(1ull << 20); }

int backend_device_count() { return cuda::device_count(); }

uint64_t backend_free_bytes() {
  if (cuda::device_count() == 0) throw UsageError("no CUDA device is present");
  return open_gpu().free;
}

std::unique_ptr<SessionBase> backend_make_session(const Model& m, int64_t ctx, int64_t n_batch, int64_t logits_rows, bool progress,
                                               int64_t gpu_layers, ThreadPool* pool, int tp, bool kv_q8) {
  using cuda::mem_info;
  const int64_t L = m.config.n_layers;
  if (gpu_layers > L) throw UsageError("--gpu-layers " + std::to_string(gpu_layers) + ": the model has " + std::to_string(L) + " layers");
  const bool partial = gpu_layers >= 0 && gpu_layers < L;
  if (partial && (tp > 1 || !pool))
    throw UsageError(tp > 1 ? "--gpu-layers with --tp: partial offload runs one rank, so far" : "partial offload needs a CPU thread pool");
  const cuda::MemInfo before = open_gpu();
  if (tp > 1) {
    cuda::CudaComms comms = nccl_comms(tp);
    const bool nccl = !comms.comms.empty();
    auto s = std::make_unique<cuda::CudaTpSession>(m, tp, ctx, n_batch, logits_rows, progress, std::move(comms), kv_q8);
    const cuda::MemInfo after = mem_info();
    std::fprintf(stderr, "llmq: GPU 0: %s; tensor parallel over %d ranks %s\n", cuda::device_description(0).c_str(), tp,
                 nccl ? "on as many GPUs (NCCL all-reduce)" : "on this GPU (host all-reduce)");
    for (int r = 0; r < tp; ++r) {
      const cuda::CudaSession& rs = s->rank_session(r);
      std::fprintf(stderr, "llmq: rank %d: weights %.1f MiB, KV cache %.1f MiB (%s), workspace %.1f MiB\n", r,
                   mib(s->rank_model(r).weight_bytes()), mib(rs.kv_bytes()), kv_q8 ? "q8_0" : "f16", mib(rs.workspace_bytes()));
    }
    std::fprintf(stderr, "llmq: GPU 0 memory measured at load: %.1f MiB (cudaMemGetInfo)\n", mib(before.free - after.free));
    return s;
  }
  std::unique_ptr<cuda::CudaModel> dm;
  std::unique_ptr<SessionBase> s;
  const cuda::CudaModel* dmp = nullptr;
  const cuda::CudaSession* gpu = nullptr;
  cuda::CudaOffloadSession* off = nullptr;
  if (partial) {
    auto o = std::make_unique<cuda::CudaOffloadSession>(m, *pool, gpu_layers, ctx, n_batch, logits_rows, progress, kv_q8);
    off = o.get(), dmp = &o->device_model(), gpu = &o->gpu();
    s = std::move(o);
  } else {
    dm = std::make_unique<cuda::CudaModel>(m, progress);
    auto c = std::make_unique<cuda::CudaSession>(*dm, &m, plan_cuda(m.config, {}, ctx, n_batch, logits_rows, -1, kv_q8));
    dmp = dm.get(), gpu = c.get();
    s = std::move(c);
  }
  const cuda::MemInfo after = mem_info();
  std::fprintf(stderr,
               "llmq: GPU 0: %s\n"
               "llmq: GPU memory: weights %.1f MiB (%lld of %lld layers), KV cache %.1f MiB (%s, ctx %lld), workspace %.1f MiB "
               "(n_batch %lld); allocated %.1f MiB, measured %.1f MiB (cudaMemGetInfo); CUDA context and other processes before "
               "loading: %.1f MiB\n",
               cuda::device_description(0).c_str(), mib(dmp->weight_bytes()), (long long)(L - dmp->first_layer()), (long long)L,
               mib(gpu->kv_bytes()), kv_q8 ? "q8_0" : "f16", (long long)gpu->ctx(), mib(gpu->workspace_bytes()), (long long)gpu->n_batch(),
               mib(dmp->weight_bytes() + gpu->state_bytes()), mib(before.free - after.free), mib(before.total - before.free));
  if (off)
    std::fprintf(stderr,
                 "llmq: CPU part (partial offload): layers 0-%lld on %d threads, their weights in the mapped file (%.1f MiB repacked), "
                 "KV cache %.1f MiB (f32), workspace %.1f MiB\n",
                 (long long)(off->cpu_layers() - 1), pool->size(), mib(m.packed.bytes()), mib(off->host_kv_bytes()),
                 mib(off->host_workspace_bytes()));
  if (dm) static_cast<cuda::CudaSession&>(*s).own(std::move(dm));
  return s;
}

std::unique_ptr<BatchRunner> backend_make_batch_runner(const Model& m, int64_t ctx, int64_t n_batch, int64_t parallel, int64_t kv_tokens,
                                                    bool progress, int tp, int64_t gpu_layers, ThreadPool* pool, bool kv_q8) {
  using cuda::mem_info;
  const cuda::MemInfo before = open_gpu();
  const int64_t L = m.config.n_layers;
  if (gpu_layers > L) throw UsageError("--gpu-layers " + std::to_string(gpu_layers) + ": the model has " + std::to_string(L) + " layers");
  if (gpu_layers >= 0 && gpu_layers < L) {  // partial offload
    if (tp > 1) throw UsageError("--gpu-layers with --tp: partial offload runs one rank, so far");
    if (!pool) throw UsageError("partial offload needs a CPU thread pool");
    auto r = std::make_unique<cuda::CudaOffloadBatchRunner>(m, *pool, gpu_layers, ctx, n_batch, parallel, kv_tokens, progress, kv_q8);
    const cuda::MemInfo after = mem_info();
    const CudaPlan& p = r->plan();
    std::fprintf(stderr,
                 "llmq: GPU 0: %s\n"
                 "llmq: GPU memory: weights %.1f MiB (%lld of %lld layers), KV cache %.1f MiB (%s, %lld blocks of %lld positions), "
                 "workspace %.1f MiB; measured %.1f MiB (cudaMemGetInfo)\n"
                 "llmq: CPU part (partial offload): layers 0-%lld on %d threads, workspace %.1f MiB; their KV cache is the scheduler's "
                 "(host)\n",
                 cuda::device_description(0).c_str(), mib(r->device_model().weight_bytes()), (long long)gpu_layers, (long long)L,
                 mib(r->session().kv_bytes()), kv_q8 ? "q8_0" : "f16", (long long)p.kv_blocks, (long long)p.block_tokens,
                 mib(r->session().workspace_bytes()),
                 mib(before.free - after.free), (long long)(r->cpu_layers() - 1), pool->size(), mib(r->host_workspace_bytes()));
    return r;
  }
  cuda::CudaComms comms = nccl_comms(tp);
  const bool nccl = !comms.comms.empty();
  auto r = std::make_unique<cuda::CudaBatchRunner>(m, ctx, n_batch, parallel, kv_tokens, progress, tp, std::move(comms), kv_q8);
  const cuda::MemInfo after = mem_info();
  const CudaPlan& p = r->plan();
  uint64_t weights = 0;
  for (int i = 0; i < r->ranks(); ++i) weights += r->device_model(i).weight_bytes();
  std::fprintf(stderr,
               "llmq: GPU 0: %s%s\n"
               "llmq: GPU memory: weights %.1f MiB, KV cache %.1f MiB (%s, %lld blocks of %lld positions, paged over %lld sequences), "
               "workspace %.1f MiB (batch %lld); allocated %.1f MiB, measured %.1f MiB on GPU 0 (cudaMemGetInfo); CUDA context and "
               "other processes before loading: %.1f MiB\n",
               cuda::device_description(0).c_str(),
               tp > 1 ? (nccl ? "; tensor parallel, one rank per GPU (NCCL)" : "; tensor parallel, the ranks on this GPU (host all-reduce)") : "",
               mib(weights), mib(r->kv_bytes(KVCache::tables_only(m.config, 1, 1))), kv_q8 ? "q8_0" : "f16", (long long)p.kv_blocks,
               (long long)p.block_tokens,
               (long long)p.parallel, mib(r->workspace_bytes()), (long long)p.n_batch,
               mib(weights + r->kv_bytes(KVCache::tables_only(m.config, 1, 1)) + r->workspace_bytes()), mib(before.free - after.free),
               mib(before.total - before.free));
  return r;
}

std::unique_ptr<BatchRunner> backend_make_rank_runner(const Model& m, MpiComm& comm, int64_t ctx, int64_t n_batch, int64_t parallel,
                                                   int64_t kv_tokens, bool progress, bool kv_q8) {
  const int rank = comm.rank(), tp = comm.size();
  const int gpus = cuda::device_count();
  if (gpus == 0) throw UsageError("--device cuda: no CUDA device is present");
  const int device = comm.local_rank() % gpus;  // one GPU per rank on each machine
  const cuda::MemInfo before = open_gpu(device);
  // Rank 0 decides how the ranks all-reduce and tells the others: [u8 nccl][the NCCL unique id].
  std::vector<uint8_t> msg;
  if (rank == 0) {  // rank 0's LLMQ_TP_COMM decides for all
    const std::string mode = tp_comm_mode();
#ifdef LLMQ_HAVE_NCCL
    msg.push_back(mode != "host");
    if (msg[0]) {
      const ncclUniqueId id = NcclComm::make_id();
      msg.insert(msg.end(), reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof id);
    }
#else
    (void)mode;  // host or auto: MPI through host memory (nccl was refused above)
    msg.push_back(0);
#endif
    comm.broadcast(msg.data(), msg.size());
  } else {
    msg = comm.recv_broadcast();
    if (msg.empty()) throw UsageError("tensor parallel: an empty choice of communicator from rank 0");
  }
  cuda::CudaComms comms;
  comms.local_rank = rank;
  comms.devices = {device};
  if (msg[0]) {
#ifdef LLMQ_HAVE_NCCL
    ncclUniqueId id;
    if (msg.size() != 1 + sizeof id) throw UsageError("tensor parallel: a malformed NCCL unique id from rank 0");
    std::memcpy(&id, msg.data() + 1, sizeof id);
    // No watch: a rank's process that dies ends the whole MPI job (mpirun), waiting ranks included.
    comms.comms.push_back(std::make_unique<NcclComm>(rank, tp, id, device));
    comms.device_memory = true;
#else
    throw UsageError("tensor parallel: rank 0 all-reduces over NCCL and this build has none (set LLMQ_TP_COMM=host on rank 0)");
#endif
  } else {
    comms.comms.push_back(std::make_unique<BorrowedComm>(comm));
    comms.device_memory = false;
  }
  const bool nccl = comms.device_memory;
  auto r = std::make_unique<cuda::CudaBatchRunner>(m, ctx, n_batch, parallel, kv_tokens, progress, tp, std::move(comms), kv_q8);
  const cuda::MemInfo after = cuda::mem_info();
  const CudaPlan& p = r->plan();
  if (rank > 0) return r;  // only rank 0 prints (the ranks' shards differ by a head or so)
  std::fprintf(stderr,
               "llmq: rank %d of %d on GPU %d: %s; all-reduce over %s\n"
               "llmq: rank %d GPU memory: weights %.1f MiB, KV cache %.1f MiB (%s, %lld blocks of %lld positions), workspace %.1f MiB; "
               "measured %.1f MiB (cudaMemGetInfo)\n",
               rank, tp, device, cuda::device_description(device).c_str(), nccl ? "NCCL" : "MPI (host memory)", rank,
               mib(r->device_model(0).weight_bytes()), mib(r->kv_bytes(KVCache::tables_only(m.config, 1, 1))), kv_q8 ? "q8_0" : "f16",
               (long long)p.kv_blocks, (long long)p.block_tokens, mib(r->workspace_bytes()), mib(before.free - after.free));
  return r;
}

}  // namespace

}  // namespace llmq

extern "C" const llmq::CudaBackendApi* llmq_cuda_backend() {
  static const llmq::CudaBackendApi api{llmq::kCudaBackendAbi,       LLMQ_VERSION,
                                        uint32_t(sizeof(llmq::Model)), llmq::backend_device_count,
                                        llmq::backend_free_bytes,      llmq::backend_make_session,
                                        llmq::backend_make_batch_runner, llmq::backend_make_rank_runner};
  return &api;
}
