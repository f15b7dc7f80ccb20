#include "attention/tile_attention.h"

#include "util/simd.h"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "attention/head_slice_prefetch.h"
#include "attention/span_queries.h"

namespace kvserve {
namespace {

// Each row's running largest score and exp-sum, kept as kLanes partial
// lanes until the end of the pass: a block row is one or a few vectors, and
// a horizontal reduction per block row cost as much as its exponentials.
// (16 lanes with AVX-512, 8 with AVX2.)
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
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
inline void max_into(float* lanes, const float* x, int n) {
  __m256 m = _mm256_loadu_ps(lanes);
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  _mm256_storeu_ps(lanes, m);
  for (; i < n; ++i) lanes[0] = std::max(lanes[0], x[i]);
}
inline void exp_into(float* lanes, float* x, int n, int m, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 sum = _mm256_loadu_ps(lanes);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) sum = _mm256_add_ps(sum, simd::exp_tail(x + i, n - i, shift));
  std::fill(x + n, x + m, 0.0f);
  _mm256_storeu_ps(lanes, sum);
}
inline float lanes_max(const float* lanes) { return simd::hmax8(_mm256_loadu_ps(lanes)); }
inline float lanes_sum(const float* lanes) { return simd::hsum8(_mm256_loadu_ps(lanes)); }
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

// Folds one part's softmax (its largest score `top`, exp-sum `sum` and
// unnormalized output part_out, head_dim values `step` apart) into a row's
// running ones (online softmax). top = -inf: the part saw nothing of the row.
inline void merge_part(float& run_top, float& run_sum, float* run_out, float top, float sum, const float* part_out,
                       int head_dim, size_t step = 1) {
  if (top == -INFINITY) return;
  const float next = std::max(run_top, top);
  const float a = run_top == -INFINITY ? 0.0f : std::exp(run_top - next), b = std::exp(top - next);
  for (int d = 0; d < head_dim; ++d) run_out[d * step] = run_out[d * step] * a + part_out[d * step] * b;
  run_sum = run_sum * a + sum * b;
  run_top = next;
}

#if defined(__AVX512F__)
// Float caches (KvCodec::stores_floats): the tile's rows sit in SIMD lanes,
// R vectors of 16, so each key element is broadcast once for every row and
// the softmax needs no horizontal reduction. The codecs' score kernels
// instead reduce each key's products across lanes, and convert the block
// again for every 4 rows; this is a small matrix product.
constexpr int kMaxRowVectors = 4;  // up to 64 rows
// Rows a float tile takes at once: 48 (16 tokens of a group of 3) measured
// 2.6x faster than per-token passes at 16K, tiles of 21 tokens (63 rows)
// 1.6x (BENCHMARKS.md, "Prefill reads each block once per tile").
constexpr int kFloatRows = 48;

// Scores of one block's n keys (k: (n, hd) floats) for every row:
// st[t * 16R + l] = row l's query (qt: (hd, 16R), scaled) . key t, or -inf
// where row l's token does not see position `first` + t (lim: (16R) the
// first position each row does not see); top (16R) := max(top, those).
template <int R>
void score_rows(const float* qt, const float* k, int n, int hd, int32_t first, const int32_t* lim, float* st,
                float* top) {
  constexpr int U = R == 1 ? 8 : 4;  // keys at a time: U * R independent sums
  __m512i lv[R];
  __m512 tv[R];
  #pragma GCC unroll 4
  for (int c = 0; c < R; ++c) {
    lv[c] = _mm512_loadu_si512(lim + 16 * c);
    tv[c] = _mm512_loadu_ps(top + 16 * c);
  }
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < n; t += U) {
    const float* key[U];
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u) key[u] = k + size_t(std::min(t + u, n - 1)) * hd;  // past n: a repeat, not stored
    __m512 acc[U][R];
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) acc[u][c] = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int d = 0; d < hd; ++d) {
      __m512 qv[R];
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) qv[c] = _mm512_loadu_ps(qt + size_t(d) * 16 * R + 16 * c);
      #pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __m512 kb = _mm512_set1_ps(key[u][d]);
        #pragma GCC unroll 4
        for (int c = 0; c < R; ++c) acc[u][c] = _mm512_fmadd_ps(kb, qv[c], acc[u][c]);
      }
    }
    for (int u = 0; u < std::min(U, n - t); ++u) {
      const __m512i pos = _mm512_set1_epi32(first + t + u);
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) {
        const __m512 x = _mm512_mask_mov_ps(none, _mm512_cmplt_epi32_mask(pos, lv[c]), acc[u][c]);
        _mm512_storeu_ps(st + size_t(t + u) * 16 * R + 16 * c, x);
        tv[c] = _mm512_max_ps(tv[c], x);
      }
    }
  }
  #pragma GCC unroll 4
  for (int c = 0; c < R; ++c) _mm512_storeu_ps(top + 16 * c, tv[c]);
}

