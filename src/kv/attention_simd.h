// SIMD helpers shared by the KV codecs' attention kernels.
#pragma once

#include "util/simd.h"

#include <cstddef>

namespace kvserve::simd {

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
