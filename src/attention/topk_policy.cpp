#include "attention/topk_policy.h"

#include <algorithm>
#include <cmath>

namespace kvserve {

TopKPolicy::TopKPolicy(const SparsityOptions& options, const KvCache& cache)
    : blocks_read_((options.budget + cache.block_size() - 1) / cache.block_size()),
      n_kv_heads_(cache.k_codec(0).shape().n_kv_heads),
      head_dim_(cache.k_codec(0).shape().head_dim),
      block_size_(cache.block_size()),
      summaries_(size_t(cache.n_layers()) * size_t(n_kv_heads_)) {}

void TopKPolicy::on_kv(int layer, int32_t slot, const float* k, const float* v) {
  const int32_t b = slot / block_size_;
  const size_t row = size_t(2 * head_dim_);
  for (int h = 0; h < n_kv_heads_; ++h) {
    std::vector<float>& s = summaries_[size_t(layer) * n_kv_heads_ + h];
    const float* kh = k + size_t(h) * head_dim_;
    if (s.size() < size_t(b + 1) * row) {  // the block's first key
      s.resize(size_t(b + 1) * row);
      std::copy_n(kh, head_dim_, s.begin() + int64_t(b) * int64_t(row));
      std::copy_n(kh, head_dim_, s.begin() + int64_t(b) * int64_t(row) + head_dim_);
      continue;
    }
    float* lo = s.data() + size_t(b) * row;
    float* hi = lo + head_dim_;
    for (int d = 0; d < head_dim_; ++d) {
      lo[d] = std::min(lo[d], kh[d]);
      hi[d] = std::max(hi[d], kh[d]);
    }
  }
}

float TopKPolicy::upper_bound(int layer, int kv_head, int32_t block, const float* q) const {
  const float* lo = summaries_[size_t(layer) * n_kv_heads_ + kv_head].data() + size_t(block) * 2 * head_dim_;
  const float* hi = lo + head_dim_;
  float bound = 0;
  for (int d = 0; d < head_dim_; ++d) bound += std::max(q[d] * lo[d], q[d] * hi[d]);
  return bound;
}

void TopKPolicy::select(int layer, int kv_head, const float* q, int group, int32_t n_ctx,
                        std::vector<int32_t>& blocks) const {
  blocks.clear();
  const int32_t n_blocks = (n_ctx + block_size_ - 1) / block_size_;
  if (n_blocks <= blocks_read_) return;  // everything fits the budget
  thread_local std::vector<float> bound;
  thread_local std::vector<int32_t> order;
  const int32_t own = n_blocks - 1;
  bound.assign(size_t(own), 0.0f);
  order.resize(size_t(own));
  for (int32_t b = 0; b < own; ++b) {
    float best = -INFINITY;
    for (int i = 0; i < group; ++i) best = std::max(best, upper_bound(layer, kv_head, b, q + size_t(i) * head_dim_));
    bound[size_t(b)] = best;
    order[size_t(b)] = b;
  }
  const int32_t k = blocks_read_ - 1;  // besides the query's own block
  auto higher = [&](int32_t a, int32_t b) { return bound[size_t(a)] > bound[size_t(b)] || (bound[size_t(a)] == bound[size_t(b)] && a < b); };
  if (k > 0) std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), higher);
  blocks.assign(order.begin(), order.begin() + k);
  blocks.push_back(own);
  std::sort(blocks.begin(), blocks.end());
}

}  // namespace kvserve