// One block's weights and values: st := exp(st - top) per row (0 where
// -inf), sum (16R) += them, then ot (hd, 16R) += values^T (v: (n, hd)) st.
template <int R>
void accumulate_rows(float* st, int n, const float* v, int hd, const float* top, float* sum, float* ot) {
  constexpr int D = R == 1 ? 16 : (R <= 3 ? 8 : 4);  // value channels at a time: D * R sums in registers
  __m512 tv[R], sv[R];
  #pragma GCC unroll 4
  for (int c = 0; c < R; ++c) {
    // A row that sees none of the part has top -inf: its weights stay 0, not NaN.
    tv[c] = _mm512_max_ps(_mm512_loadu_ps(top + 16 * c), _mm512_set1_ps(-FLT_MAX));
    sv[c] = _mm512_loadu_ps(sum + 16 * c);
  }
  for (int t = 0; t < n; ++t)
    #pragma GCC unroll 4
    for (int c = 0; c < R; ++c) {
      float* p = st + size_t(t) * 16 * R + 16 * c;
      const __m512 w = simd::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p), tv[c]));
      _mm512_storeu_ps(p, w);
      sv[c] = _mm512_add_ps(sv[c], w);
    }
  #pragma GCC unroll 4
  for (int c = 0; c < R; ++c) _mm512_storeu_ps(sum + 16 * c, sv[c]);
  for (int d0 = 0; d0 < hd; d0 += D) {
    __m512 acc[D][R];
    #pragma GCC unroll 16
    for (int e = 0; e < D; ++e)
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) acc[e][c] = _mm512_loadu_ps(ot + size_t(d0 + e) * 16 * R + 16 * c);
    for (int t = 0; t < n; ++t) {
      __m512 w[R];
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) w[c] = _mm512_loadu_ps(st + size_t(t) * 16 * R + 16 * c);
      const float* vt = v + size_t(t) * hd + d0;
      // Lanes whose weight is 0 (positions past their token's context) add
      // nothing, not 0 x an infinite value (an FP16 overflow): NaN.
      __mmask16 live[R];
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) live[c] = _mm512_cmpneq_ps_mask(w[c], _mm512_setzero_ps());
      #pragma GCC unroll 16
      for (int e = 0; e < D; ++e) {
        const __m512 x = _mm512_set1_ps(vt[e]);
        #pragma GCC unroll 4
        for (int c = 0; c < R; ++c) acc[e][c] = _mm512_mask3_fmadd_ps(x, w[c], acc[e][c], live[c]);
      }
    }
    #pragma GCC unroll 16
    for (int e = 0; e < D; ++e)
      #pragma GCC unroll 4
      for (int c = 0; c < R; ++c) _mm512_storeu_ps(ot + size_t(d0 + e) * 16 * R + 16 * c, acc[e][c]);
  }
}

