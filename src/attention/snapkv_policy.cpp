#include "attention/snapkv_policy.h"

#include <algorithm>

namespace kvserve {

SnapKvPolicy::SnapKvPolicy(const SparsityOptions& options, const KvCache& cache)
    : EvictingPolicy(options, cache), ring_(size_t(options.observe)), queries_(size_t(rows_), 0) {
  for (auto& r : ring_) track(&r);
}

void SnapKvPolicy::observe(int layer, int kv_head, const float* weights, int32_t n_ctx) {
  const int row = layer * n_kv_heads_ + kv_head;
  std::vector<float>& dst = ring_[size_t(queries_[size_t(row)]++ % options_.observe)];
  // Slots past n_ctx hold no older query's weight: they did not exist then,
  // or were compacted away with it (tracked arrays shrink with the slots).
  for (int32_t s = 0; s < n_ctx; ++s) dst[at(s, row)] = weights[s];
}

void SnapKvPolicy::choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) {
  const size_t n = live.size();
  raw_.assign(n, 0.0f);
  const int64_t held = std::min<int64_t>(options_.observe, row >= 0 ? queries_[size_t(row)] : queries_[0]);
  for (size_t i = 0; i < n; ++i) {
    const int32_t slot = live[i].slot;
    float v = 0;
    for (int64_t q = 0; q < held; ++q) {
      const std::vector<float>& r = ring_[size_t(q)];
      if (row >= 0) {
        v += r[at(slot, row)];
      } else {
        for (int k = 0; k < rows_; ++k) v += r[at(slot, k)];
      }
    }
    raw_[i] = v * value_weight(slot, row);
  }
  // Max-pool over neighbouring live tokens (slot order is position order).
  const int half = options_.pool / 2;
  pooled_.assign(n, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const size_t lo = i >= size_t(half) ? i - size_t(half) : 0, hi = std::min(n, i + size_t(half) + 1);
    pooled_[i] = *std::max_element(raw_.begin() + int64_t(lo), raw_.begin() + int64_t(hi));
  }
  const int32_t first = sink_count(live), last = int32_t(n) - options_.window;
  order_.clear();
  for (int32_t i = first; i < last; ++i) order_.push_back(i);
  auto lower = [&](int32_t a, int32_t b) {
    return pooled_[size_t(a)] < pooled_[size_t(b)] || (pooled_[size_t(a)] == pooled_[size_t(b)] && a < b);
  };
  std::nth_element(order_.begin(), order_.begin() + (count - 1), order_.end(), lower);
  for (int32_t i = 0; i < count; ++i) out.push_back(live[size_t(order_[size_t(i)])].slot);
}

}  // namespace kvserve
