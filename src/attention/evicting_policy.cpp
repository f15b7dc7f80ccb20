#include "attention/evicting_policy.h"

#include <cassert>
#include <cmath>

namespace kvserve {

EvictingPolicy::EvictingPolicy(const SparsityOptions& options, const KvCache& cache)
    : options_(options),
      n_layers_(cache.n_layers()),
      n_kv_heads_(cache.k_codec(0).shape().n_kv_heads),
      head_dim_(cache.k_codec(0).shape().head_dim),
      rows_(n_layers_ * n_kv_heads_),
      block_size_(cache.block_size()),
      positions_in_cache_(options.positions == SparsityPositions::Cache) {
  if (options.value_weighted) track(&value_norm_);
}

void EvictingPolicy::on_kv(int layer, int32_t slot, const float* k, const float* v) {
  for (int h = 0; h < n_kv_heads_; ++h) {
    float norm = 0;
    for (int d = 0; d < head_dim_; ++d) norm += std::fabs(v[h * head_dim_ + d]);
    value_norm_[at(slot, layer * n_kv_heads_ + h)] = norm;
  }
}

float EvictingPolicy::value_weight(int32_t slot, int row) const {
  if (!options_.value_weighted) return 1.0f;
  if (row >= 0) return value_norm_[at(slot, row)];
  float norm = 0;
  for (int r = 0; r < rows_; ++r) norm += value_norm_[at(slot, r)];
  return norm;
}

void EvictingPolicy::begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) {
  if (table.num_tokens == 0 && table.evicted == 0) table.positions_in_cache = positions_in_cache_;
  const size_t need = size_t(table.num_tokens + n_new) * size_t(rows_);
  for (std::vector<float>* state : tracked_)
    if (state->size() < need) state->resize(need, 0.0f);
}

int32_t EvictingPolicy::sink_count(std::span<const LiveToken> live) const {
  int32_t n = 0;
  while (n < int32_t(live.size()) && live[size_t(n)].position < options_.sinks) ++n;
  return n;
}

void EvictingPolicy::after_forward(KvCache& cache, BlockTable& table, int32_t n_new) {
  ++stats_.forward_passes;
  newest_position_ = table.position_of_new(table.num_tokens) - 1;
  const int32_t excess = table.live_tokens() - options_.budget;
  if (excess > 0) {
    chosen_.clear();
    auto collect = [&](int row) {
      live_.clear();
      for (int32_t s = 0; s < table.num_tokens; ++s) {
        const int32_t p = cache.slot_position(table, row / n_kv_heads_, row % n_kv_heads_, s);
        if (p >= 0) live_.push_back({s, p});
      }
    };
    if (aggregated()) {
      collect(0);  // every row holds the same slots
      choose_row(-1, excess);
      assert(chosen_.size() == size_t(excess));
      for (int r = 1; r < rows_; ++r) chosen_.insert(chosen_.end(), chosen_.begin(), chosen_.begin() + excess);
    } else {
      for (int r = 0; r < rows_; ++r) {
        collect(r);
        choose_row(r, excess);
        assert(chosen_.size() == size_t(r + 1) * size_t(excess));
      }
    }
    cache.evict(table, chosen_, excess);
    stats_.tokens_evicted += excess;
  }
  if (table.dead < compaction_slack(options_, block_size_)) return;
  const std::vector<int32_t> before = table.slot_positions;  // (slot, row) positions, -1 = evicted
  if (!cache.compact(table)) return;  // shared blocks and no free block: the slots stay masked
  ++stats_.compactions;
  // Move every tracked score with its token: the same stable gather as the cache's.
  const int32_t n_old = int32_t(before.size() / size_t(rows_));
  for (int r = 0; r < rows_; ++r) {
    int32_t j = 0;
    for (int32_t s = 0; s < n_old; ++s) {
      if (before[at(s, r)] < 0) continue;
      for (std::vector<float>* state : tracked_) (*state)[at(j, r)] = (*state)[at(s, r)];
      ++j;
    }
  }
  for (std::vector<float>* state : tracked_) state->resize(size_t(table.num_tokens) * size_t(rows_));
}

void EvictingPolicy::choose_row(int row, int32_t count) {
  if (options_.horizon <= 0) {
    choose(row, live_, count, chosen_);
    return;
  }
  near_.clear();
  for (const LiveToken& t : live_) {
    const bool far = newest_position_ - t.position >= options_.horizon && t.position >= options_.sinks;
    if (far && count > 0) {
      chosen_.push_back(t.slot);  // live_ is oldest first
      --count;
    } else {
      near_.push_back(t);
    }
  }
  if (count > 0) choose(row, near_, count, chosen_);
}

}  // namespace kvserve
