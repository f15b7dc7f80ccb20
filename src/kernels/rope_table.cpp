#include "kernels/rope_table.h"

#include "kernels/vector_ops.h"
#include "util/simd.h"

#include <cmath>

namespace kvserve {

// Row for position pos into row (2 * head_dim floats): the same float
// expressions as rope(), so both paths rotate identically.
static void fill_row(int pos, int head_dim, const std::vector<float>& freqs, float* row) {
  float* c = row;
  float* s = row + head_dim;
  for (int i = 0; i < head_dim / 2; ++i) {
    const float val = float(pos) * freqs[size_t(i)];
    c[2 * i] = c[2 * i + 1] = cosf(val);
    s[2 * i] = sinf(val);
    s[2 * i + 1] = -s[2 * i];
  }
}

RopeTable::RopeTable(int max_pos, int head_dim, const std::vector<float>& freqs)
    : max_pos_(max_pos), head_dim_(head_dim), table_(size_t(rows()) * 2 * size_t(head_dim)) {
  for (int pos = 0; pos < rows(); ++pos) fill_row(pos, head_dim, freqs, table_.data() + size_t(pos) * 2 * head_dim);
  if (max_pos <= kRows) return;
  const int coarse_rows = (max_pos - 1) / kRows + 1;
  coarse_.resize(size_t(coarse_rows) * 2 * size_t(head_dim));
  for (int c = 0; c < coarse_rows; ++c) fill_row(c * kRows, head_dim, freqs, coarse_.data() + size_t(c) * 2 * head_dim);
}

RopeTable::RopeTable(int max_pos, int head_dim, float theta)
    : RopeTable(max_pos, head_dim, unscaled_rope_frequencies(head_dim, theta)) {}

// out = q turned back by the angles of row (cos duplicated, signed sin),
// for n heads of hd floats. out may not alias q.
static void rotate_by_row(const float* row, int hd, const float* q, int n, float* out) {
  const float* c = row;
  const float* s = row + hd;
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

void RopeTable::rotate_back(const float* q, int n, int pos, float* out) const {
  const int hd = head_dim_;  // a local: out may alias the table as far as the compiler knows
  if (pos < kRows) {
    rotate_by_row(table_.data() + size_t(pos) * 2 * hd, hd, q, n, out);
    return;
  }
  thread_local std::vector<float> coarse;
  coarse.resize(size_t(n) * size_t(hd));
  rotate_by_row(coarse_.data() + size_t(pos / kRows) * 2 * hd, hd, q, n, coarse.data());
  rotate_by_row(table_.data() + size_t(pos % kRows) * 2 * hd, hd, coarse.data(), n, out);
}

}  // namespace kvserve
