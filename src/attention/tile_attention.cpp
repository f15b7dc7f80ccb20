#include "attention/tile_attention.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>

#include "attention/head_slice_prefetch.h"

namespace kvserve {
namespace {

// Each row's running largest score and exp-sum, kept as kLanes partial
// lanes until the end of the pass: a block row is one or a few vectors, and
// a horizontal reduction per block row cost as much as its exponentials.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
inline __mmask16 first_lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(0, n)) - 1); }
// lanes := max(lanes, x[0, n)), n >= 1.
inline void max_into(float* lanes, const float* x, int n) {
  __m512 m = _mm512_loadu_ps(lanes);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);  // masked loads: a row of a small block ends mid-vector
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
  }
  _mm512_storeu_ps(lanes, m);
}
// x[0, n) := exp(x - shift) (shift >= every x), x[n, m) := 0; lanes += them.
inline void exp_into(float* lanes, float* x, int n, int m, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 sum = _mm512_loadu_ps(lanes);
  for (int i = 0; i < m; i += 16) {
    const __mmask16 store = first_lanes(m - i), live = store & first_lanes(n - i);
    const __m512 e = _mm512_maskz_mov_ps(live, simd::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(store, x + i), sh)));
    _mm512_mask_storeu_ps(x + i, store, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(lanes, sum);
}
inline float lanes_max(const float* lanes) { return _mm512_reduce_max_ps(_mm512_loadu_ps(lanes)); }
inline float lanes_sum(const float* lanes) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes)); }
#else
constexpr int kLanes = 1;
inline void max_into(float* lanes, const float* x, int n) { *lanes = std::max(*lanes, *std::max_element(x, x + n)); }
inline void exp_into(float* lanes, float* x, int n, int m, float shift) {
  for (int i = 0; i < n; ++i) *lanes += (x[i] = std::exp(x[i] - shift));
  std::fill(x + n, x + m, 0.0f);
}
inline float lanes_max(const float* lanes) { return *lanes; }
inline float lanes_sum(const float* lanes) { return *lanes; }
#endif

}  // namespace

