#include "attention/topk_policy.h"

#include <algorithm>

namespace kvserve {

TopKPolicy::TopKPolicy(const SparsityOptions& options, const KvCache& cache)
    : blocks_read_((options.budget + cache.block_size() - 1) / cache.block_size()),
      block_size_(cache.block_size()),
      kv_dim_(size_t(cache.k_codec(0).shape().kv_dim())) {
  const KvBlockShape& shape = cache.k_codec(0).shape();
  for (int l = 0; l < cache.n_layers(); ++l)
    summaries_.emplace_back(BlockSummaryOptions{cache.block_size(), shape.n_kv_heads, shape.head_dim});
}

void TopKPolicy::begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) {
  const int32_t have = int32_t(summaries_[0].num_tokens());
  if (have >= table.num_tokens) return;
  std::vector<float> keys(size_t(table.num_tokens - have) * kv_dim_);
  for (int l = 0; l < cache.n_layers(); ++l) {
    cache.read_keys(l, table, have, table.num_tokens, keys.data());
    summaries_[size_t(l)].append(keys);
  }
}

void TopKPolicy::on_kv(int layer, int32_t slot, const float* k, const float* v) {
  summaries_[size_t(layer)].append(std::span<const float>(k, kv_dim_));
}

void TopKPolicy::select(int layer, int kv_head, const float* q, int group, int32_t n_ctx, ReadSet& out) const {
  std::vector<int32_t>& blocks = out.blocks;
  blocks.clear();
  out.keep.clear();
  const int32_t n_blocks = (n_ctx + block_size_ - 1) / block_size_;
  if (n_blocks <= blocks_read_) return;  // everything fits the budget
  thread_local std::vector<float> bound;
  thread_local std::vector<int32_t> order;
  const BlockSummary& summary = summaries_[size_t(layer)];
  bound.resize(size_t(summary.num_blocks()));
  summary.upper_bounds(kv_head, q, group, GroupCombine::Max, bound.data());
  // The best K - 1 of the blocks before the query's own (ties: the older).
  const int32_t own = n_blocks - 1, k = blocks_read_ - 1;
  order.resize(size_t(own));
  for (int32_t b = 0; b < own; ++b) order[size_t(b)] = b;
  auto higher = [&](int32_t a, int32_t b) {
    return bound[size_t(a)] > bound[size_t(b)] || (bound[size_t(a)] == bound[size_t(b)] && a < b);
  };
  if (k > 0) std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), higher);
  blocks.assign(order.begin(), order.begin() + k);
  blocks.push_back(own);
  std::sort(blocks.begin(), blocks.end());
}

}  // namespace kvserve