// The tile over a float cache whose views do not change within the tile
// (no block staged for some of its tokens and sealed for others).
template <int R>
void attend_float_rows(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx0, int tokens,
                       int kv_head, int group, int head_dim, const float* q, size_t stride, float* out,
                       AttentionScratch& scratch, int32_t part_tokens) {
  const int32_t bs = cache.block_size();
  const int32_t n_last = n_ctx0 + tokens - 1;
  const int32_t n_blocks = (n_last + bs - 1) / bs, part_blocks = std::max(1, part_tokens / bs);
  const int rows = tokens * group, lanes = 16 * R, hd = head_dim;
  const size_t cell = size_t(bs) * lanes;  // part block j's scores: (bs, lanes) at j * cell
  if (scratch.scores.size() < size_t(part_blocks) * cell) scratch.scores.resize(size_t(part_blocks) * cell);
  const size_t need = size_t(hd) * lanes * 3 + size_t(bs) * hd + size_t(lanes) * 5;
  if (scratch.tile_q.size() < need) scratch.tile_q.resize(need);
  float* qt = scratch.tile_q.data();         // (hd, lanes) queries, scaled; padding rows 0
  float* ot = qt + size_t(hd) * lanes;       // (hd, lanes) unnormalized outputs so far, weighed by run_top
  float* part_ot = ot + size_t(hd) * lanes;  // (hd, lanes) one part's
  float* kv = part_ot + size_t(hd) * lanes;  // (bs, hd) one block's keys, then values
  float* top = kv + size_t(bs) * hd;         // (lanes) the part's largest score per row
  float* sum = top + lanes;                  // (lanes) its sum of exp(score - top)
  float* run_top = sum + lanes;              // (lanes) the largest score so far
  float* run_sum = run_top + lanes;          // (lanes)
  int32_t* lim = reinterpret_cast<int32_t*>(run_sum + lanes);  // (lanes) first position each row does not see
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int r = 0; r < lanes; ++r) {
    const float* qr = r < rows ? q + size_t(r / group) * stride + size_t(r % group) * hd : nullptr;
    for (int d = 0; d < hd; ++d) qt[size_t(d) * lanes + r] = qr != nullptr ? qr[d] * scale : 0.0f;
    lim[r] = r < rows ? n_ctx0 + r / group : INT32_MAX;  // padding rows: every score 0, never read out
    run_top[r] = -INFINITY;
    run_sum[r] = 0.0f;
  }
  std::fill(ot, ot + size_t(hd) * lanes, 0.0f);
  auto k_at = [&](int32_t j) { return cache.k_view(layer, table, j, n_last); };
  auto v_at = [&](int32_t j) { return cache.v_view(layer, table, j, n_last); };
  for (int32_t jp = 0; jp < n_blocks; jp += part_blocks) {  // parts, as the codec path takes them
    const int32_t je = std::min(n_blocks, jp + part_blocks);
    std::fill(top, top + lanes, -INFINITY);
    std::fill(sum, sum + lanes, 0.0f);
    std::fill(part_ot, part_ot + size_t(hd) * lanes, 0.0f);
    // The part's blocks in order, with their prefetch hints, each decoded
    // into kv: fn(first position, tokens, the block's scores).
    auto each_block = [&](auto view_at, auto&& fn) {
      HeadSlicePrefetch prefetch(kv_head, je - jp, [&](int32_t i) { return view_at(jp + i); });
      for (int32_t j = jp; j < je; ++j) {
        prefetch.before(j - jp);
        const int n = std::min(bs, n_last - j * bs);
        const KvBlockView view = view_at(j);
        view.codec->decode_head(view.data, n, kv_head, kv);
        fn(j * bs, n, scratch.scores.data() + size_t(j - jp) * cell);
      }
    };
    each_block(k_at, [&](int32_t first, int n, float* st) { score_rows<R>(qt, kv, n, hd, first, lim, st, top); });
    each_block(v_at, [&](int32_t, int n, float* st) { accumulate_rows<R>(st, n, kv, hd, top, sum, part_ot); });
    for (int r = 0; r < lanes; ++r)  // row r's outputs run down lane r
      merge_part(run_top[r], run_sum[r], ot + r, top[r], sum[r], part_ot + r, hd, size_t(lanes));
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + size_t(r / group) * stride + size_t(r % group) * hd;
    const float inv = 1.0f / run_sum[r];  // > 0: each row's largest weight is 1
    for (int d = 0; d < hd; ++d) dst[d] = ot[size_t(d) * lanes + r] * inv;
  }
}

// Whether a layer's tiles can take attend_float_rows: float codecs (keys
// after RoPE), head_dim a multiple of 16, a group of at most 64 query heads.
// Float layers are never staged (KvCache), so every token of a tile reads a
// block through the same view; the tests' float caches with a residual
// window would catch it if they were.
bool float_rows_fit(const KvCache& cache, int layer, int group, int head_dim) {
  return cache.k_codec(layer).stores_floats() && cache.v_codec(layer).stores_floats() && !cache.k_pre_rope(layer) &&
         head_dim % 16 == 0 && group <= 16 * kMaxRowVectors;
}
#endif

}  // namespace

