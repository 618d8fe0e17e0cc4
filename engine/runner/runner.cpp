#include "engine/runner/runner.h"

#include "base/error.h"
#include "engine/mem_plan.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/parallel/tp_process.h"

namespace llmq {

namespace {

// Whether the GPU takes only the last layers (partial offload, --gpu-layers N < n_layers).
bool partial_offload(const Model& m, const RunnerOptions& o) {
  return o.place.device == Device::Cuda && o.place.gpu_layers >= 0 && o.place.gpu_layers < m.config.n_layers;
}

// This process's rank of a process group: the CPU's TensorParallel rank or a GPU rank.
std::unique_ptr<BatchRunner> process_rank(const Model& m, const RunnerOptions& o, MpiComm& g, const TensorParallel** ranks) {
  const int64_t parallel = std::max<int64_t>(1, o.parallel);
  if (o.place.device == Device::Cuda)
    return make_cuda_rank_runner(m, g, o.ctx, o.n_batch, parallel, o.kv_tokens, o.progress, o.gpu_kv_q8);
  TpOptions tpo;
  tpo.vocab_parallel = o.vocab_parallel;
  auto t = std::make_unique<TensorParallel>(m, g.size(), g.rank(), g, o.threads, o.capacity, tpo);
  *ranks = t.get();
  return t;
}

}  // namespace

RunnerOptions resolve(const Model& m, RunnerOptions o) {
  if (o.parallel <= 0) {  // one sequence: the session's sizes (engine/mem_plan.h)
    const SessionSizes s = session_sizes(m.config, o.ctx, o.n_batch);
    o.ctx = s.ctx;
    if (o.capacity <= 0) o.capacity = std::max(s.n_batch, o.logits_rows);
  } else {  // batching: the scheduler's
    if (o.ctx <= 0) o.ctx = std::min(m.config.context_length, kDefaultMaxCtx);
    if (o.capacity <= 0) o.capacity = std::max<int64_t>(o.n_batch, o.parallel);
  }
  return o;
}

Runner::~Runner() = default;

SessionBase& Runner::session() {
  if (!session_) throw UsageError(follower_ ? "a following rank has no session of its own" : "this runner was made for batches (parallel >= 1)");
  return *session_;
}

BatchRunner& Runner::batch() {
  if (!batch_) throw UsageError("this runner has no batch runner (one sequence on the GPU)");
  return *batch_;
}

int Runner::group_rank() const { return group_ ? group_->rank() : 0; }

int Runner::serve() {
  if (!follower_) throw UsageError("serve: only a rank > 0 of a process group follows");
  serve_process_group(*local_, *group_);
  return 0;
}

std::unique_ptr<Runner> make_runner(const Model& m, const RunnerOptions& given) {
  const RunnerOptions o = resolve(m, given);
  std::unique_ptr<Runner> r(new Runner(m));
  const bool one = o.parallel <= 0, partial = partial_offload(m, o), gpu = o.place.device == Device::Cuda;
  if (partial && o.place.tp > 1) throw UsageError("partial offload (--gpu-layers) runs one rank: not with --tp");
  if (o.group) {  // ranks as processes: rank 0 drives the group, the others follow it
    r->group_ = o.group;
    r->local_ = process_rank(m, o, *o.group, &r->ranks_);
    r->follower_ = o.group->rank() > 0;
    if (r->follower_) return r;
    r->batch_ = std::make_unique<ProcessGroupRunner>(*r->local_, *o.group);
  } else if (gpu) {  // the whole model (or its last layers) on the GPU, one rank or several
    if (partial) r->pool_ = std::make_unique<ThreadPool>(o.threads);
    const int64_t gl = partial ? o.place.gpu_layers : -1;
    if (one)
      r->session_ = make_cuda_session(m, o.ctx, o.n_batch, o.logits_rows, o.progress, gl, r->pool_.get(), o.place.tp, o.gpu_kv_q8);
    else
      r->batch_ = make_cuda_batch_runner(m, o.ctx, o.n_batch, o.parallel, o.kv_tokens, o.progress, o.place.tp, gl,
                                         r->pool_.get(), o.gpu_kv_q8);
    return r;
  } else if (o.place.tp > 1) {  // CPU ranks as threads of this process
    TpOptions tpo;
    tpo.vocab_parallel = o.vocab_parallel;
    auto t = std::make_unique<TensorParallel>(m, o.place.tp, o.threads, o.capacity, tpo);
    r->ranks_ = t.get();
    r->batch_ = std::move(t);
  } else {  // the CPU, one rank: buffers from the plan llmq-mem reports
    r->pool_ = std::make_unique<ThreadPool>(o.threads);
    if (one) {
      r->session_ = std::make_unique<Session>(m, *r->pool_, o.ctx, o.n_batch, o.logits_rows, o.kv_type);
      return r;
    }
    const InferencePlan p = plan_inference(*m.file, m.config, o.ctx, o.n_batch, r->pool_->size(), o.parallel, true, o.kv_tokens);
    auto t = std::make_unique<TensorParallel>(m, *r->pool_, p.ws);
    r->ranks_ = t.get();
    r->batch_ = std::move(t);
    return r;
  }
  if (one) r->session_ = std::make_unique<Session>(*r->batch_, o.ctx, o.kv_type);
  return r;
}

}  // namespace llmq
