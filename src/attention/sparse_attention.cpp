#include "attention/sparse_attention.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>

#include "kernels/vector_ops.h"
#include "kv/attention_simd.h"
#include "util/error.h"

namespace kvserve {
namespace {

void check_ranges(const HeadKv& kv, int group, std::span<const KeyRange> ranges) {
  if (kv.keys == nullptr || kv.values == nullptr || kv.head_dim < 1 || kv.n < 1)
    fail("sparse attention: no keys to attend to (n = {}, head_dim = {})", kv.n, kv.head_dim);
  if (group < 1) fail("sparse attention: a query group needs at least one query head (got {})", group);
  if (ranges.empty()) fail("sparse attention: no keys selected");
  int64_t prev_end = 0;
  for (const KeyRange& r : ranges) {
    if (r.begin < prev_end || r.end <= r.begin || r.end > kv.n)
      fail("sparse attention: key range [{}, {}) is empty, overlaps or is out of order, or passes the {} keys",
           r.begin, r.end, kv.n);
    prev_end = r.end;
  }
}

#if defined(__AVX512F__)
// scores[i * stride + t] = scale * q_i·k_t for the n keys starting at `keys`.
void score_run(const float* q, int group, int d, const float* keys, int64_t n, float scale, float* scores,
               size_t stride) {
  const int chunks = (d + 15) / 16;
  const __mmask16 tail = (d % 16 == 0) ? __mmask16(0xFFFF) : __mmask16((1u << (d % 16)) - 1);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = int(std::min<int64_t>(16, n - t0));
    // The tile's keys stay in L1 while every query of the group reads them.
    for (int i = 0; i < group; ++i) {
      const float* qi = q + size_t(i) * size_t(d);
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      for (int c = 0; c < chunks; ++c) {
        const __mmask16 mask = c + 1 == chunks ? tail : __mmask16(0xFFFF);
        const __m512 qc = _mm512_maskz_loadu_ps(mask, qi + c * 16);
        for (int t = 0; t < m; ++t)
          acc[t] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mask, keys + size_t(t0 + t) * size_t(d) + c * 16), acc[t]);
      }
      const __m512 s = _mm512_mul_ps(simd::hsum16(acc), vscale);
      _mm512_mask_storeu_ps(scores + size_t(i) * stride + size_t(t0), __mmask16((1u << m) - 1), s);
    }
  }
}

// out_i += sum_t w[i * stride + t] * v_t for the n values starting at `values`.
void accumulate_run(const float* w, int group, size_t stride, int d, const float* values, int64_t n, float* out) {
  constexpr int kTile = 32;  // values per tile: re-read from L1 by each query head of the group
  const int chunks = (d + 15) / 16;
  const __mmask16 tail = (d % 16 == 0) ? __mmask16(0xFFFF) : __mmask16((1u << (d % 16)) - 1);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int m = int(std::min<int64_t>(kTile, n - t0));
    for (int i = 0; i < group; ++i) {
      float* oi = out + size_t(i) * size_t(d);
      const float* wi = w + size_t(i) * stride + size_t(t0);
      for (int c = 0; c < chunks; ++c) {
        const __mmask16 mask = c + 1 == chunks ? tail : __mmask16(0xFFFF);
        __m512 acc0 = _mm512_maskz_loadu_ps(mask, oi + c * 16), acc1 = _mm512_setzero_ps();
        int t = 0;
        for (; t + 1 < m; t += 2) {
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(wi[t]),
                                 _mm512_maskz_loadu_ps(mask, values + size_t(t0 + t) * size_t(d) + c * 16), acc0);
          acc1 = _mm512_fmadd_ps(_mm512_set1_ps(wi[t + 1]),
                                 _mm512_maskz_loadu_ps(mask, values + size_t(t0 + t + 1) * size_t(d) + c * 16), acc1);
        }
        if (t < m)
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(wi[t]),
                                 _mm512_maskz_loadu_ps(mask, values + size_t(t0 + t) * size_t(d) + c * 16), acc0);
        _mm512_mask_storeu_ps(oi + c * 16, mask, _mm512_add_ps(acc0, acc1));
      }
    }
  }
}
#else
void score_run(const float* q, int group, int d, const float* keys, int64_t n, float scale, float* scores,
               size_t stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < group; ++i)
      scores[size_t(i) * stride + size_t(t)] = scale * dot(q + size_t(i) * size_t(d), keys + size_t(t) * size_t(d), d);
}

void accumulate_run(const float* w, int group, size_t stride, int d, const float* values, int64_t n, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < group; ++i)
      axpy(w[size_t(i) * stride + size_t(t)], values + size_t(t) * size_t(d), out + size_t(i) * size_t(d), d);
}
#endif

}  // namespace

