// topk (Quest): keep every token, but let each decode query read only the
// K = ceil(budget / block_size) blocks most likely to matter, chosen from
// per-block key summaries: for every (layer, KV head, block) the per-channel
// minimum and maximum of its keys (after RoPE). For query q,
// sum_c max(q_c * min_c, q_c * max_c) bounds q·k from above for every key of
// the block; the blocks with the largest bounds (the largest over the GQA
// group's query heads: a block is read when any head may want it) are read,
// the query's own block always. Saves reads, not memory; prefill reads
// everything. The summaries are exact floats kept beside the cache
// (2 * head_dim floats per block and KV head), whatever the KV codec.
#pragma once

#include "attention/sparsity_policy.h"

namespace kvserve {

class TopKPolicy final : public SparsityPolicy {
 public:
  TopKPolicy(const SparsityOptions& options, const KvCache& cache);

  std::string_view name() const override { return "topk"; }
  bool wants_kv() const override { return true; }
  bool selects_reads() const override { return true; }
  void on_kv(int layer, int32_t slot, const float* k, const float* v) override;
  void select(int layer, int kv_head, const float* q, int group, int32_t n_ctx,
              std::vector<int32_t>& blocks) const override;

  // The upper bound of q·k over block b's keys for query head q (head_dim floats).
  float upper_bound(int layer, int kv_head, int32_t block, const float* q) const;

 private:
  int32_t blocks_read_;  // K
  int n_kv_heads_, head_dim_;
  int32_t block_size_;
  // Per (layer, KV head): (block, 2, head_dim) floats — the minimum row, then the maximum row.
  std::vector<std::vector<float>> summaries_;
};

}  // namespace kvserve
