// The shared mechanics of policies that drop tokens (window, sinks, h2o,
// snapkv): after every forward pass, each (layer, KV head) row holding more
// than `budget` live tokens evicts the excess, chosen by the strategy; once
// `compact_slack` evicted slots accumulate, KvCache::compact moves them out
// and frees blocks. Evicted slots are skipped by attention at once, so the
// keep set is exact at every step while compaction runs once per block.
//
// With a horizon (h2o, snapkv), tokens further back than `horizon` positions
// go first, oldest first, and the strategy chooses among the rest: the
// strategy's scores then decide only within the recent past.
//
// Strategies keep per-slot scores in arrays registered with track(); the
// base class grows them as tokens arrive and moves their entries along with
// the tokens when the cache compacts, so a score stays with its token.
#pragma once

#include <span>
#include <vector>

#include "attention/sparsity_policy.h"

namespace kvserve {

// A live token of one (layer, KV head) row.
struct LiveToken {
  int32_t slot;
  int32_t position;
};

class EvictingPolicy : public SparsityPolicy {
 public:
  // options: resolved by make_sparsity_policy (budget > sinks + window...).
  EvictingPolicy(const SparsityOptions& options, const KvCache& cache);

  bool evicts() const override { return true; }
  bool wants_kv() const override { return options_.value_weighted; }
  void on_kv(int layer, int32_t slot, const float* k, const float* v) override;
  void begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) override;
  void after_forward(KvCache& cache, BlockTable& table, int32_t n_new) override;

  const SparsityOptions& options() const { return options_; }

 protected:
  // Chooses `count` tokens of `live` (one row's live tokens in slot order,
  // which is position order) to evict and appends their slots to `out`.
  // row = layer * n_kv_heads + kv_head, or -1 when the policy's keep set is
  // shared by all rows (aggregated()): every row then holds the same slots.
  // REQUIRES: count <= live.size() - sinks - window.
  virtual void choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) = 0;
  // Whether one keep set serves every row.
  virtual bool aggregated() const { return options_.scope == SparsityScope::Aggregate; }
  // Registers a per-slot array, (slot, row) floats, kept aligned with the
  // slots; new slots start at 0.
  void track(std::vector<float>* state) { tracked_.push_back(state); }

  // Index of (slot, row) in tracked arrays.
  size_t at(int32_t slot, int row) const { return size_t(slot) * size_t(rows_) + size_t(row); }
  // How many of `live` (sorted by position) are protected sinks: positions < sinks.
  int32_t sink_count(std::span<const LiveToken> live) const;
  // The weight of a token's attention score: the L1 norm of its value in
  // `row` (or summed over rows for row -1) when value_weighted, else 1.
  float value_weight(int32_t slot, int row) const;

  SparsityOptions options_;
  int n_layers_, n_kv_heads_, head_dim_, rows_;
  int32_t block_size_;
  bool positions_in_cache_;
  int32_t newest_position_ = -1;  // position of the newest token of the sequence

 private:
  std::vector<std::vector<float>*> tracked_;
  std::vector<float> value_norm_;  // (slot, row) L1 norm of the token's value, when value_weighted
  // Appends to chosen_ the `count` tokens of live_ to evict: past the
  // horizon first, then the strategy's choice among the others.
  void choose_row(int row, int32_t count);

  std::vector<LiveToken> live_;   // scratch: one row's live tokens
  std::vector<LiveToken> near_;   // scratch: the sinks and tokens within the horizon
  std::vector<int32_t> chosen_;   // scratch: (rows, count) slots to evict
};

}  // namespace kvserve
