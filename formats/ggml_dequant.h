// Dequantization of a GGUF tensor row by its ggml type id, for readers (formats/readers/) whose
// source bytes may sit at any alignment. Every ggml type llmq decodes is one of its own DTypes
// (formats/quant.h: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, with ggml's
// block layouts and ggml's reference dequantization formulas, checked bit for bit against the
// `gguf` Python package's `gguf.quants.dequantize` in tests/test_gguf.cpp).
// Which ids it decodes: formats/quant.h's dtype_known, and the ids of ggml_widened_type (IQ4_NL:
// decoded through the wider type that holds it exactly).
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

/// The types of ggml that llmq stores in a wider type of its own, holding the same values
/// exactly (its kernels do not read them as they are):
///  - IQ4_NL (id 20; block_iq4_nl, 18 bytes per 32: fp16 d; u8 qs[16], nibbles as Q4_0):
///    w = d · v[q] with the non-linear table v = {−127, −104, −83, −65, −49, −35, −22, −10, 1,
///    13, 25, 38, 53, 69, 89, 113} (ggml-common.h kvalues_iq4nl). As Q8_0: the same d, q = v[q].
///    1.9x the bytes.
/// Returns the llmq type, or false when `ggml_type` is not one of them.
bool ggml_widened_type(uint32_t ggml_type, DType* out);

/// Rewrites n weights (whole blocks) of a type ggml_widened_type names from `src` (any
/// alignment) into dst in the wider type's layout (row_bytes(wider, n) bytes). Throws
/// UsageError for another type or partial blocks.
void ggml_widen_row(uint32_t ggml_type, const void* src, uint8_t* dst, int64_t n);

}  // namespace llmq
