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
// REQUIRES: cols % 32 == 0 for Q8_0/Q4_0.
void quantize_row(WeightType t, const float* x, int64_t cols, std::vector<uint8_t>& out);

}  // namespace kvserve
