#include "kernels/rope_table.h"

#include "kernels/vector_ops.h"
#include "util/simd.h"

#include <cmath>

namespace kvserve {

RopeTable::RopeTable(int max_pos, int head_dim, const std::vector<float>& freqs)
    : max_pos_(max_pos), head_dim_(head_dim), table_(size_t(max_pos) * 2 * size_t(head_dim)) {
  const int pairs = head_dim / 2;
  for (int pos = 0; pos < max_pos; ++pos) {
    float* c = table_.data() + size_t(pos) * 2 * head_dim;
    float* s = c + head_dim;
    for (int i = 0; i < pairs; ++i) {
      // The same float expressions as rope(), so both paths rotate identically.
      const float val = float(pos) * freqs[size_t(i)];
      c[2 * i] = c[2 * i + 1] = cosf(val);
      s[2 * i] = sinf(val);
      s[2 * i + 1] = -s[2 * i];
    }
  }
}

RopeTable::RopeTable(int max_pos, int head_dim, float theta)
    : RopeTable(max_pos, head_dim, unscaled_rope_frequencies(head_dim, theta)) {}

void RopeTable::rotate_back(const float* q, int n, int pos, float* out) const {
  // out[2i] = q[2i] c + q[2i+1] s;  out[2i+1] = q[2i+1] c - q[2i] s.
  const float* c = table_.data() + size_t(pos) * 2 * head_dim_;
  const float* s = c + head_dim_;
  const int hd = head_dim_;  // a local: out may alias the table as far as the compiler knows
  for (int h = 0; h < n; ++h, q += hd, out += hd) {
    int d = 0;
#if defined(__AVX512F__)
    const __m512i swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
    for (; d + 16 <= hd; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      const __m512 qs = _mm512_permutexvar_ps(swap, qv);
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(qv, _mm512_loadu_ps(c + d), _mm512_mul_ps(qs, _mm512_loadu_ps(s + d))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; d + 8 <= hd; d += 8) {  // the same expression, pairs swapped within 128-bit lanes
      const __m256 qv = _mm256_loadu_ps(q + d);
      const __m256 qs = _mm256_permute_ps(qv, 0xB1);
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(qv, _mm256_loadu_ps(c + d), _mm256_mul_ps(qs, _mm256_loadu_ps(s + d))));
    }
#endif
    for (; d < hd; d += 2) {
      out[d] = q[d] * c[d] + q[d + 1] * s[d];
      out[d + 1] = q[d + 1] * c[d + 1] + q[d] * s[d + 1];
    }
  }
}

}  // namespace kvserve
