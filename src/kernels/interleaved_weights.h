// Q8_0, Q4_0 and Q4_1 weights re-laid for batched matmul: 16 rows side by
// side on AVX-512 VNNI, 8 on AVX2 (with or without AVX-VNNI), one per 32-bit
// lane. Q4_1 only on AVX2 (native_q4_1_supported).
//
// Why: with rows in the checkpoint's layout, every (row, token, block) dot
// product ends in its own convert, scale product and FMA: about four vector
// operations per vpdpbusd, which made a 16-token decode step compute-bound.
// With 16 rows in the lanes of one register, one vpdpbusd advances 16 rows by 4
// values each against a broadcast of 4 activation bytes; a block's 8 of them
// then share one convert, one scale product and one FMA for all 16 rows.
// AVX2 has half the lanes, and without VNNI three instructions where
// vpdpbusd takes one; the row-per-lane layout saves it the same per-row
// converts, scale products and final horizontal sums.
// llama.cpp repacks Q4_0 for its ARM and x86 GEMMs at load time for the same
// reason. The copy replaces the checkpoint's pages in memory (Model releases
// them), so weights still cost their checkpoint bytes once.
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/weight_matrix.h"
#include "util/aligned_buffer.h"

namespace kvserve {

class ThreadPool;

struct InterleavedWeights {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  static constexpr int kRows = 16;  // rows per group: one per int32 lane of a 512-bit register
#else
  static constexpr int kRows = 8;  // ... of a 256-bit register
#endif
  WeightType type = WeightType::Q8_0;  // Q8_0, Q4_0 or Q4_1
  int64_t rows = 0, cols = 0;
  int64_t groups = 0;  // ceil(rows / kRows); rows past `rows` are zero
  int64_t blocks = 0;  // cols / 32
  // Per (group, block), steps of kRows rows x 4 bytes, all unsigned:
  //   Q8_0: 8 steps; step i holds values 4i..4i+3 of each row as q + 128.
  //   Q4_0, Q4_1: 4 steps; step i holds bytes 4i..4i+3 of each row's 16
  //         nibble bytes as stored (low nibble: value k, high: value k + 16;
  //         Q4_0's nibble is q + 8, Q4_1's is its code).
  AlignedBuffer<uint8_t> qs;
  AlignedBuffer<uint16_t> d;  // (groups, blocks, kRows): fp16 scales
  AlignedBuffer<uint16_t> m;  // (groups, blocks, kRows): fp16 mins; Q4_1 only, else empty

  size_t bytes() const { return qs.size() + (d.size() + m.size()) * sizeof(uint16_t); }
};

// Whether this build has an interleaved kernel (AVX-512 with VNNI, or AVX2).
bool interleaved_weights_supported();

// Whether this build computes Q4_1 natively: only the 256-bit (AVX2, with or
// without AVX-VNNI) interleaved kernel has a Q4_1 path, which reuses Q4_0's
// nibble dot product with the min added outside it. The AVX-512 VNNI kernel
// has none: it was written on an AVX2-only machine, where 512-bit code could
// be neither run nor tested, so it was not written. Where this is false,
// make_interleaved returns null for Q4_1 and loaders convert Q4_1 and Q4_K
// tensors to Q8_0 instead (Model::load), so that Q4_1 never reaches matmul's
// row-major Q4_1 kernel, a scalar one kept for tests and references.
bool native_q4_1_supported();

// A copy of w in the interleaved layout; null when w is not Q8_0/Q4_0/Q4_1,
// or the build lacks the kernel (for Q4_1: native_q4_1_supported()); matmul
// then runs on the checkpoint's layout.
std::unique_ptr<InterleavedWeights> make_interleaved(const WeightMatrix& w);

// y = x · Wᵀ as matmul() defines it: x (n, cols), y (n, rows).
// REQUIRES: interleaved_weights_supported().
void interleaved_matmul(const InterleavedWeights& w, const float* x, float* y, int64_t n, ThreadPool* pool);

// Several matrices with the same cols (any mix of Q8_0, Q4_0, Q4_1) over one x
// (Q, K and V; gate and up): x is quantized once and one parallel_for splits
// all their rows. ys[i] receives (n, ws[i]->rows).
void interleaved_matmul_many(const InterleavedWeights* const* ws, float* const* ys, int count, const float* x,
                             int64_t n, ThreadPool* pool);

}  // namespace kvserve
