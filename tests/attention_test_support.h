// Error allowances shared by the attention tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "attention/paged_attention.h"
#include "kv/channel_codec.h"
#include "kv/int_codecs.h"
#include "kv/kv_cache.h"

namespace kvserve::testing_attention {

// The largest |kernel score - exact q·k| over the blocks of the context whose
// keys are scored against a rounded query: an 8-bit folded one
// (channel_query_steps() == 127), or, for token-grouped keys scored as
// integers, the query itself rounded to token_query_steps() steps; 0 when
// there are none. Every weight then moves by a factor within e^(±2 delta)
// and the attention output by at most (e^(2 delta) - 1) max |v|. Each
// block's error is first checked against the format's worst case (as in
// kv_codec_test: per channel half a step of max_c |q_c scale_c| / L against
// a code of at most 2^B - 1, scale_c (2^B - 1) <= 2 max |k|), so a wrong
// kernel cannot widen the allowance it is then judged by.
inline double rounded_query_delta(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                                  int kv_head, int group, int head_dim, const float* q) {
  const int32_t bs = cache.block_size();
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const int kv_dim = cache.k_codec(layer).shape().kv_dim();
  std::vector<float> keys(size_t(bs) * size_t(kv_dim)), s(size_t(group) * size_t(bs));
  double delta = 0;
  for (int32_t b = 0; b * bs < n_ctx; ++b) {
    const int n = std::min(bs, n_ctx - b * bs);
    const KvBlockView kb = cache.k_view(layer, table, b, n_ctx);
    if (cache.k_pre_rope(layer)) continue;
    const int steps = channel_query_steps(kb.codec->config(), kb.codec->shape()) == 127
                          ? 127
                          : token_query_steps(kb.codec->config(), kb.codec->shape());
    if (steps == 0) continue;
    kb.codec->score(q, group, kb.data, n, kv_head, scale, s.data(), bs);
    double max_k = 0;
    for (int t = 0; t < n; ++t) {
      kb.codec->decode_token(kb.data, t, keys.data() + size_t(t) * kv_dim);
      for (int d = 0; d < head_dim; ++d)
        max_k = std::max(max_k, std::fabs(double(keys[size_t(t) * kv_dim + size_t(kv_head * head_dim + d)])));
    }
    for (int t = 0; t < n; ++t) {
      const float* k = keys.data() + size_t(t) * kv_dim + size_t(kv_head * head_dim);
      for (int i = 0; i < group; ++i) {
        double dot = 0, max_q = 0;
        for (int d = 0; d < head_dim; ++d) {
          dot += double(q[i * head_dim + d]) * k[d];
          max_q = std::max(max_q, std::fabs(double(q[i * head_dim + d])));
        }
        const double err = std::fabs(double(s[size_t(i * bs + t)]) - scale * dot);
        EXPECT_LE(err, 1.01 * scale * head_dim * max_q * max_k / steps + 1e-4 * (1 + std::fabs(scale * dot)))
            << "block " << b << " token " << t << " query " << i;
        delta = std::max(delta, err);
      }
    }
  }
  return delta;
}

// The largest |v| among the context's decoded values of kv_head.
inline double max_value(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx, int kv_head,
                        int head_dim) {
  const int32_t bs = cache.block_size();
  std::vector<float> v(size_t(cache.v_codec(layer).shape().kv_dim()));
  double top = 0;
  for (int32_t t = 0; t < n_ctx; ++t) {
    const KvBlockView vb = cache.v_view(layer, table, t / bs, n_ctx);
    vb.codec->decode_token(vb.data, t % bs, v.data());
    for (int d = 0; d < head_dim; ++d) top = std::max(top, std::fabs(double(v[size_t(kv_head * head_dim + d)])));
  }
  return top;
}

// What 8-bit folded queries may add to an attention output element.
inline double rounded_query_allowance(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                                      int kv_head, int group, int head_dim, const float* q) {
  const double delta = rounded_query_delta(cache, layer, table, n_ctx, kv_head, group, head_dim, q);
  return delta > 0 ? std::expm1(2 * delta) * max_value(cache, layer, table, n_ctx, kv_head, head_dim) : 0.0;
}

// What 8-bit value weights (token_weight_steps() == 127) may add to an
// attention output element. In each block read with them, token t's u_t =
// w_t scale_t is rounded to a step of max_t u_t / 127; after the midpoint
// correction a token misses at most half a step against |code - 7.5| <= 7.5,
// and scale_t <= 2.15 max |v| / 15 (8-bit scales round up by up to 4.4%, so
// the top value can land on code 14: 15 / 7 < 2.15). With p the exact
// softmax weights, (rows, n_ctx) (a query's, or a group's sums, which bound
// each of them), the largest over rows of
//   sum_b n_b max_{t in b} p_t * 3.75 * 2.15 max |v| / (15 * 127),
// times e^(4 delta) for weights moved by an 8-bit query's score error delta
// (each p_t and the block's largest).
inline double weight_rounding_bound(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                                    int kv_head, int head_dim, const std::vector<double>& p, int rows,
                                    double delta) {
  const int32_t bs = cache.block_size();
  double top = 0;
  for (int r = 0; r < rows; ++r) {
    double sum = 0;
    for (int32_t b = 0; b * bs < n_ctx; ++b) {
      const KvBlockView vb = cache.v_view(layer, table, b, n_ctx);
      if (token_weight_steps(vb.codec->config(), vb.codec->shape()) != 127) continue;
      const int n = std::min(bs, n_ctx - b * bs);
      double max_p = 0;
      for (int t = 0; t < n; ++t) max_p = std::max(max_p, p[size_t(r) * size_t(n_ctx) + size_t(b * bs + t)]);
      sum += n * max_p;
    }
    top = std::max(top, sum);
  }
  if (top == 0) return 0.0;
  return top * 3.75 * 2.15 / (15 * 127) * max_value(cache, layer, table, n_ctx, kv_head, head_dim) *
         std::exp(4 * delta);
}

// Both roundings' allowance for attend_kv_head against attend_kv_head_reference.
inline double rounding_allowance(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                                 int kv_head, int group, int head_dim, const float* q) {
  std::vector<float> ref(size_t(group) * size_t(head_dim));
  std::vector<double> p;
  attend_kv_head_reference(cache, layer, table, n_ctx, kv_head, group, head_dim, q, ref.data(), &p);
  const double delta = rounded_query_delta(cache, layer, table, n_ctx, kv_head, group, head_dim, q);
  return rounded_query_allowance(cache, layer, table, n_ctx, kv_head, group, head_dim, q) +
         weight_rounding_bound(cache, layer, table, n_ctx, kv_head, head_dim, p, group, delta);
}

}  // namespace kvserve::testing_attention
