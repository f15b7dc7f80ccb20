// topk (Quest): keep every token, but let each decode query read only the
// K = ceil(budget / block_size) blocks most likely to matter, chosen from
// per-block key summaries (BlockSummary: per (layer, KV head, block) the
// per-channel minimum and maximum of the keys after RoPE, an upper bound of
// q·k for every key of the block). The blocks with the largest bounds — the
// largest over the GQA group's query heads: a block is read when any head may
// want it — are read, the query's own block always. Saves reads, not memory;
// prefill reads everything. The summaries are exact floats kept beside the
// cache (2 * head_dim floats per block and KV head), whatever the KV codec.
#pragma once

#include "attention/block_summary.h"
#include "attention/sparsity_policy.h"

namespace kvserve {

class TopKPolicy final : public SparsityPolicy {
 public:
  TopKPolicy(const SparsityOptions& options, const KvCache& cache);

  std::string_view name() const override { return "topk"; }
  bool wants_kv() const override { return true; }
  bool selects_reads() const override { return true; }
  // Summarises the keys of a prefix-cache hit, which never reach on_kv.
  void begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) override;
  // Keys arrive in slot order (topk never evicts, so slot = position).
  void on_kv(int layer, int32_t slot, const float* k, const float* v) override;
  void select(int layer, int kv_head, const float* q, int group, int32_t n_ctx, ReadSet& out) const override;

 private:
  int32_t blocks_read_;  // K
  int32_t block_size_;
  size_t kv_dim_;
  std::vector<BlockSummary> summaries_;  // (layers)
};

}  // namespace kvserve
