// SIMD helpers shared by the KV codecs' attention kernels.
#pragma once

#include "util/simd.h"

#include <cstddef>
#include <type_traits>

namespace kvserve::simd {

// Runs f(std::integral_constant<int, m>{}, i) over passes [i, i + m) of the
// n_q queries. Passes of 3 or 4 (6 = 3 + 3, not 4 + 2) keep a kernel's
// per-query accumulators in registers; kernels are templated on m. kMax = 3:
// passes of at most 3 (AVX2 kernels, whose 16 registers hold three
// queries' sums).
template <int kMax = 4, class F>
void by_query_passes(int n_q, F&& f) {
  static_assert(kMax == 3 || kMax == 4);
  for (int i = 0; i < n_q;) {
    const int left = n_q - i;
    const int m = kMax == 3 ? (left < 3 ? left : 3) : left <= 4 ? left : (left == 6 ? 3 : 4);
    switch (m) {
      case 1: f(std::integral_constant<int, 1>{}, i); break;
      case 2: f(std::integral_constant<int, 2>{}, i); break;
      case 3: f(std::integral_constant<int, 3>{}, i); break;
      default:
        if constexpr (kMax == 4) f(std::integral_constant<int, 4>{}, i);
        break;
    }
    i += m;
  }
}

#if defined(__AVX512F__)
// Lane t of the result = the horizontal sum of v[t], for 16 vectors: a
// transpose-and-add tree, 3 instructions per pair instead of a full
// reduction per token.
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  #pragma GCC unroll 16
  for (int i = 0; i < 8; ++i)  // quarters 0,1: token 2i; quarters 2,3: token 2i + 1
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  #pragma GCC unroll 16
  for (int i = 0; i < 4; ++i)  // quarter q: token 4i + q
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i)  // quarter q, lanes: token 8i + q, 8i + 4 + q (twice)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  // Lane 4q + r holds token 4r + q; transpose back.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(idx, d);
}

// Reduces up to four vectors at once (lane i of the result: the max, or the
// sum, of v[i]'s lanes): ~10 instructions for four reductions instead of ~8
// per vector, and one dependency chain instead of four.
template <bool kMax>
inline __m128 reduce4(const __m512* v, int count) {
  auto op = [](__m512 a, __m512 b) { return kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  const __m512 z = _mm512_setzero_ps();
  const __m512 a = v[0], b = count > 1 ? v[1] : z, c = count > 2 ? v[2] : z, d = count > 3 ? v[3] : z;
  // 128-bit chunks: (a0 op a2, a1 op a3, b0 op b2, b1 op b3), the same for c, d.
  const __m512 ab = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = op(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // Chunk k: vector k's four partial lanes.
  __m512 x = op(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = op(x, _mm512_permute_ps(x, 0x4E));
  x = op(x, _mm512_permute_ps(x, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), x));
}
#endif

#if defined(__AVX512BW__)
// acc + pairwise products of 16-bit lanes (codes and a folded operand), summed
// per 32-bit lane: one vpdpwssd with VNNI.
inline __m512i dot_pairs(__m512i acc, __m512i codes, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, codes, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(codes, x));
#endif
}
#endif

// Prefetches into L2 `bytes` bytes at first + t * row_stride for the n rows
// of a block before the kernel walks them, so that many misses are in flight
// at once instead of the couple the kernel's own loads would have.
// Contiguous rows (head-major blocks) are prefetched as one span.
inline void prefetch_rows(const void* first, size_t row_stride, int n, size_t bytes) {
  if (row_stride == bytes) {
    const char* p = static_cast<const char*>(first);
    const size_t total = size_t(n) * bytes;
    for (size_t off = 0; off < total; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
    _mm_prefetch(p + total - 1, _MM_HINT_T1);
    return;
  }
  for (int t = 0; t < n; ++t) {
    const char* r = static_cast<const char*>(first) + size_t(t) * row_stride;
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(r + off, _MM_HINT_T1);
    _mm_prefetch(r + bytes - 1, _MM_HINT_T1);
  }
}

}  // namespace kvserve::simd
