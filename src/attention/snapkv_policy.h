// snapkv: score every token by the attention the last `observe` queries (the
// observation window) paid it, summed over them and over the GQA group,
// max-pooled over `pool` neighbouring slots so a chosen token keeps its
// neighbours (SnapKV's clustering); keep the top scores per (layer, KV head)
// plus the most recent `window` tokens (by default the observation window
// itself) and the first `sinks`.
//
// After a prefill, this is SnapKV: the prompt's KV is compressed once using
// the attention of the prompt's last queries. During decode the budget stays
// a hard cap: whenever a step pushes the sequence over it, the same scoring
// runs over the last `observe` decode queries (a sliding observation window),
// so the streaming evaluation sees the policy at a fixed memory budget.
#pragma once

#include "attention/evicting_policy.h"

namespace kvserve {

class SnapKvPolicy final : public EvictingPolicy {
 public:
  SnapKvPolicy(const SparsityOptions& options, const KvCache& cache);

  std::string_view name() const override { return "snapkv"; }
  bool wants_attention_weights() const override { return true; }
  void observe(int layer, int kv_head, const float* weights, int32_t n_ctx) override;

 protected:
  void choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) override;

 private:
  // The attention rows of the last `observe` queries of every (layer, KV
  // head): ring_[i] is (slot, row) floats, query i of the ring.
  std::vector<std::vector<float>> ring_;
  std::vector<int64_t> queries_;  // (rows) queries observed per row; the next goes to ring_[queries_ % observe]
  std::vector<float> raw_, pooled_;  // scratch: (live) scores before and after pooling
  std::vector<int32_t> order_;       // scratch: candidate indices
};

}  // namespace kvserve
