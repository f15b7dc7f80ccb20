// Error allowances shared by the attention tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "kv/channel_codec.h"
#include "kv/kv_cache.h"

namespace kvserve::testing_attention {

// The largest |kernel score - exact q·k| over the blocks of the context whose
// keys are scored against an 8-bit folded query (channel_query_steps() ==
// 127); 0 when there are none. Every weight then moves by a factor within
// e^(±2 delta) and the attention output by at most (e^(2 delta) - 1) max |v|.
// Each block's error is first checked against the format's worst case (as
// in kv_codec_test: per channel half a step of max_c |q_c scale_c| / 127
// against a code of at most 15, scale_c 15 <= 2 max |k|), so a wrong kernel
// cannot widen the allowance it is then judged by.
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
    if (cache.k_pre_rope(layer) || channel_query_steps(kb.codec->config(), kb.codec->shape()) != 127) continue;
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
        EXPECT_LE(err, 1.01 * scale * head_dim * max_q * max_k / 127 + 1e-4 * (1 + std::fabs(scale * dot)))
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

}  // namespace kvserve::testing_attention
