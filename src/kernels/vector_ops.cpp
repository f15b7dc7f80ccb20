// The optimised kernels keep the operation order of llama2.c's run.c wherever
// it decides results bit for bit (rmsnorm's final scaling, softmax's division,
// silu's expression, rope's angles); only reductions are reassociated into
// SIMD lanes. Exponentials use libm's expf, except softmax's and silu's: with
// AVX-512 or AVX2 they run simd::exp_nonpositive (util/simd.h, the same
// numbers on both), within 2 ulp of the exact value
// (libm's expf is within 1), because a scalar expf per score was 15-30% of
// quantized decode attention at long context, and per hidden unit ~4% of a
// 16-sequence batched step.
#include "kernels/vector_ops.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvserve {

namespace {

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}
using simd::exp_nonpositive;
#endif

float sum_of_squares(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  for (; i < n; i += 16) {
    const __m512 a = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return ss;
#endif
}

}  // namespace

void rmsnorm(float* out, const float* x, const float* weight, int64_t n, float eps) {
  const float ss = 1.0f / std::sqrt(sum_of_squares(x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (ss * x[i]);
}

void rmsnorm_reference(float* out, const float* x, const float* weight, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const double scale = 1.0 / std::sqrt(ss / double(n) + double(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = float(double(weight[i]) * scale * double(x[i]));
}

float exp_shifted(float* x, int64_t n, float* max_out) {
  if (n <= 0) {
    if (max_out != nullptr) *max_out = -INFINITY;
    return 0.0f;
  }
  float max_val = x[0];
#if defined(__AVX512F__)
  // Four running maxima, so that the first pass is not one chain of
  // dependent operations (the largest is the same in any order), and
  // unmasked loads and stores but for the tail: attention's softmax rows took
  // 4-5% less of int4-small's layer so (BENCHMARKS.md, sixteenth session).
  // The sum stays one chain in lane order: prefill tiles (tile_attention.cpp)
  // add the same exponentials in the same order, and a prefix-cache hit must
  // give exactly the logits of a run without one.
  constexpr int64_t kChains = 4, kStride = 16 * kChains;
  __m512 vmax[kChains];
  for (int k = 0; k < kChains; ++k) vmax[k] = _mm512_set1_ps(x[0]);
  int64_t i = 0;
  for (; i + kStride <= n; i += kStride)
    #pragma GCC unroll 4
    for (int k = 0; k < kChains; ++k) vmax[k] = _mm512_max_ps(vmax[k], _mm512_loadu_ps(x + i + 16 * k));
  for (; i < n; i += 16) vmax[0] = _mm512_max_ps(vmax[0], _mm512_mask_loadu_ps(vmax[0], tail_mask(n - i), x + i));
  max_val = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vmax[0], vmax[1]), _mm512_max_ps(vmax[2], vmax[3])));
  if (max_out != nullptr) *max_out = max_val;
  const __m512 shift = _mm512_set1_ps(max_val);
  __m512 vsum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift));
    _mm512_storeu_ps(x + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), shift));
    _mm512_mask_storeu_ps(x + i, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
  // Four running maxima, as the AVX-512 path (the largest is the same in
  // any order).
  int64_t i = 0;
  __m256 vmax[4];
  for (__m256& m : vmax) m = _mm256_set1_ps(x[0]);
  for (; i + 32 <= n; i += 32)
    #pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) vmax[k] = _mm256_max_ps(vmax[k], _mm256_loadu_ps(x + i + 8 * k));
  for (; i + 8 <= n; i += 8) vmax[0] = _mm256_max_ps(vmax[0], _mm256_loadu_ps(x + i));
  max_val = simd::hmax8(_mm256_max_ps(_mm256_max_ps(vmax[0], vmax[1]), _mm256_max_ps(vmax[2], vmax[3])));
  for (; i < n; ++i) max_val = std::max(max_val, x[i]);
  if (max_out != nullptr) *max_out = max_val;
  const __m256 shift = _mm256_set1_ps(max_val);
  __m256 vsum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (i < n) vsum = _mm256_add_ps(vsum, simd::exp_tail(x + i, int(n - i), max_val));
  return simd::hsum8(vsum);
#else
  for (int64_t i = 1; i < n; ++i) max_val = std::max(max_val, x[i]);
  if (max_out != nullptr) *max_out = max_val;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_val);
    sum += x[i];
  }
  return sum;
