// /v1/embeddings (OpenAI API reference, "Embeddings"): each input's final-norm hidden states
// (engine/model.h Output::Hidden), pooled as the model declares (models/config.h Pooling) and
// L2-normalised, computed by the continuous-batching scheduler beside the completions.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/config.h"

namespace llmq {

class Scheduler;

/// Runs the inputs (token ids, each non-empty) through `sched` as embedding requests
/// (GenParams::embed), at most `window` queued or running at once, so that a request of many
/// inputs never fills the queue; returns their unit vectors [inputs][dim], in order.
/// Polls `stop` (a shutdown): the requests are cancelled and ApiError 503 thrown. Throws ApiError
/// 400 when an input is longer than the context or the runner has no hidden states (a GPU, a
/// process group), 429 when the queue is full, 500 when the scheduler failed an input.
std::vector<std::vector<float>> run_embeddings(Scheduler& sched, const std::vector<std::vector<int32_t>>& inputs, Pooling pooling,
                                               int window, const std::atomic<bool>& stop);

/// Base64 (RFC 4648, padded) of v's little-endian float32 bytes: OpenAI's encoding_format "base64".
std::string base64_floats(const std::vector<float>& v);

/// The response body: {"object": "list", "data": [{"object": "embedding", "index", "embedding": [floats] or
/// base64 text}], "model", "usage": {"prompt_tokens", "total_tokens"}}.
nlohmann::json embeddings_json(const std::vector<std::vector<float>>& vectors, bool base64, const std::string& model,
                               int64_t prompt_tokens);

}  // namespace llmq