bool attend_kv_head_tile(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx0, int tokens,
                         int kv_head, int group, int head_dim, const float* q, size_t stride, float* out,
                         AttentionScratch& scratch, int32_t part_tokens) {
  // Keys stored before RoPE take a tile only in spans (the int2 presets),
  // while slots are positions: each span's rows share one rotation. Keys
  // stored after RoPE need no position, so a compacted table (slots that
  // are no longer positions) still takes tiles.
  const int rope_span = cache.k_pre_rope(layer) ? cache.k_rope_span(layer) : 0;
  const bool exact_pre_rope = cache.k_pre_rope(layer) && (rope_span <= 1 || !table.slot_positions.empty());
  if (exact_pre_rope || table.dead > 0 || tokens < 1 || n_ctx0 < 1) return false;
#if defined(__AVX512F__)
  if (float_rows_fit(cache, layer, group, head_dim)) {
    // Sub-tiles of at most kFloatRows rows, whole tokens.
    const int per = std::max(1, kFloatRows / group);
    for (int t0 = 0; t0 < tokens; t0 += per) {
      const int n = std::min(per, tokens - t0);
      const float* qs = q + size_t(t0) * stride;
      float* os = out + size_t(t0) * stride;
      switch ((n * group + 15) / 16) {
        case 1: attend_float_rows<1>(cache, layer, table, n_ctx0 + t0, n, kv_head, group, head_dim, qs, stride, os, scratch, part_tokens); break;
        case 2: attend_float_rows<2>(cache, layer, table, n_ctx0 + t0, n, kv_head, group, head_dim, qs, stride, os, scratch, part_tokens); break;
        case 3: attend_float_rows<3>(cache, layer, table, n_ctx0 + t0, n, kv_head, group, head_dim, qs, stride, os, scratch, part_tokens); break;
        default: attend_float_rows<4>(cache, layer, table, n_ctx0 + t0, n, kv_head, group, head_dim, qs, stride, os, scratch, part_tokens); break;
      }
    }
    return true;
  }
#endif
  const int32_t bs = cache.block_size();
  const int32_t n_last = n_ctx0 + tokens - 1;  // slots the tile's last token sees
  const int32_t n_blocks = (n_last + bs - 1) / bs;
  const int rows = tokens * group;  // row tau * group + i: token tau, query head i
  const size_t set = size_t(group) * size_t(head_dim), cell = size_t(rows) * size_t(bs);
  // Scores block-major: part block j's (rows, bs) at scores + j * cell. Each pass
  // then streams through one run of memory; row-major rows (a row per
  // query, ~64 KB apart at 16K) were more streams than the hardware
  // prefetchers follow.
  const int32_t part_blocks = std::max(1, part_tokens / bs);
  if (scratch.scores.size() < size_t(part_blocks) * cell) scratch.scores.resize(size_t(part_blocks) * cell);
  if (scratch.tile_q.size() < size_t(tokens) * set) scratch.tile_q.resize(size_t(tokens) * set);
  if (scratch.tile_out.size() < 2 * size_t(tokens) * set) scratch.tile_out.resize(2 * size_t(tokens) * set);
  const size_t stat = size_t(rows) * kLanes;
  if (scratch.tile_stats.size() < 2 * stat + 2 * size_t(rows)) scratch.tile_stats.resize(2 * stat + 2 * size_t(rows));
  float* scores = scratch.scores.data();
  float* tq = scratch.tile_q.data();       // (rows, head_dim)
  float* to = scratch.tile_out.data();     // (rows, head_dim) outputs so far, weighed by run_top
  float* part_out = to + size_t(tokens) * set;  // (rows, head_dim) one part's
  float* top = scratch.tile_stats.data();  // (rows, kLanes) each row's largest score in the part
  float* sum = top + stat;                 // (rows, kLanes) its sum of exp(score - top)
  float* run_top = sum + stat;             // (rows) the largest score so far
  float* run_sum = run_top + rows;         // (rows) the sum of exp(score - run_top) so far
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

  // Keys in RoPE spans (KvCodecConfig::rope_span): the rows rotated back to
  // each span's first position, as attend_kv_head rotates its group.
  float* span_q = nullptr;  // (spans of a block, rows of a run, head_dim)
  if (rope_span > 1) {
    const size_t need = size_t(rows) * head_dim * (1 + size_t((bs + rope_span - 1) / rope_span));
    if (scratch.rotated.size() < need) scratch.rotated.resize(need);
    span_q = scratch.rotated.data() + size_t(rows) * head_dim;
  }
  SpanQueries span_queries(cache.rope_table_if_any(), tq, rows, head_dim, scratch.rotated.data());
  auto score_run = [&](const KvBlockView& k, int32_t j, int a, int b, int n, float* block_scores) {
    const int nr = (b - a) * group;
    float* dst = block_scores + size_t(a) * group * bs;
    if (rope_span <= 1) {
      k.codec->score(tq + size_t(a) * set, nr, k.data, n, kv_head, scale, dst, bs);
      return;
    }
    span_queries.rotate(j * bs, n, rope_span, a * group, nr, span_q);
    k.codec->score_spans(span_q, nr, k.data, n, rope_span, kv_head, scale, dst, bs);
  };

  // The context in parts of part_tokens, each a two-pass softmax over its
  // blocks, merged as they come (as merge_attention_parts weighs decode's
  // parts): the scores of a part stay in L2 between its two passes, and a
  // tile's scratch does not grow with the context.
  std::fill(run_top, run_top + rows, -INFINITY);
  std::fill(run_sum, run_sum + rows, 0.0f);
  std::fill(to, to + size_t(rows) * head_dim, 0.0f);
  for (int32_t jp = 0; jp < n_blocks; jp += part_blocks) {
    const int32_t je = std::min(n_blocks, jp + part_blocks);
    const int r0 = first_reader(jp) * group;  // rows that see some of the part
    std::fill(top, top + stat, -INFINITY);
    HeadSlicePrefetch prefetch_k(kv_head, je - jp, [&](int32_t i) { return k_at(jp + i, n_last); });
    for (int32_t j = jp; j < je; ++j) {
      prefetch_k.before(j - jp);
      float* block_scores = scores + size_t(j - jp) * cell;
      runs(k_at, j, [&](const KvBlockView& k, int a, int b, int n) { score_run(k, j, a, b, n, block_scores); });
      for (int r = first_reader(j) * group; r < rows; ++r)
        max_into(top + size_t(r) * kLanes, block_scores + size_t(r) * bs, seen(r, j));
    }
    for (int r = r0; r < rows; ++r) top[r] = lanes_max(top + size_t(r) * kLanes);  // row r's largest, in place
    std::fill(sum, sum + stat, 0.0f);
    std::fill(part_out + size_t(r0) * head_dim, part_out + size_t(rows) * head_dim, 0.0f);
    HeadSlicePrefetch prefetch_v(kv_head, je - jp, [&](int32_t i) { return v_at(jp + i, n_last); });
    for (int32_t j = jp; j < je; ++j) {
      prefetch_v.before(j - jp);
      float* block_scores = scores + size_t(j - jp) * cell;
      const int n = std::min(bs, n_last - j * bs);
      // Unnormalized weights (each row's largest in the part is 1).
      for (int r = first_reader(j) * group; r < rows; ++r)
        exp_into(sum + size_t(r) * kLanes, block_scores + size_t(r) * bs, seen(r, j), n, top[r]);
      // Tokens that see only part of the block weigh only that part: a
      // weight of 0 on a value past their context would still turn an
      // infinite value (an FP16 overflow) into NaN for them.
      runs(v_at, j, [&](const KvBlockView& v, int a, int b, int n_read) {
        auto weigh = [&](int t0, int t1, int n_seen) {
          v.codec->accumulate(block_scores + size_t(t0) * group * bs, (t1 - t0) * group, bs, v.data, n_seen, kv_head,
                              part_out + size_t(t0) * set);
        };
        const int whole = std::clamp(j * bs + n_read - n_ctx0, a, b);  // the first token that sees all n_read
        for (int t = a; t < whole; ++t) weigh(t, t + 1, seen(t * group, j));
        if (whole < b) weigh(whole, b, n_read);
      });
    }
    for (int r = r0; r < rows; ++r)
      merge_part(run_top[r], run_sum[r], to + size_t(r) * head_dim, top[r], lanes_sum(sum + size_t(r) * kLanes),
                 part_out + size_t(r) * head_dim, head_dim);
  }
  for (int r = 0; r < rows; ++r) {
    const float* src = to + size_t(r) * head_dim;
    float* dst = out + size_t(r / group) * stride + size_t(r % group) * head_dim;
    const float inv = 1.0f / run_sum[r];  // > 0: the largest weight is 1
    for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * inv;
  }
  return true;
}

}  // namespace kvserve
