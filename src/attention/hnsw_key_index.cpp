#include "attention/hnsw_key_index.h"

#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <vector>

#include "util/error.h"

namespace kvserve {

struct HnswKeyIndex::Graph {
  int dim = 0;        // the caller's channels
  int index_dim = 0;  // channels stored in the graph (dim + 1 under L2Augment)
  MipsAugmenter augmenter;
  std::unique_ptr<hnswlib::SpaceInterface<float>> space;
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> hnsw;
  std::vector<float> row;  // (n, index_dim) augmented keys or queries of one call

  Graph(int d, int idx_d) : dim(d), index_dim(idx_d), augmenter(d, idx_d) {}
};

HnswKeyIndex::HnswKeyIndex(const KeyIndexOptions& options) : KeyIndex(options) {
  const HnswOptions& h = options.hnsw;
  if (h.m < 2 || h.ef_construction < 1 || h.ef_search < 1 || h.initial_capacity < 1 || h.norm_keys < 1)
    fail("hnsw key index: m ({}) must be >= 2 and ef_construction ({}), ef_search ({}), initial_capacity ({}), "
         "norm_keys ({}) >= 1",
         h.m, h.ef_construction, h.ef_search, h.initial_capacity, h.norm_keys);
  const bool augment = options.transform == MipsTransform::L2Augment;
  graph_ = std::make_unique<Graph>(options.dim, options.dim + (augment ? 1 : 0));
  if (augment) graph_->space = std::make_unique<hnswlib::L2Space>(size_t(graph_->index_dim));
  else graph_->space = std::make_unique<hnswlib::InnerProductSpace>(size_t(graph_->index_dim));
  graph_->hnsw = std::make_unique<hnswlib::HierarchicalNSW<float>>(
      graph_->space.get(), size_t(h.initial_capacity), size_t(h.m), size_t(h.ef_construction), size_t(h.seed));
  graph_->hnsw->setEf(size_t(h.ef_search));
}

HnswKeyIndex::~HnswKeyIndex() = default;

int64_t HnswKeyIndex::warmup_keys() const {
  return options_.transform == MipsTransform::L2Augment ? options_.hnsw.norm_keys : 1;
}

void HnswKeyIndex::do_train_coarse(std::span<const float>, int64_t) {}

void HnswKeyIndex::do_add(const float* keys, const int64_t* ids, int64_t n) {
  Graph& g = *graph_;
  const size_t needed = g.hnsw->cur_element_count + size_t(n);
  if (needed > g.hnsw->max_elements_) g.hnsw->resizeIndex(std::max(needed, 2 * g.hnsw->max_elements_));
  const float* rows = keys;
  if (options_.transform == MipsTransform::L2Augment) {
    if (!g.augmenter.ready()) g.augmenter.fit(keys, n, options_.norm_margin);
    g.row.resize(size_t(n) * size_t(g.index_dim));
    g.augmenter.keys(keys, n, g.row.data());
    rows = g.row.data();
  }
  for (int64_t t = 0; t < n; ++t)
    g.hnsw->addPoint(rows + size_t(t) * size_t(g.index_dim), hnswlib::labeltype(ids[t]));
}

void HnswKeyIndex::do_search(const float* queries, int64_t m, int k, KeySearchResult& out) const {
  const Graph& g = *graph_;
  const bool augment = options_.transform == MipsTransform::L2Augment;
  std::vector<float> q(size_t(g.index_dim));
  for (int64_t i = 0; i < m; ++i) {
    const float* qi = queries + size_t(i) * size_t(g.dim);
    float qn = 0.0f;
    for (int c = 0; c < g.dim; ++c) qn += qi[c] * qi[c];
    if (augment) g.augmenter.queries(qi, 1, q.data());
    else std::copy(qi, qi + g.dim, q.data());
    const long before = g.hnsw->metric_distance_computations.load();
    auto heap = g.hnsw->searchKnn(q.data(), size_t(k));  // worst first
    out.candidates += g.hnsw->metric_distance_computations.load() - before;
    // A graph search can come back with fewer than k keys; the rest stay id -1.
    for (int64_t j = int64_t(heap.size()) - 1; j >= 0; --j) {
      const auto [dist, label] = heap.top();
      heap.pop();
      out.ids[size_t(i) * size_t(k) + size_t(j)] = int64_t(label);
      out.scores[size_t(i) * size_t(k) + size_t(j)] = augment ? g.augmenter.inner_product(dist, qn) : 1.0f - dist;
    }
  }
}

void HnswKeyIndex::do_set_search_breadth(int breadth) {
  options_.hnsw.ef_search = breadth;
  graph_->hnsw->setEf(size_t(breadth));
}

size_t HnswKeyIndex::do_memory_bytes() const {
  const auto& h = *graph_->hnsw;
  size_t upper = 0;  // links of the upper layers, allocated per element
  for (size_t i = 0; i < h.cur_element_count; ++i)
    upper += size_t(std::max(h.element_levels_[i], 0)) * h.size_links_per_element_;
  // Base layer (links, vector, label per element, preallocated to capacity),
  // per-element level and lock, and the label map (about 4 words per entry).
  return h.max_elements_ * (h.size_data_per_element_ + sizeof(int) + sizeof(std::mutex)) + upper +
         h.label_lookup_.size() * 4 * sizeof(void*);
}

std::string HnswKeyIndex::describe() const {
  const HnswOptions& h = options_.hnsw;
  return fmt::format("hnsw(M={},efC={},ef={})/{}", h.m, h.ef_construction, h.ef_search,
                     mips_transform_name(options_.transform));
}

}  // namespace kvserve