void attend_ranges(const HeadKv& kv, const float* q, int group, float scale, std::span<const KeyRange> ranges,
                   float* out, SparseAttentionScratch& scratch) {
  check_ranges(kv, group, ranges);
  const int d = kv.head_dim;
  const int64_t total = ranges_size(ranges);
  const size_t stride = size_t(total + 15) / 16 * 16;
  if (scratch.scores.size() < size_t(group) * stride) scratch.scores.resize(size_t(group) * stride);
  float* scores = scratch.scores.data();

  int64_t at = 0;  // position of the range's first key among the selected ones
  for (const KeyRange& r : ranges) {
    score_run(q, group, d, kv.keys + size_t(r.begin) * size_t(d), r.size(), scale, scores + at, stride);
    at += r.size();
  }
  for (int i = 0; i < group; ++i) softmax(scores + size_t(i) * stride, total);
  std::fill(out, out + size_t(group) * size_t(d), 0.0f);
  at = 0;
  for (const KeyRange& r : ranges) {
    accumulate_run(scores + at, group, stride, d, kv.values + size_t(r.begin) * size_t(d), r.size(), out);
    at += r.size();
  }
}

void attend_ranges_reference(const HeadKv& kv, const float* q, int group, float scale,
                             std::span<const KeyRange> ranges, float* out) {
  check_ranges(kv, group, ranges);
  const int d = kv.head_dim;
  std::vector<double> s, acc(static_cast<size_t>(d));
  for (int i = 0; i < group; ++i) {
    const float* qi = q + size_t(i) * size_t(d);
    s.clear();
    for (const KeyRange& r : ranges)
      for (int64_t t = r.begin; t < r.end; ++t) {
        double x = 0.0;
        for (int c = 0; c < d; ++c) x += double(qi[c]) * kv.keys[size_t(t) * size_t(d) + size_t(c)];
        s.push_back(x * scale);
      }
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0.0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    std::fill(acc.begin(), acc.end(), 0.0);
    size_t j = 0;
    for (const KeyRange& r : ranges)
      for (int64_t t = r.begin; t < r.end; ++t, ++j)
        for (int c = 0; c < d; ++c) acc[size_t(c)] += s[j] / sum * kv.values[size_t(t) * size_t(d) + size_t(c)];
    for (int c = 0; c < d; ++c) out[size_t(i) * size_t(d) + size_t(c)] = float(acc[size_t(c)]);
  }
}

namespace {

void check_counts(int64_t n, int64_t sinks, int64_t window) {
  if (n < 1) fail("sparse attention: no keys to select from");
  if (sinks < 0 || window < 0) fail("sparse attention: sinks ({}) and window ({}) must be >= 0", sinks, window);
}

// Appends [begin, end) to sorted ranges, merging with the last when they touch or overlap.
void push_range(std::vector<KeyRange>& ranges, int64_t begin, int64_t end) {
  if (end <= begin) return;
  if (!ranges.empty() && begin <= ranges.back().end) {
    ranges.back().end = std::max(ranges.back().end, end);
    return;
  }
  ranges.push_back({begin, end});
}

}  // namespace

std::vector<KeyRange> retrieval_ranges(std::span<const int64_t> ids, int64_t n, int64_t sinks, int64_t window) {
  check_counts(n, sinks, window);
  std::vector<int64_t> sorted;
  sorted.reserve(ids.size());
  for (int64_t id : ids) {
    if (id == -1) continue;
    if (id < 0 || id >= n) fail("sparse attention: retrieved key id {} is outside [0, {})", id, n);
    sorted.push_back(id);
  }
  std::sort(sorted.begin(), sorted.end());
  const int64_t window_begin = std::max<int64_t>(0, n - window);
  std::vector<KeyRange> ranges;
  push_range(ranges, 0, std::min(sinks, n));
  for (int64_t id : sorted)
    if (id < window_begin) push_range(ranges, id, id + 1);
  push_range(ranges, window_begin, n);
  return ranges;
}

std::vector<KeyRange> block_ranges(std::span<const int32_t> blocks, int block_size, int64_t n, int64_t sinks,
                                   int64_t window) {
  check_counts(n, sinks, window);
  if (block_size < 1) fail("sparse attention: block size {} must be positive", block_size);
  const int64_t window_begin = std::max<int64_t>(0, n - window);
  std::vector<KeyRange> ranges;
  push_range(ranges, 0, std::min(sinks, n));
  int32_t prev = -1;
  for (int32_t b : blocks) {
    const int64_t begin = int64_t(b) * block_size;
    if (b <= prev || begin >= n) fail("sparse attention: block {} is out of order or past the {} keys", b, n);
    prev = b;
    push_range(ranges, begin, std::min({begin + block_size, n, window_begin}));
  }
  push_range(ranges, window_begin, n);
  return ranges;
}

int64_t ranges_size(std::span<const KeyRange> ranges) {
  int64_t total = 0;
  for (const KeyRange& r : ranges) total += r.size();
  return total;
}

}  // namespace kvserve
