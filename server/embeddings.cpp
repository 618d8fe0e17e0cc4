#include "server/embeddings.h"

#include <cstring>
#include <memory>

#include "server/api.h"
#include "server/scheduler.h"

namespace llmq {

std::vector<std::vector<float>> run_embeddings(Scheduler& sched, const std::vector<std::vector<int32_t>>& inputs, Pooling pooling,
                                               int window, const std::atomic<bool>& stop) {
  if (!sched.has_hidden())
    throw ApiError(400, "embeddings need the CPU forward pass in the server's process (not --device cuda, nor ranks as MPI processes)", "input");
  for (size_t i = 0; i < inputs.size(); ++i)
    if (int64_t(inputs[i].size()) > sched.options().ctx)
      throw ApiError(400, "input " + std::to_string(i) + " has " + std::to_string(inputs[i].size()) + " tokens; the context is " +
                              std::to_string(sched.options().ctx),
                     "input", "context_length_exceeded");
  std::vector<std::shared_ptr<GenRequest>> gs;
  auto cancel_all = [&] {
    for (const auto& g : gs) g->cancel();
  };
  std::vector<std::vector<float>> out(inputs.size());
  size_t done = 0;
  while (done < inputs.size()) {
    while (gs.size() < inputs.size() && gs.size() - done < size_t(std::max(window, 1))) {
      GenParams p;
      p.prompt = inputs[gs.size()];
      p.max_tokens = 0;
      p.embed = pooling;
      gs.push_back(std::make_shared<GenRequest>(std::move(p)));
      const Scheduler::Submit sub = sched.submit(gs.back());
      if (sub == Scheduler::Submit::Ok) continue;
      cancel_all();
      if (sub != Scheduler::Submit::QueueFull)  // checked above; the scheduler refuses them too
        throw ApiError(400, "input " + std::to_string(gs.size() - 1) + " cannot be embedded here", "input");
      throw ApiError(429, "the server is busy: too many requests queued; retry later", "", "rate_limit_exceeded", "rate_limit_error");
    }
    std::vector<GenEvent> ignored;
    while (gs[done]->wait(&ignored, 200))
      if (stop) {
        cancel_all();
        throw ApiError(503, "the server is shutting down: the embeddings were cancelled", "", "", "server_error");
      }
    if (gs[done]->embedding.empty()) {
      cancel_all();
      throw ApiError(500, "input " + std::to_string(done) + " failed: " + gs[done]->finish_reason, "", "", "server_error");
    }
    out[done] = std::move(gs[done]->embedding);
    ++done;
  }
  return out;
}

std::string base64_floats(const std::vector<float>& v) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes(v.size() * sizeof(float), '\0');
  if (!v.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());  // x86-64 and AArch64 Linux are little-endian
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t w = 0;
    for (size_t k = 0; k < 3; ++k) w = (w << 8) | (k < n ? uint8_t(bytes[i + k]) : 0u);
    for (size_t k = 0; k < 4; ++k) out += k <= n ? abc[(w >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}

nlohmann::json embeddings_json(const std::vector<std::vector<float>>& vectors, bool base64, const std::string& model,
                               int64_t prompt_tokens) {
  nlohmann::json data = nlohmann::json::array();
  for (size_t i = 0; i < vectors.size(); ++i) {
    nlohmann::json e = {{"object", "embedding"}, {"index", i}};
    if (base64) e["embedding"] = base64_floats(vectors[i]);
    else e["embedding"] = vectors[i];
    data.push_back(std::move(e));
  }
  return {{"object", "list"}, {"data", std::move(data)}, {"model", model}, {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

}  // namespace llmq