bool attend_kv_head_tile(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx0, int tokens,
                         int kv_head, int group, int head_dim, const float* q, size_t stride, float* out,
                         AttentionScratch& scratch) {
  const bool moved = !table.slot_positions.empty() && !table.positions_in_cache;
  if (cache.k_pre_rope(layer) || table.dead > 0 || moved || tokens < 1 || n_ctx0 < 1) return false;
  const int32_t bs = cache.block_size();
  const int32_t n_last = n_ctx0 + tokens - 1;  // slots the tile's last token sees
  const int32_t n_blocks = (n_last + bs - 1) / bs;
  const int rows = tokens * group;  // row tau * group + i: token tau, query head i
  const size_t set = size_t(group) * size_t(head_dim), cell = size_t(rows) * size_t(bs);
  // Scores block-major: block j's (rows, bs) at scores + j * cell. Each pass
  // then streams through one run of memory; row-major rows (a row per
  // query, ~64 KB apart at 16K) were more streams than the hardware
  // prefetchers follow.
  if (scratch.scores.size() < size_t(n_blocks) * cell) scratch.scores.resize(size_t(n_blocks) * cell);
  if (scratch.tile_q.size() < size_t(tokens) * set) scratch.tile_q.resize(size_t(tokens) * set);
  if (scratch.tile_out.size() < size_t(tokens) * set) scratch.tile_out.resize(size_t(tokens) * set);
  const size_t stat = size_t(rows) * kLanes;
  if (scratch.tile_stats.size() < 2 * stat) scratch.tile_stats.resize(2 * stat);
  float* scores = scratch.scores.data();
  float* tq = scratch.tile_q.data();  // (rows, head_dim)
  float* to = scratch.tile_out.data();  // (rows, head_dim)
  float* top = scratch.tile_stats.data();  // (rows, kLanes) each row's largest score
  float* sum = top + stat;                 // (rows, kLanes) its sum of exp(score - top)
  for (int tau = 0; tau < tokens; ++tau) std::copy(q + size_t(tau) * stride, q + size_t(tau) * stride + set, tq + size_t(tau) * set);
  const float scale = 1.0f / std::sqrt(float(head_dim));

  // Block j is read by tokens [first_reader(j), tokens) in runs that share
  // one view: the block is staged in FP16 for the tokens before the one
  // whose context seals it (KvCache::k_view), encoded from there on. fn(view,
  // tau0, tau1, n): n = the block's tokens the last token sees; an earlier
  // row's scores past its own context get weight 0 below.
  auto first_reader = [&](int32_t j) { return std::max(0, j * bs + 1 - n_ctx0); };
  auto runs = [&](auto view_at, int32_t j, auto&& fn) {
    const int n = std::min(bs, n_last - j * bs);
    const int tau0 = first_reader(j);
    const KvBlockView last = view_at(j, n_last);
    if (view_at(j, n_ctx0 + tau0).data == last.data) {
      fn(last, tau0, tokens, n);
      return;
    }
    for (int a = tau0, b; a < tokens; a = b) {
      const KvBlockView v = view_at(j, n_ctx0 + a);
      for (b = a + 1; b < tokens && view_at(j, n_ctx0 + b).data == v.data;) ++b;
      fn(v, a, b, n);
    }
  };
  auto k_at = [&](int32_t j, int32_t n_ctx) { return cache.k_view(layer, table, j, n_ctx); };
  auto v_at = [&](int32_t j, int32_t n_ctx) { return cache.v_view(layer, table, j, n_ctx); };
  // Columns of block j that row r's token sees (>= 1 from its first reader on).
  auto seen = [&](int r, int32_t j) { return std::min(bs, n_ctx0 + r / group - j * bs); };

  std::fill(top, top + stat, -INFINITY);
  HeadSlicePrefetch prefetch_k(kv_head, n_blocks, [&](int32_t i) { return k_at(i, n_last); });
  for (int32_t j = 0; j < n_blocks; ++j) {
    prefetch_k.before(j);
    float* block_scores = scores + size_t(j) * cell;
    runs(k_at, j, [&](const KvBlockView& k, int a, int b, int n) {
      k.codec->score(tq + size_t(a) * set, (b - a) * group, k.data, n, kv_head, scale,
                     block_scores + size_t(a) * group * bs, bs);
    });
    for (int r = first_reader(j) * group; r < rows; ++r)
      max_into(top + size_t(r) * kLanes, block_scores + size_t(r) * bs, seen(r, j));
  }
  for (int r = 0; r < rows; ++r) top[r] = lanes_max(top + size_t(r) * kLanes);  // row r's largest, in place
  std::fill(sum, sum + stat, 0.0f);
  std::fill(to, to + size_t(rows) * head_dim, 0.0f);
  HeadSlicePrefetch prefetch_v(kv_head, n_blocks, [&](int32_t i) { return v_at(i, n_last); });
  for (int32_t j = 0; j < n_blocks; ++j) {
    prefetch_v.before(j);
    float* block_scores = scores + size_t(j) * cell;
    const int n = std::min(bs, n_last - j * bs);
    // Unnormalized weights (each row's largest is 1), divided by the sums at the end.
    for (int r = first_reader(j) * group; r < rows; ++r)
      exp_into(sum + size_t(r) * kLanes, block_scores + size_t(r) * bs, seen(r, j), n, top[r]);
    runs(v_at, j, [&](const KvBlockView& v, int a, int b, int n_read) {
      v.codec->accumulate(block_scores + size_t(a) * group * bs, (b - a) * group, bs, v.data, n_read, kv_head,
                          to + size_t(a) * set);
    });
  }
  for (int r = 0; r < rows; ++r) {
    const float* src = to + size_t(r) * head_dim;
    float* dst = out + size_t(r / group) * stride + size_t(r % group) * head_dim;
    const float inv = 1.0f / lanes_sum(sum + size_t(r) * kLanes);  // > 0: the largest weight is 1
    for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * inv;
  }
  return true;
}

}  // namespace kvserve
