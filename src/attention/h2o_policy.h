// h2o (Heavy-Hitter Oracle): keep the tokens that have received the most
// attention so far, plus the most recent `window` tokens (and optionally the
// first `sinks`), within the budget. A token's score is the attention weight
// it received from every query since it arrived, summed over the GQA group's
// query heads — or that sum divided by the number of those queries (`mean`),
// which stops old tokens from winning merely by having been seen longer —
// optionally times the L1 norm of its value (`value_weighted`), and within a
// horizon (evicting_policy.h).
//
// Scope: per (layer, KV head) by default — heads attend to different tokens
// (a positional head, a head on names...), so one shared set would spend the
// budget on the union of their favourites; the count per head is the same so
// compaction frees whole blocks. `aggregate` sums the scores over all layers
// and heads and keeps one set (BENCHMARKS.md compares the two).
#pragma once

#include "attention/evicting_policy.h"

namespace kvserve {

class H2oPolicy final : public EvictingPolicy {
 public:
  H2oPolicy(const SparsityOptions& options, const KvCache& cache);

  std::string_view name() const override { return "h2o"; }
  bool wants_attention_weights() const override { return true; }
  void observe(int layer, int kv_head, const float* weights, int32_t n_ctx) override;

 protected:
  void choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) override;

 private:
  std::vector<float> score_;      // (slot, row) attention received so far
  std::vector<int32_t> order_;    // scratch: candidate indices
  std::vector<float> value_;      // scratch: candidate scores
};

}  // namespace kvserve
