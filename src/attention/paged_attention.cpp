#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/vector_ops.h"

namespace kvserve {

void attend_kv_head(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                    int kv_head, int group, int head_dim, const float* q, float* out,
                    AttentionScratch& scratch) {
  const int32_t bs = cache.block_size();
  const int32_t n_blocks = (n_ctx + bs - 1) / bs;
  const int stride = n_blocks * bs;
  if (scratch.scores.size() < size_t(group) * size_t(stride)) scratch.scores.resize(size_t(group) * size_t(stride));
  float* scores = scratch.scores.data();  // (group, stride)
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const KvCodec& kc = cache.k_codec(layer);
  const KvCodec& vc = cache.v_codec(layer);

  for (int32_t b = 0; b < n_blocks; ++b) {
    const int n = std::min(bs, n_ctx - b * bs);
    kc.score(q, group, cache.k_slab(layer, table.blocks[size_t(b)], kv_head), n, head_dim, scale,
             scores + b * bs, stride);
  }
  for (int i = 0; i < group; ++i) softmax(scores + i * stride, n_ctx);
  std::fill(out, out + size_t(group) * head_dim, 0.0f);
  for (int32_t b = 0; b < n_blocks; ++b) {
    const int n = std::min(bs, n_ctx - b * bs);
    vc.accumulate(scores + b * bs, group, stride, cache.v_slab(layer, table.blocks[size_t(b)], kv_head), n,
                  head_dim, out);
  }
}

void attend_kv_head_reference(const KvCache& cache, int layer, const BlockTable& table,
                              int32_t n_ctx, int kv_head, int group, int head_dim,
                              const float* q, float* out) {
  const int32_t bs = cache.block_size();
  std::vector<float> k(static_cast<size_t>(head_dim)), v(static_cast<size_t>(head_dim));
  std::vector<double> s(static_cast<size_t>(n_ctx));
  for (int i = 0; i < group; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    double max_s = -INFINITY;
    for (int32_t t = 0; t < n_ctx; ++t) {
      const int32_t block = table.blocks[size_t(t / bs)];
      cache.k_codec(layer).decode(cache.k_slab(layer, block, kv_head), t % bs, k.data(), head_dim);
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) dot += double(qi[d]) * k[size_t(d)];
      s[size_t(t)] = dot / std::sqrt(double(head_dim));
      max_s = std::max(max_s, s[size_t(t)]);
    }
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - max_s));
    std::vector<double> acc(static_cast<size_t>(head_dim), 0.0);
    for (int32_t t = 0; t < n_ctx; ++t) {
      const int32_t block = table.blocks[size_t(t / bs)];
      cache.v_codec(layer).decode(cache.v_slab(layer, block, kv_head), t % bs, v.data(), head_dim);
      for (int d = 0; d < head_dim; ++d) acc[size_t(d)] += s[size_t(t)] / sum * v[size_t(d)];
    }
    for (int d = 0; d < head_dim; ++d) out[size_t(i) * head_dim + d] = float(acc[size_t(d)]);
  }
}

}  // namespace kvserve
