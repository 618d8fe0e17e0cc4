// The CUDA emulator's runtime (engine/cuda/emu/emu.h): fibers for the threads of a block, the
// CUDA runtime and cuBLAS calls the engine makes, against the real headers' declarations.
// x86-64 only (the context switch is a few lines of assembly).
#include <cublas_v2.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cuda/emu/emu.h"

// The context switch between fibers (x86-64 System V): push the callee-saved registers on the
// current stack, save its stack pointer in *from, load `to`, pop the other fiber's registers and
// return into it. No system call, unlike swapcontext (which saves the signal mask): a block's
// threads meet at a barrier for every warp shuffle, so switches are the emulator's main cost.
extern "C" void llmq_emu_switch(void** from, void* to);
asm(R"(
.text
.globl llmq_emu_switch
.type llmq_emu_switch, @function
llmq_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size llmq_emu_switch, .-llmq_emu_switch
)");

namespace llmq::cuda::emu {

thread_local dim3 g_block_idx, g_block_dim, g_grid_dim;

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr uint64_t kFakeMemory = 80ull << 30;  // what cudaMemGetInfo reports as total

struct Barrier {
  int arrived = 0;
  uint64_t gen = 0;
};

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  std::unique_ptr<char[]> stack;
  uint3 tid{};
  int warp = 0, lane = 0;
  bool done = false;
};

struct Block {
  std::vector<Fiber> fibers;  // grows to the largest block seen, stacks kept
  int n = 0;                  // threads of the block running now
  Fiber* cur = nullptr;
  void* sched_sp = nullptr;  // the scheduler's stack pointer while a fiber runs
  Barrier block_bar;
  std::vector<Barrier> warp_bar;
  std::vector<int> warp_live;
  std::vector<uint64_t> slots;  // [warps, 32]
  std::vector<uint64_t> exchange;  // [warps, 32, 8]: warp_exchange
  int live = 0;
  bool progress = false;
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;
  std::vector<max_align_t> smem;  // dynamic shared memory
};
thread_local Block B;  // each host thread runs its own blocks

void yield() { llmq_emu_switch(&B.cur->sp, B.sched_sp); }

[[noreturn]] void fiber_entry() {
  try {
    (*B.body)();
  } catch (...) {
    if (!B.error) B.error = std::current_exception();
  }
  Fiber* f = B.cur;
  f->done = true;
  --B.live;
  --B.warp_live[size_t(f->warp)];
  B.progress = true;
  // A barrier whose other participants have all arrived opens now that this thread is gone.
  if (B.block_bar.arrived > 0 && B.block_bar.arrived == B.live) B.block_bar.arrived = 0, ++B.block_bar.gen;
  Barrier& w = B.warp_bar[size_t(f->warp)];
  if (w.arrived > 0 && w.arrived == B.warp_live[size_t(f->warp)]) w.arrived = 0, ++w.gen;
  void* dead = nullptr;
  llmq_emu_switch(&dead, B.sched_sp);  // never resumed
  __builtin_unreachable();
}

// A fresh stack whose first switch-in "returns" into fiber_entry: six register slots, then the
// return address, placed so that fiber_entry starts with rsp ≡ 8 (mod 16), as after a call.
void* fresh_stack(char* base, size_t bytes) {
  auto top = (reinterpret_cast<uintptr_t>(base) + bytes) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<void**>(top - 16);
  slot[0] = reinterpret_cast<void*>(&fiber_entry);  // popped by `ret`
  slot[1] = nullptr;
  auto* regs = reinterpret_cast<void**>(top - 64);  // r15 r14 r13 r12 rbx rbp
  for (int i = 0; i < 6; ++i) regs[i] = nullptr;
  return regs;
}

void wait_at(Barrier& b, int participants) {
  const uint64_t gen = b.gen;
  if (++b.arrived == participants) {
    b.arrived = 0, ++b.gen;
    B.progress = true;
    return;
  }
  while (b.gen == gen) yield();
}

