// KeyIndex back-end: an HNSW graph from hnswlib (libhnswlib-dev). Keys are
// inserted one by one into the graph, so appends cost the same at any size
// (about ef_construction distance evaluations each); capacity doubles when
// full. With MipsTransform::InnerProduct it searches hnswlib's
// InnerProductSpace (1 − q·k, not a metric: graph quality suffers for
// out-of-distribution queries); with L2Augment it searches the L2Space of
// keys augmented to equal norm, M fitted to the first norm_keys keys. hnswlib stays behind this file (its header
// defines non-inline functions, so only one translation unit includes it).
#pragma once

#include <memory>

#include "attention/key_index.h"

namespace kvserve {

class HnswKeyIndex final : public KeyIndex {
 public:
  explicit HnswKeyIndex(const KeyIndexOptions& options);
  ~HnswKeyIndex() override;

  std::string describe() const override;

 private:
  int64_t warmup_keys() const override;
  size_t do_memory_bytes() const override;
  void do_train_coarse(std::span<const float> queries, int64_t n) override;
  void do_add(const float* keys, const int64_t* ids, int64_t n) override;
  void do_search(const float* queries, int64_t m, int k, KeySearchResult& out) const override;
  void do_set_search_breadth(int breadth) override;

  struct Graph;  // the hnswlib space and graph
  std::unique_ptr<Graph> graph_;
};

}  // namespace kvserve
