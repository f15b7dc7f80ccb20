#include "attention/h2o_policy.h"

#include <algorithm>

namespace kvserve {

H2oPolicy::H2oPolicy(const SparsityOptions& options, const KvCache& cache) : EvictingPolicy(options, cache) {
  track(&score_);
}

void H2oPolicy::observe(int layer, int kv_head, const float* weights, int32_t n_ctx) {
  const int row = layer * n_kv_heads_ + kv_head;
  for (int32_t s = 0; s < n_ctx; ++s) score_[at(s, row)] += weights[s];
}

void H2oPolicy::choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) {
  // Candidates: everything but the sinks and the recent window.
  const int32_t first = sink_count(live);
  const int32_t last = int32_t(live.size()) - options_.window;
  value_.assign(live.size(), 0.0f);
  order_.clear();
  for (int32_t i = first; i < last; ++i) {
    const int32_t slot = live[size_t(i)].slot;
    float v = 0;
    if (row >= 0) {
      v = score_[at(slot, row)];
    } else {
      for (int r = 0; r < rows_; ++r) v += score_[at(slot, r)];
    }
    if (options_.score == H2oScore::Mean) v /= float(newest_position_ - live[size_t(i)].position + 1);
    v *= value_weight(slot, row);
    value_[size_t(i)] = v;
    order_.push_back(i);
  }
  // The `count` lowest scores; ties go to the older token.
  auto lower = [&](int32_t a, int32_t b) { return value_[size_t(a)] < value_[size_t(b)] || (value_[size_t(a)] == value_[size_t(b)] && a < b); };
  std::nth_element(order_.begin(), order_.begin() + (count - 1), order_.end(), lower);
  for (int32_t i = 0; i < count; ++i) out.push_back(live[size_t(order_[size_t(i)])].slot);
}

}  // namespace kvserve