void run_block(dim3 block) {
  const int n = int(block.x * block.y * block.z);
  if (B.fibers.size() < size_t(n)) B.fibers.resize(size_t(n));
  const int warps = (n + 31) / 32;
  B.n = n, B.live = n;
  B.block_bar = {};
  B.warp_bar.assign(size_t(warps), Barrier{});
  B.warp_live.assign(size_t(warps), 0);
  B.slots.assign(size_t(warps) * 32, 0);
  B.exchange.assign(size_t(warps) * 32 * 8, 0);
  for (int i = 0; i < n; ++i) {
    Fiber& f = B.fibers[size_t(i)];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.tid = {unsigned(i) % block.x, unsigned(i) / block.x % block.y, unsigned(i) / (block.x * block.y)};
    f.warp = i / 32, f.lane = i % 32, f.done = false;
    ++B.warp_live[size_t(f.warp)];
    f.sp = fresh_stack(f.stack.get(), kStackBytes);
  }
  while (B.live > 0) {
    B.progress = false;
    for (int i = 0; i < n; ++i) {
      Fiber& f = B.fibers[size_t(i)];
      if (f.done) continue;
      B.cur = &f;
      llmq_emu_switch(&B.sched_sp, f.sp);
    }
    if (!B.progress && B.live > 0)
      throw std::runtime_error("CUDA emulator: a barrier (__syncthreads or a warp shuffle) that not every live thread reaches");
  }
  B.cur = nullptr;
  if (B.error) std::rethrow_exception(std::exchange(B.error, nullptr));
}

// Streams: work runs at once, or is recorded while the stream captures a graph.
struct Stream {
  std::vector<std::function<void()>>* capture = nullptr;
};
struct Graph {
  std::vector<std::function<void()>> ops;
};

void enqueue(cudaStream_t s, std::function<void()> op) {
  auto* st = reinterpret_cast<Stream*>(s);
  if (st && st->capture) st->capture->push_back(std::move(op));
  else op();
}

thread_local cudaError_t g_last = cudaSuccess;  // per host thread, as CUDA's
std::mutex g_mu;                          // guards the three below (host threads share the "device")
std::map<const void*, int> g_smem_limit;  // cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
std::map<void*, size_t> g_allocs;
uint64_t g_allocated = 0;

}  // namespace

const uint3& thread_idx() { return B.cur->tid; }
int lane() { return B.cur->lane; }
void sync_block() { wait_at(B.block_bar, B.live); }
void sync_warp() {
  if (B.warp_live[size_t(B.cur->warp)] != 32 && B.n % 32 == 0)
    throw std::runtime_error("CUDA emulator: a full-warp shuffle with lanes that have exited");
  wait_at(B.warp_bar[size_t(B.cur->warp)], B.warp_live[size_t(B.cur->warp)]);
}
uint64_t* warp_slots() { return B.slots.data() + size_t(B.cur->warp) * 32; }
uint64_t* warp_exchange() { return B.exchange.data() + size_t(B.cur->warp) * 32 * 8; }
unsigned char* dynamic_smem() { return reinterpret_cast<unsigned char*>(B.smem.data()); }

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s, std::function<void()> body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  size_t smem_max = 48 * 1024;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto lim = g_smem_limit.find(kernel);
    if (lim != g_smem_limit.end()) smem_max = size_t(lim->second);
  }
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    g_last = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > smem_max) {
    g_last = cudaErrorInvalidValue;
    return;
  }
  enqueue(s, [grid, block, smem, body = std::move(body)] {
    B.smem.assign((smem + sizeof(max_align_t) - 1) / sizeof(max_align_t) + 1, max_align_t{});
    B.body = &body;
    g_grid_dim = grid, g_block_dim = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          g_block_idx = dim3(x, y, z);
          run_block(block);
        }
    B.body = nullptr;
  });
}

}  // namespace llmq::cuda::emu

using namespace llmq::cuda::emu;

