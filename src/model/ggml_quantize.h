// Encodes float rows into any ggml type of ggml_dequantize.h, for writing
// synthetic checkpoints and for tests: the inverse of dequantize_ggml_row.
//
// The block-quantized encoders take each block's (or sub-block's) min and
// max, nothing more: llama.cpp searches for scales that lower the error, so
// its files decode closer to their floats, but their bytes decode the same
// way; only the decoder has to match it exactly.
#pragma once

#include <cstdint>
#include <vector>

#include "model/ggml_dequantize.h"

namespace kvserve {

// Appends the encoding of x (n values) in type t to out
// (n / ggml_block(t).values * ggml_block(t).bytes bytes).
// REQUIRES: n is a multiple of ggml_block(t).values.
void quantize_ggml_row(GgmlType t, const float* x, int64_t n, std::vector<uint8_t>& out);

// The computable weight type's ggml number (WeightType::Q8_0 → GgmlType::Q8_0).
GgmlType ggml_type_of(WeightType t);

}  // namespace kvserve