#endif
}

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
  const float sum = exp_shifted(x, n);
#if defined(__AVX512F__)
  const __m512 vsum = _mm512_set1_ps(sum);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vsum));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] /= sum;
#endif
}

void softmax_reference(float* x, int64_t n) {
  if (n <= 0) return;
  double max_val = x[0];
  for (int64_t i = 1; i < n; ++i) max_val = std::max(max_val, double(x[i]));
  std::vector<double> e(static_cast<size_t>(n));
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    e[size_t(i)] = std::exp(double(x[i]) - max_val);
    sum += e[size_t(i)];
  }
  for (int64_t i = 0; i < n; ++i) x[i] = float(e[size_t(i)] / sum);
}

void silu_mul(float* gate, const float* up, int64_t n) {
#if defined(__AVX512F__)
  // sigmoid(v) = 1 / (1 + e^-v), written with e = e^-|v| <= 1 so the
  // exponential's argument is never positive: 1 / (1 + e) for v >= 0 and
  // e / (1 + e) for v < 0.
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
    const __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(gate + i, m, _mm512_mul_ps(_mm512_mul_ps(v, sigmoid), _mm512_maskz_loadu_ps(m, up + i)));
  }
#else
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // The AVX-512 expression on 8 lanes; a tail through padded copies.
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  auto silu8 = [&](__m256 v, __m256 u) {
    const __m256 e = simd::exp_nonpositive(_mm256_or_ps(v, sign));  // e^-|v|
    const __m256 negative = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_mul_ps(v, sigmoid), u);
  };
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(gate + i, silu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {};
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    _mm256_store_ps(g, silu8(_mm256_load_ps(g), _mm256_load_ps(u)));
    std::copy(g, g + (n - i), gate + i);
    return;
  }
#endif
  for (; i < n; ++i) {
    float v = gate[i];
    v *= 1.0f / (1.0f + std::exp(-v));
    gate[i] = v * up[i];
  }
#endif
}

void silu_mul_reference(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    gate[i] = float(g / (1.0 + std::exp(-g)) * double(up[i]));
  }
}

void rope(float* x, int n_heads, int head_dim, int pos, const float* freqs) {
  // The angles depend only on the pair index, so compute them once for all heads;
  // the expressions are llama2.c's, evaluated in float.
  const int pairs = head_dim / 2;
  thread_local std::vector<float> cos_sin;  // (pair, {cos, sin})
  cos_sin.resize(size_t(2 * pairs));
  for (int i = 0; i < pairs; ++i) {
    const float val = float(pos) * freqs[i];
    cos_sin[size_t(2 * i)] = cosf(val);
    cos_sin[size_t(2 * i + 1)] = sinf(val);
  }
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + int64_t(h) * head_dim;
    for (int i = 0; i < pairs; ++i) {
      const float fcr = cos_sin[size_t(2 * i)], fci = cos_sin[size_t(2 * i + 1)];
      const float v0 = v[2 * i], v1 = v[2 * i + 1];
      v[2 * i] = v0 * fcr - v1 * fci;
      v[2 * i + 1] = v0 * fci + v1 * fcr;
    }
  }
}

std::vector<float> unscaled_rope_frequencies(int head_dim, float theta) {
  std::vector<float> f(size_t(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i) f[size_t(i)] = rope_frequency(theta, i, head_dim);
  return f;
}

void rope(float* x, int n_heads, int head_dim, int pos, float theta) {
  rope(x, n_heads, head_dim, pos, unscaled_rope_frequencies(head_dim, theta).data());
}

float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = simd::hsum8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
#else
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
#endif
}

float dot_reference(const float* a, const float* b, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(a[i]) * double(b[i]);
  return float(sum);
}

void axpy(float a, const float* x, float* y, int64_t n) {
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
#else
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
#endif
}

}  // namespace kvserve
