#include "kernels/quantize_q8.h"

#include "util/simd.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "util/thread_pool.h"

namespace kvserve {

namespace {

constexpr int kBlock = 32;
// Below this many values one thread quantizes everything: a parallel_for costs
// a few microseconds, quantizing 64K values about as much.
constexpr int64_t kParallelMinValues = 1 << 16;

// Both paths compute id = 1 / (amax / 127) and q = round-to-nearest-even(x * id),
// so the SIMD and scalar builds quantize bit-identically.
#if defined(__AVX512F__) && defined(__AVX512BW__)
void quantize_block_impl(const float* x, int8_t* q, float* d) {
  const __m512 lo = _mm512_loadu_ps(x);
  const __m512 hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float scale = amax / 127.0f;
  const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
  _mm_store_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_store_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  *d = scale;
}
#else
void quantize_block_impl(const float* x, int8_t* q, float* d) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax / 127.0f;
  const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  for (int j = 0; j < kBlock; ++j) q[j] = int8_t(std::lrint(x[j] * inv));
  *d = scale;
}
#endif

void quantize_row(const float* x, int64_t blocks, int64_t padded_blocks, int8_t* q, float* d) {
  for (int64_t b = 0; b < blocks; ++b) quantize_block_q8(x + b * kBlock, q + b * kBlock, d + b);
  for (int64_t b = blocks; b < padded_blocks; ++b) {
    std::memset(q + b * kBlock, 0, kBlock);
    d[b] = 0.0f;
  }
}

}  // namespace

void quantize_block_q8(const float* x, int8_t* q, float* d) { quantize_block_impl(x, q, d); }

void quantize_rows_q8(const float* x, int64_t n, int64_t cols, ThreadPool* pool,
                      QuantizedRows& out) {
  assert(cols % kBlock == 0);
  out.n = n;
  out.blocks = cols / kBlock;
  out.padded_blocks = (out.blocks + 1) / 2 * 2;
  const size_t qs_needed = size_t(n * out.padded_blocks * kBlock);
  const size_t d_needed = size_t(n * out.padded_blocks);
  if (out.qs.size() < qs_needed) out.qs.resize(qs_needed);
  if (out.d.size() < d_needed) out.d.resize(d_needed);

  auto rows = [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      quantize_row(x + t * cols, out.blocks, out.padded_blocks,
                   out.qs.data() + t * out.padded_blocks * kBlock,
                   out.d.data() + t * out.padded_blocks);
    }
  };
  if (pool != nullptr && n * cols >= kParallelMinValues) {
    pool->parallel_for(n, 1, rows);
  } else {
    rows(0, n, 0);
  }
}

}  // namespace kvserve
