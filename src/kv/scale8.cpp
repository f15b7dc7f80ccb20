#include "kv/scale8.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvserve::scale8 {
namespace {

// 2^(-j/16), j = 0..15.
const float* fraction_table() {
  static const auto table = [] {
    struct T { float v[16]; } t{};
    for (int j = 0; j < 16; ++j) t.v[j] = float(std::exp2(-double(j) / 16));
    return t;
  }();
  return table.v;
}

fp16_t round_up_fp16(float x) {  // the smallest fp16 >= x, for 0 <= x
  fp16_t h = fp32_to_fp16(x);
  if (fp16_to_fp32(h) < x && h < 0x7BFF) ++h;  // positive halves order like their bits
  return h;
}

float scale_of(float d, int k) { return fp16_to_fp32(fp32_to_fp16(std::ldexp(d * fraction_table()[k & 15], -(k >> 4)))); }
float min_of(float dm, int m) { return fp16_to_fp32(fp32_to_fp16(dm * float(m))); }

struct Header {
  float d, dm;
};
// A stored run: its header's units, then the groups' scale and min bytes.
struct Run {
  Header h;
  const uint8_t* ks;
  const int8_t* ms;
};
Run open_run(const uint8_t* src, int count) {
  fp16_t h[2];
  std::memcpy(h, src, sizeof h);
  const uint8_t* ks = src + kHeaderBytes;
  return {{fp16_to_fp32(h[0]), fp16_to_fp32(h[1])}, ks, reinterpret_cast<const int8_t*>(ks + count)};
}

}  // namespace

void encode_run(const float* lo, const float* hi, int count, int levels, uint8_t* dst, float* scale, float* min) {
  uint8_t* ks = dst + kHeaderBytes;
  int8_t* ms = reinterpret_cast<int8_t*>(ks + count);
  float lo_max = 0;
  for (int g = 0; g < count; ++g) lo_max = std::max(lo_max, std::fabs(lo[g]));
  const fp16_t dm16 = round_up_fp16(lo_max / 127);
  const float dm = fp16_to_fp32(dm16);
  // Mins first (rounded down); each scale then spans hi from its stored min.
  float top = 0;
  for (int g = 0; g < count; ++g) {
    int m = dm > 0 ? int(std::floor(lo[g] / dm)) : 0;
    m = std::clamp(m, -128, 127);
    while (m > -128 && min_of(dm, m) > lo[g]) --m;
    ms[g] = int8_t(m);
    min[g] = min_of(dm, m);
    scale[g] = (hi[g] - min[g]) / float(levels);  // the scale needed, for now
    top = std::max(top, scale[g]);
  }
  const fp16_t d16 = round_up_fp16(top);
  const float d = fp16_to_fp32(d16);
  for (int g = 0; g < count; ++g) {
    const float need = scale[g];
    int k = 255;
    if (d > 0 && need > 0) k = std::clamp(int(std::floor(16 * std::log2(double(d) / double(need)))), 0, 255);
    while (k > 0 && scale_of(d, k) < need) --k;
    ks[g] = uint8_t(k);
    scale[g] = scale_of(d, k);
  }
  const fp16_t h[2] = {d16, dm16};
  std::memcpy(dst, h, sizeof h);
}

#if defined(__AVX512F__)
// Groups [g, g + 16) of a run before their fp16 rounding: the scalar
// expressions 16 at a time, d * 2^(-(k & 15) / 16) from a one-register table
// times 2^-(k >> 4) (exact), and dm * m (exact).
struct Raw16 {
  __m512 scale, min;
};
static Raw16 raw16(const Run& r, int g) {
  const Header& h = r.h;
  const __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.ks + g)));
  const __m512i m = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.ms + g)));
  const __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_srli_epi32(k, 4)));
  const __m512 frac = _mm512_loadu_ps(fraction_table());
  return {_mm512_scalef_ps(_mm512_mul_ps(_mm512_set1_ps(h.d), _mm512_permutexvar_ps(k, frac)), e),
          _mm512_mul_ps(_mm512_set1_ps(h.dm), _mm512_cvtepi32_ps(m))};
}
static __m256i to_fp16(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__AVX2__) && defined(__F16C__)
// The same 8 at a time: the table's two halves by permute and a blend on
// bit 3 of k, and 2^-(k >> 4) as an exponent (exact: no product here leaves
// the normal range).
struct Raw8 {
  __m256 scale, min;
};
static Raw8 raw8(const Run& r, int g) {
  const Header& h = r.h;
  const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.ks + g)));
  const __m256i m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.ms + g)));
  const float* table = fraction_table();
  const __m256 frac = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(table), k),
                                       _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), k),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));
  const __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_srli_epi32(k, 4)), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(h.d), frac), power),
          _mm256_mul_ps(_mm256_set1_ps(h.dm), _mm256_cvtepi32_ps(m))};
}
static __m128i to_fp16(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#endif

void decode_run(const uint8_t* src, int count, float* scale, float* min) {
  int g = 0;
#if defined(__AVX512F__)
  const Run run = open_run(src, count);
  for (; g + 16 <= count; g += 16) {
    const Raw16 r = raw16(run, g);
    _mm512_storeu_ps(scale + g, _mm512_cvtph_ps(to_fp16(r.scale)));
    _mm512_storeu_ps(min + g, _mm512_cvtph_ps(to_fp16(r.min)));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const Run run = open_run(src, count);
  for (; g + 8 <= count; g += 8) {
    const Raw8 r = raw8(run, g);
    _mm256_storeu_ps(scale + g, _mm256_cvtph_ps(to_fp16(r.scale)));
    _mm256_storeu_ps(min + g, _mm256_cvtph_ps(to_fp16(r.min)));
  }
#endif
  for (; g < count; ++g) decode_one(src, count, g, scale + g, min + g);
}

void decode_run_pairs(const uint8_t* src, int count, fp16_t* pairs) {
  int g = 0;
#if defined(__AVX512F__)
  const Run run = open_run(src, count);
  for (; g + 16 <= count; g += 16) {
    const Raw16 r = raw16(run, g);
    const __m256i s = to_fp16(r.scale), m = to_fp16(r.min);
    // unpacklo: pairs of groups 0-3 and 8-11; unpackhi: 4-7 and 12-15.
    const __m256i lo = _mm256_unpacklo_epi16(s, m), hi = _mm256_unpackhi_epi16(s, m);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 2 * g), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 2 * g + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const Run run = open_run(src, count);
  for (; g + 8 <= count; g += 8) {
    const Raw8 r = raw8(run, g);
    const __m128i s = to_fp16(r.scale), m = to_fp16(r.min);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 2 * g), _mm_unpacklo_epi16(s, m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 2 * g + 8), _mm_unpackhi_epi16(s, m));
  }
#endif
  for (; g < count; ++g) {
    float scale, min;
    decode_one(src, count, g, &scale, &min);
    pairs[2 * g] = fp32_to_fp16(scale);
    pairs[2 * g + 1] = fp32_to_fp16(min);
  }
}

void decode_one(const uint8_t* src, int count, int g, float* scale, float* min) {
  const Run run = open_run(src, count);
  *scale = scale_of(run.h.d, run.ks[g]);
  *min = min_of(run.h.dm, run.ms[g]);
}

}  // namespace kvserve::scale8
