// Activations quantized to 8 bits for the integer matmul kernels (Q8_0 and
// Q4_0 weights). Each run of 32 values gets an fp32 scale d = max|x| / 127 and
// q = round(x / d), so the per-value error is at most d / 2 = max|x| / 254.
#pragma once

#include <cstdint>

#include "util/aligned_buffer.h"

namespace kvserve {

class ThreadPool;

// Invariant after quantize_rows_q8: every row holds padded_blocks blocks, the
// ones past `blocks` all zero (qs = 0, d = 0), so kernels may read blocks in
// pairs without a tail case on the activation side. Rows start 64-byte aligned.
struct QuantizedRows {
  int64_t n = 0;              // rows (tokens)
  int64_t blocks = 0;         // blocks per row: cols / 32
  int64_t padded_blocks = 0;  // blocks rounded up to an even count
  AlignedBuffer<int8_t> qs;   // (n, padded_blocks * 32)
  AlignedBuffer<float> d;     // (n, padded_blocks)

  const int8_t* row_qs(int64_t t) const { return qs.data() + t * padded_blocks * 32; }
  const float* row_d(int64_t t) const { return d.data() + t * padded_blocks; }
};

// One block of 32 values: q = round(x / d), d = max|x| / 127 (0 for a zero block).
// Every q is in [-127, 127], whatever x holds (NaN, infinities, subnormals):
// the AVX2 matmul kernels multiply |w| by q sign(w) and rely on it.
void quantize_block_q8(const float* x, int8_t* q, float* d);

// Quantizes x: (n, cols) floats into out, reusing out's buffers when they are
// large enough. Splits rows across pool (may be null) when the work is large.
// REQUIRES: cols % 32 == 0.
void quantize_rows_q8(const float* x, int64_t n, int64_t cols, ThreadPool* pool,
                      QuantizedRows& out);

}  // namespace kvserve
