#include "engine/parallel/tp_process.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "engine/parallel/comm_mpi.h"
#include "base/error.h"

namespace llmq {

namespace {

enum : uint32_t { kCache = 2, kForward = 3, kStop = 4 };

template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

struct Reader {
  const std::vector<uint8_t>& in;
  size_t at = 0;
  template <class T>
  T get() {
    T v{};
    if (at + sizeof v > in.size()) throw UsageError("tensor parallel: a truncated command from rank 0");
    std::memcpy(&v, in.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  void done() const {  // the whole command was read: trailing bytes mean the ranks are out of step
    if (at != in.size()) throw UsageError("tensor parallel: a command from rank 0 with " + std::to_string(in.size() - at) + " bytes too many");
  }
};

}  // namespace

ProcessGroupRunner::ProcessGroupRunner(BatchRunner& local, MpiComm& comm) : local_(local), comm_(comm) {
  if (comm.rank() != 0) throw UsageError("ProcessGroupRunner runs on rank 0 (the other ranks serve_process_group)");
}

ProcessGroupRunner::~ProcessGroupRunner() {
  if (failed_) return;
  try {
    const uint32_t stop = kStop;
    comm_.broadcast(&stop, sizeof stop);
    comm_.mark_done();
  } catch (...) {  // cannot happen over MPI (a failure there ends the job); the destructor must not throw
  }
}

void ProcessGroupRunner::send(const std::vector<uint8_t>& msg) {
  try {
    comm_.broadcast(msg.data(), msg.size());
  } catch (...) {
    failed_ = true;
    comm_.abort();
    throw;
  }
}

KVCache ProcessGroupRunner::make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) {
  KVCache cache = local_.make_cache(n_blocks, block_tokens, type);  // a shape this rank refuses is refused before the others hear of it
  msg_.clear();
  put<uint32_t>(msg_, kCache);
  put<int64_t>(msg_, n_blocks);
  put<int64_t>(msg_, block_tokens);
  put<int32_t>(msg_, int32_t(type));
  send(msg_);
  return cache;
}

const float* ProcessGroupRunner::forward(KVCache& cache, const BatchToken* batch, int64_t n) {
  if (failed_) throw UsageError("tensor parallel: a rank failed earlier; the ranks cannot continue");
  plan_batch(model(), cache, batch, n, capacity(), plan_);  // validates before any rank is told anything
  msg_.clear();
  put<uint32_t>(msg_, kForward);
  put<int64_t>(msg_, n);
  put<int64_t>(msg_, int64_t(plan_.ends.size()));
  for (int64_t i = 0; i < n; ++i) {
    put<int32_t>(msg_, batch[i].seq);
    put<int32_t>(msg_, batch[i].token);
    put<int32_t>(msg_, batch[i].logits ? 1 : 0);
  }
  for (const auto& [seq, end] : plan_.ends) {
    const std::vector<int32_t>& blocks = cache.blocks(seq);
    put<int32_t>(msg_, seq);
    put<int64_t>(msg_, cache.length(seq));
    put<int64_t>(msg_, int64_t(blocks.size()));
    for (int32_t b : blocks) put<int32_t>(msg_, b);
  }
  send(msg_);
  try {
    return local_.forward(cache, batch, n);
  } catch (...) {
    failed_ = true;
    comm_.abort();  // the other ranks stop waiting for this one
    throw;
  }
}

void serve_process_group(BatchRunner& local, MpiComm& comm) {
  if (comm.rank() == 0) throw UsageError("serve_process_group runs on the ranks other than 0");
  std::unique_ptr<KVCache> cache;
  std::vector<BatchToken> batch;
  std::vector<int32_t> blocks, sent;
  try {
    while (true) {
      const std::vector<uint8_t> msg = comm.recv_broadcast();
      Reader in{msg};
      const uint32_t kind = in.get<uint32_t>();
      if (kind == kStop) {
        in.done();
        comm.mark_done();
        return;
      }
      if (kind == kCache) {
        const int64_t n_blocks = in.get<int64_t>(), bt = in.get<int64_t>();
        const int32_t type = in.get<int32_t>();
        if (type != int32_t(KvType::F32) && type != int32_t(KvType::BF16)) throw UsageError("tensor parallel: unknown KV cache type from rank 0");
        in.done();
        cache.reset();  // one cache at a time (rank 0's previous one is gone): free it before the next
        cache = std::make_unique<KVCache>(local.make_cache(n_blocks, bt, KvType(type)));
      } else if (kind == kForward) {
        if (!cache) throw UsageError("tensor parallel: a forward pass before the KV cache");
        const int64_t T = in.get<int64_t>(), S = in.get<int64_t>();
        if (T <= 0 || T > local.capacity() || S <= 0 || S > T) throw UsageError("tensor parallel: a malformed forward command from rank 0");
        batch.resize(size_t(T));
        for (BatchToken& b : batch) {
          b.seq = in.get<int32_t>();
          b.token = in.get<int32_t>();
          b.logits = in.get<int32_t>() != 0;
        }
        sent.clear();
        for (int64_t s = 0; s < S; ++s) {
          const int32_t seq = in.get<int32_t>();
          const int64_t length = in.get<int64_t>(), nb = in.get<int64_t>();
          if (nb < 0 || nb > cache->n_blocks()) throw UsageError("tensor parallel: a malformed block table from rank 0");
          blocks.resize(size_t(nb));
          for (int32_t& b : blocks) b = in.get<int32_t>();
          cache->mirror(seq, blocks.data(), nb, length);
          sent.push_back(seq);
        }
        in.done();
        for (const BatchToken& b : batch)  // every token's sequence came with its table (none stale from an earlier step)
          if (std::find(sent.begin(), sent.end(), b.seq) == sent.end())
            throw UsageError("tensor parallel: a batch token of sequence " + std::to_string(b.seq) + " without its block table");
        local.forward(*cache, batch.data(), T);
      } else {
        throw UsageError("tensor parallel: unknown command " + std::to_string(kind) + " from rank 0");
      }
    }
  } catch (...) {
    comm.abort();  // prints the error and ends the job: rank 0 and the others stop waiting for this rank
    throw;
  }
}

}  // namespace llmq
