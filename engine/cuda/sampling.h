// Token choice on the GPU, so a decode step copies one token id back instead of the logits.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/cuda_plan.h"

namespace llmq::cuda {

/// *out = the index of the largest of logits [n] (ties: the lowest index, as Sampler::argmax).
/// One block; asynchronous on s. logits and out are device pointers.
void argmax(const float* logits, int64_t n, int32_t* out, cudaStream_t s);

/// Most candidates top_k takes (the CUDA plan's room for them).
constexpr int kMaxTopK = int(kCudaMaxTopK);

/// The k largest of logits [n] (1 <= k <= min(n, kMaxTopK)), sorted by value descending, ties
/// by lower index (Sampler's order): ids [k] and their logits [k]. One block: the k-th largest
/// value found by a radix select over the floats' order-preserving bit patterns (4 passes of 8
/// bits, histograms in shared memory), the elements above it and the lowest-index ties gathered
/// with a prefix sum, then a bitonic sort. Throws UsageError for k out of range.
void top_k(const float* logits, int64_t n, int k, int32_t* ids, float* vals, cudaStream_t s);

}  // namespace llmq::cuda
