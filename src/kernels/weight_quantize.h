// Encodes float rows into the checkpoint weight formats (the inverse of
// dequantize_row), for writing synthetic checkpoints and for tests.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/weight_matrix.h"

namespace kvserve {

// Appends one row of `cols` values in type t to out (weight_row_bytes(t, cols) bytes).
// Q8_0: d = max|x| / 127, q = round(x / d).  Q4_0: d = x_maxabs / -8 (the
// signed value of largest magnitude maps to -8), q = clamp(round(x / d) + 8, 0, 15).
// Q4_1: m = min x, d = (max x - min x) / 15 (both rounded to fp16 first),
// q = clamp(round((x - m) / d), 0, 15); as ggml_quantize.h encodes ggml's Q4_1.
// REQUIRES: cols % 32 == 0 for Q8_0/Q4_0/Q4_1.
void quantize_row(WeightType t, const float* x, int64_t cols, std::vector<uint8_t>& out);

}  // namespace kvserve
