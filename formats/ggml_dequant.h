// Dequantization of a GGUF tensor row by its ggml type id, for readers (formats/readers/) whose
// source bytes may sit at any alignment. Every ggml type llmq decodes is one of its own DTypes
// (formats/quant.h: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
// with ggml's block layouts and ggml's reference dequantization formulas, checked bit for bit
// against the `gguf` Python package's `gguf.quants.dequantize` in tests/test_gguf.cpp): the ids
// formats/quant.h's dtype_known accepts.
#pragma once
#include <cstdint>

#include "formats/quant.h"

namespace llmq {

/// Decodes n weights of ggml type `ggml_type` from `src` (any alignment) into dst [n] as fp32,
/// with dequantize_row (formats/quant.h). Bit-identical to ggml's reference dequantization as
/// long as the compiler does not fuse a*b+c into an FMA (the default build targets x86-64
/// without FMA). Throws UsageError for an unsupported type or n not a multiple of the type's
/// block size.
void ggml_dequantize_row(uint32_t ggml_type, const void* src, float* dst, int64_t n);

}  // namespace llmq
