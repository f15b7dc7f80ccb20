// KeyIndex back-end: faiss's IndexIVFPQ (libfaiss-dev). The first
// `train_keys` keys wait in KeyIndex's buffer (searches scan them exactly),
// then the coarse clusters and the product quantizer are trained on them (or
// the clusters on a query sample: coarse_from_queries), and every key from
// then on is only assigned and encoded — an append costs one pass over the
// centroids. A search scans the nprobe closest lists' PQ codes, so its
// scores are approximate; retrieval attention rescoring the returned keys
// exactly is what makes them usable. With L2Augment the index runs the L2
// metric on augmented keys; with InnerProduct faiss's inner-product IVF.
// Vectors are zero-padded to a multiple of pq_sub_dim channels.
#pragma once

#include <memory>

#include "attention/key_index.h"

namespace kvserve {

class IvfPqKeyIndex final : public KeyIndex {
 public:
  explicit IvfPqKeyIndex(const KeyIndexOptions& options);
  ~IvfPqKeyIndex() override;

  std::string describe() const override;

 private:
  int64_t warmup_keys() const override { return options_.ivfpq.train_keys; }
  void do_train_coarse(std::span<const float> queries, int64_t n) override;
  void do_add(const float* keys, const int64_t* ids, int64_t n) override;
  void do_search(const float* queries, int64_t m, int k, KeySearchResult& out) const override;
  void do_set_search_breadth(int breadth) override;
  size_t do_memory_bytes() const override;
  void train(const float* keys, int64_t n);

  struct Faiss;  // the faiss indexes and the query sample
  std::unique_ptr<Faiss> f_;
};

}  // namespace kvserve