// ---------------------------------------------------------------- the CUDA runtime

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "llmq CUDA emulator (CPU)");
  p->major = 9, p->minor = 0, p->multiProcessorCount = 132, p->totalGlobalMem = kFakeMemory;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  // The device cudaGetDeviceProperties describes: 132 SMs, compute capability 9.0.
  *v = attr == cudaDevAttrMultiProcessorCount ? 132 : attr == cudaDevAttrComputeCapabilityMajor ? 9 : 0;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return std::exchange(g_last, cudaSuccess); }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulator)";
    case cudaErrorInvalidValue: return "invalid argument (emulator)";
    case cudaErrorMemoryAllocation: return "out of memory (emulator)";
    default: return "error (emulator)";
  }
}
cudaError_t cudaMalloc(void** p, size_t n) {
  *p = std::malloc(n ? n : 1);
  if (!*p) return cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> lk(g_mu);
  g_allocs[*p] = n, g_allocated += n;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;  // cudaFree(nullptr): creates the context on a GPU
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_allocs.find(p);
  if (it == g_allocs.end()) return cudaErrorInvalidValue;
  g_allocated -= it->second;
  g_allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) {
  *p = std::malloc(n ? n : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  std::lock_guard<std::mutex> lk(g_mu);
  *total = kFakeMemory, *free = kFakeMemory - g_allocated;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  enqueue(s, [=] { std::memmove(dst, src, n); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(new Stream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<Stream*>(s);
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  auto* st = reinterpret_cast<Stream*>(s);
  if (!st || st->capture) return cudaErrorInvalidValue;  // the legacy stream cannot capture
  st->capture = new std::vector<std::function<void()>>;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  auto* st = reinterpret_cast<Stream*>(s);
  if (!st || !st->capture) return cudaErrorInvalidValue;
  auto* graph = new Graph{std::move(*st->capture)};
  delete st->capture;
  st->capture = nullptr;
  *g = reinterpret_cast<cudaGraph_t>(graph);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long) {
  *e = reinterpret_cast<cudaGraphExec_t>(new Graph(*reinterpret_cast<Graph*>(g)));
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete reinterpret_cast<Graph*>(g);
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete reinterpret_cast<Graph*>(e);
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  const auto* g = reinterpret_cast<const Graph*>(e);
  enqueue(s, [g] {
    for (const auto& op : g->ops) op();
  });
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* f, cudaFuncAttribute attr, int v) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) g_smem_limit[f] = v;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = reinterpret_cast<cudaEvent_t>(new double(0));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<double*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  *reinterpret_cast<double*>(e) = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = float((*reinterpret_cast<double*>(b) - *reinterpret_cast<double*>(a)) * 1e3);
  return cudaSuccess;
}

// ---------------------------------------------------------------- cuBLAS (the GEMMs the engine uses)

namespace {

struct Handle {
  cudaStream_t stream = nullptr;
};

float load_elem(const void* p, cudaDataType_t t, size_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(p)[i]);
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: throw std::runtime_error("CUDA emulator: GEMM type not emulated");
  }
}

// C [m, n] (column-major, ldc) = alpha op(A) op(B) + beta C, op = transpose or not; fp32 output.
cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha, const void* A,
                    cudaDataType_t at, int lda, const void* B_, cudaDataType_t bt, int ldb, const float* beta, float* C, int ldc) {
  const float al = *alpha, be = *beta;
  enqueue(reinterpret_cast<Handle*>(h)->stream, [=] {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double acc = 0;
        for (int p = 0; p < k; ++p) {
          const size_t ai = ta == CUBLAS_OP_N ? size_t(i) + size_t(p) * lda : size_t(p) + size_t(i) * lda;
          const size_t bi = tb == CUBLAS_OP_N ? size_t(p) + size_t(j) * ldb : size_t(j) + size_t(p) * ldb;
          acc += double(load_elem(A, at, ai)) * double(load_elem(B_, bt, bi));
        }
        float& c = C[size_t(i) + size_t(j) * ldc];
        c = al * float(acc) + (be != 0.0f ? be * c : 0.0f);
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  *h = reinterpret_cast<cublasHandle_t>(new Handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete reinterpret_cast<Handle*>(h);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  reinterpret_cast<Handle*>(h)->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }
const char* cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? "success" : "error (emulator)"; }
cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,
                              const float* A, int lda, const float* B_, int ldb, const float* beta, float* C, int ldc) {
  return gemm(h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, B_, CUDA_R_32F, ldb, beta, C, ldc);
}
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType at, int lda, const void* B_, cudaDataType bt, int ldb, const void* beta, void* C,
                            cudaDataType ct, int ldc, cublasComputeType_t, cublasGemmAlgo_t) {
  if (ct != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  return gemm(h, ta, tb, m, n, k, static_cast<const float*>(alpha), A, at, lda, B_, bt, ldb, static_cast<const float*>(beta),
              static_cast<float*>(C), ldc);
}
