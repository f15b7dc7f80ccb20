// y = x · Wᵀ for a batch of activation rows: the GEMM/GEMV at the heart of
// every projection. Weights are read once per batch tile, so a batch of n
// tokens costs about one pass over W, not n passes.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "kernels/weight_matrix.h"

namespace kvserve {

class ThreadPool;

// x: (n, w.cols) floats, row-major.  y: (n, w.rows) floats, overwritten.
// Threads split the output rows. pool may be null (single thread).
// Q8_0/Q4_0/Q4_1 weights: x is quantized to Q8 blocks on the fly and dot
// products run in int8 (AVX-512 VNNI / AVX2 when available; Q4_1 without an
// interleaved copy: scalar, for tests).
void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n, ThreadPool* pool);

// Several projections of the same x (Q, K and V; gate and up) in one call:
// ys[i] = x · ws[i]ᵀ. When all are interleaved (kernels/interleaved_weights.h)
// x is quantized once and one parallel_for splits all their rows; otherwise
// this is one matmul per matrix. REQUIRES: equal cols.
void matmul_shared_input(std::initializer_list<const WeightMatrix*> ws, std::initializer_list<float*> ys,
                         const float* x, int64_t n, ThreadPool* pool);

// Plain scalar reference for tests: dequantizes each weight, accumulates in
// double. Same shapes as matmul.
void matmul_reference(const WeightMatrix& w, const float* x, float* y, int64_t n);

}  // namespace kvserve
