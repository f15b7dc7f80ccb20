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

#include <cmath>

namespace kvserve::simd {

// The kernel tier this build compiled (the build follows -march): which of
// the AVX-512 (with or without VNNI's integer dot products), AVX2 (with or
// without AVX-VNNI's, on 256-bit registers) or portable loops run.
// `bench --json` reports it as "kernels".
constexpr const char* kernel_tier() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
  return "avx2-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

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

#if defined(__AVX512F__)
// e^x for x <= 0, within 2 ulp; 0 below -104, where e^x rounds to 0 in float.
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact to
// float precision), e^r by its degree-7 Taylor polynomial (truncation error
// under 1e-8 relative on that range), then scaled by 2^n, which also rounds
// subnormal results correctly.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2's high 15 bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860676533018708e-6f), r);    // ln2 - high part
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes, the same operations bit for bit. Two steps
// differ in form, not in result (fewer instructions: kernels_bench's
// BM_ExpShifted went from 0.748 to 0.702 ns per score on the Zen 2 host;
// BENCHMARKS.md, thirty-first session):
// - n = round(x log2e) by adding and subtracting 1.5 * 2^23 (|x log2e| <
//   151, so the sum's unit is 1 and rounds to nearest even, as roundps
//   does); n's integer is then the sum's low bits, without a cvtps2dq.
// - AVX2 has no scalef. While every lane has n >= -125, p 2^n is normal
//   (p > 0.7) and exact, so adding n to p's exponent field gives it. Below,
//   2^n (n >= -150) is applied as two exact powers of two whose exponents
//   stay normal (n / 2 each): the first product is exact, so the second
//   rounds once, as scalef does, subnormal results included.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
  __m256 scaled = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  // The product must round before the sum (ties decide n): an empty asm
  // keeps GCC from contracting the two into one FMA.
  asm("" : "+x"(scaled));
  const __m256 n_magic = _mm256_add_ps(scaled, magic);
  const __m256 n = _mm256_sub_ps(n_magic, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860676533018708e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(n_magic), _mm256_castps_si256(magic));
  const __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(-125), ni);
  if (_mm256_testz_si256(subnormal, subnormal)) [[likely]]
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(ni, 23)));
  const __m256i half = _mm256_srai_epi32(ni, 1);  // n <= 0: half = floor(n / 2)
  auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
// x[0, n) := exp(x - shift) for a tail of n < 8 values (shift >= each),
// through a padded copy so the tail gets the lanes' exponential; returns
// the 8 lanes (0 past n) for the caller's sum.
inline __m256 exp_tail(float* x, int n, float shift) {
  alignas(32) float t[8];
  for (int k = 0; k < 8; ++k) t[k] = k < n ? x[k] - shift : -INFINITY;
  const __m256 e = exp_nonpositive(_mm256_load_ps(t));
  _mm256_store_ps(t, e);
  for (int k = 0; k < n; ++k) x[k] = t[k];
  return e;
}
#endif

}  // namespace kvserve::simd
