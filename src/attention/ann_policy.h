// ann (retrieval attention): keep every token; index each (layer, KV head)'s
// keys (after RoPE) in an approximate-nearest-neighbour KeyIndex (HNSW from
// hnswlib or IVF-PQ from faiss, key_index.h) and let each decode query attend
// exactly to the first `sinks` tokens, the last `window` tokens and the keys
// the index returns for it, `budget` tokens in all. The GQA group's query
// heads search together: the union of their answers, ranked by the best
// score any head gave, keeps the budget exact.
//
// Queries and keys come from different distributions and attention wants the
// largest q·k, not the nearest key: by default the index poses inner-product
// search as L2 search over keys augmented with sqrt(M² − |k|²) (queries with
// 0), which both back-ends answer well (BENCHMARKS.md, attention benchmark);
// `ip` uses the back-end's own inner-product metric instead.
//
// Candidates are ranked by the back-end's scores: exact q·k for HNSW (it
// keeps the vectors), product-quantized estimates for a trained IVF-PQ (no
// rescoring against the cache's keys yet).
//
// Saves reads, not memory; the paged kernel reads the blocks holding the
// chosen keys and gives weight only to those keys, so kv_read_fraction
// counts keys, not bytes (the attention benchmark times the raw retrieval).
// Prefill reads everything. Until a back-end has enough keys to build
// (HNSW: 256, IVF-PQ: 10240 by default) its searches scan the keys exactly.
#pragma once

#include <memory>

#include "attention/key_index.h"
#include "attention/sparsity_policy.h"

namespace kvserve {

class AnnPolicy final : public SparsityPolicy {
 public:
  AnnPolicy(const SparsityOptions& options, const KvCache& cache);

  std::string_view name() const override { return "ann"; }
  bool wants_kv() const override { return true; }
  bool selects_reads() const override { return true; }
  // Indexes the keys of a prefix-cache hit, which never reach on_kv.
  void begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) override;
  // Keys arrive in slot order (ann never evicts, so slot = position).
  void on_kv(int layer, int32_t slot, const float* k, const float* v) override;
  void select(int layer, int kv_head, const float* q, int group, int32_t n_ctx, ReadSet& out) const override;

  // Total build (train + add) time of the indexes so far, in seconds.
  double build_seconds() const;

 private:
  SparsityOptions options_;
  int n_kv_heads_, head_dim_;
  int32_t block_size_;
  std::vector<std::unique_ptr<KeyIndex>> indexes_;  // (layer, KV head)
  int32_t keys_indexed_ = 0;                        // slots [0, keys_indexed_) are in the indexes
};

}  // namespace kvserve
