// The x86 intrinsics, included through one place: GCC 12's AVX-512 headers
// warn about their own "undefined" pass-through operands (GCC bug 105593), so
// those two warnings are silenced here for every file that uses intrinsics.
// Include this first in such a file (the pragmas apply from here on). Also
// the horizontal reductions every AVX2 kernel needs.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

namespace kvserve::simd {

#if defined(__AVX2__)
// The sum and the largest of a vector's 8 lanes (AVX2 kernels' reductions).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

}  // namespace kvserve::simd
