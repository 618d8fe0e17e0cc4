// Token choice on the GPU, so a decode step copies one token id back instead of the logits.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace llmq::cuda {

/// *out = the index of the largest of logits [n] (ties: the lowest index, as Sampler::argmax).
/// One block; asynchronous on s. logits and out are device pointers.
void argmax(const float* logits, int64_t n, int32_t* out, cudaStream_t s);

}  // namespace llmq::cuda
