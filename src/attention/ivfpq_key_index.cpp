#include "attention/ivfpq_key_index.h"

#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/invlists/InvertedLists.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <fmt/format.h>
#include <limits>
#include <omp.h>
#include <vector>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {

struct IvfPqKeyIndex::Faiss {
  int dim = 0;        // the caller's channels
  int index_dim = 0;  // channels in faiss: dim (+1 under L2Augment), padded to a multiple of pq_sub_dim
  MipsAugmenter augmenter;
  std::unique_ptr<faiss::IndexFlat> quantizer;  // the coarse centroids, (nlist, index_dim)
  std::unique_ptr<faiss::IndexIVFPQ> ivf;
  std::vector<float> query_sample;   // (n, dim) queries for coarse_from_queries

  Faiss(int d, int idx_d) : dim(d), index_dim(idx_d), augmenter(d, idx_d) {}

  // (n, index_dim) rows of keys or queries as faiss stores them.
  std::vector<float> rows(const float* x, int64_t n, bool keys, MipsTransform t) const {
    std::vector<float> out(size_t(n) * size_t(index_dim), 0.0f);
    if (t == MipsTransform::L2Augment) {
      if (keys) augmenter.keys(x, n, out.data());
      else augmenter.queries(x, n, out.data());
      return out;
    }
    for (int64_t i = 0; i < n; ++i)
      std::copy(x + size_t(i) * size_t(dim), x + size_t(i + 1) * size_t(dim), out.data() + size_t(i) * size_t(index_dim));
    return out;
  }
};

namespace {

// Runs f with faiss limited to `threads` OpenMP threads (an OpenMP setting of
// the calling thread, restored after), and turns faiss's exceptions into a
// kvserve::Error.
template <class F>
void faiss_call(int threads, const char* what, F&& f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  try {
    f();
  } catch (const Error&) {
    omp_set_num_threads(before);
    throw;
  } catch (const std::exception& e) {
    omp_set_num_threads(before);
    fail("ivfpq key index: faiss failed to {}: {}", what, e.what());
  }
  omp_set_num_threads(before);
}

}  // namespace

IvfPqKeyIndex::IvfPqKeyIndex(const KeyIndexOptions& options) : KeyIndex(options) {
  const IvfPqOptions& o = options.ivfpq;
  if (o.nlist < 1 || o.nprobe < 1 || o.pq_sub_dim < 1 || o.threads < 1 || o.pq_bits < 1 || o.pq_bits > 16)
    fail("ivfpq key index: nlist ({}), nprobe ({}), pq_sub_dim ({}) and threads ({}) must be >= 1 and pq_bits ({}) "
         "in [1, 16]",
         o.nlist, o.nprobe, o.pq_sub_dim, o.threads, o.pq_bits);
  const int64_t needed = std::max<int64_t>(o.nlist, int64_t(1) << o.pq_bits);
  if (o.train_keys < needed)
    fail("ivfpq key index: train_keys {} is fewer than the {} centroids to train (nlist {}, 2^pq_bits {})",
         o.train_keys, needed, o.nlist, int64_t(1) << o.pq_bits);
  const bool augment = options.transform == MipsTransform::L2Augment;
  const int raw = options.dim + (augment ? 1 : 0);
  f_ = std::make_unique<Faiss>(options.dim, (raw + o.pq_sub_dim - 1) / o.pq_sub_dim * o.pq_sub_dim);
  const faiss::MetricType metric = augment ? faiss::METRIC_L2 : faiss::METRIC_INNER_PRODUCT;
  f_->quantizer = std::make_unique<faiss::IndexFlat>(f_->index_dim, metric);
  faiss_call(o.threads, "build the index", [&] {
    f_->ivf = std::make_unique<faiss::IndexIVFPQ>(f_->quantizer.get(), size_t(f_->index_dim), size_t(o.nlist),
                                                  size_t(f_->index_dim / o.pq_sub_dim), size_t(o.pq_bits), metric);
  });
  f_->ivf->nprobe = size_t(o.nprobe);
}

IvfPqKeyIndex::~IvfPqKeyIndex() = default;

void IvfPqKeyIndex::do_train_coarse(std::span<const float> queries, int64_t n) {
  if (!options_.ivfpq.coarse_from_queries) return;
  if (built()) fail("ivfpq key index: already trained; give training queries before the first {} keys",
                      options_.ivfpq.train_keys);
  f_->query_sample.insert(f_->query_sample.end(), queries.begin(), queries.end());
}

void IvfPqKeyIndex::do_add(const float* keys, const int64_t* ids, int64_t n) {
  Faiss& f = *f_;
  if (!f.ivf->is_trained) train(keys, n);
  const std::vector<float> rows = f.rows(keys, n, true, options_.transform);
  faiss_call(options_.ivfpq.threads, "add keys", [&] { f.ivf->add_with_ids(n, rows.data(), ids); });
}

void IvfPqKeyIndex::train(const float* keys, int64_t n) {
  Faiss& f = *f_;
  const int threads = options_.ivfpq.threads;
  if (options_.transform == MipsTransform::L2Augment) f.augmenter.fit(keys, n, options_.norm_margin);
  if (options_.ivfpq.coarse_from_queries) {
    const int64_t nq = int64_t(f.query_sample.size() / size_t(f.dim));
    if (nq < options_.ivfpq.nlist)
      fail("ivfpq key index: coarse_from_queries needs at least nlist = {} training queries (train_coarse gave {})",
           options_.ivfpq.nlist, nq);
    const std::vector<float> q = f.rows(f.query_sample.data(), nq, false, options_.transform);
    faiss_call(threads, "cluster the queries", [&] {
      faiss::Clustering clustering(f.index_dim, options_.ivfpq.nlist);
      clustering.train(nq, q.data(), *f.quantizer);  // leaves the centroids in the quantizer
    });
    std::vector<float>().swap(f.query_sample);
  }
  // With trained centroids already in the quantizer, faiss trains only the
  // product quantizer (on the keys' residuals).
  const std::vector<float> rows = f.rows(keys, n, true, options_.transform);
  faiss_call(threads, "train", [&] { f.ivf->train(n, rows.data()); });
}

void IvfPqKeyIndex::do_search(const float* queries, int64_t m, int k, KeySearchResult& out) const {
  const Faiss& f = *f_;
  const std::vector<float> rows = f.rows(queries, m, false, options_.transform);
  std::vector<float> dist(size_t(m) * size_t(k));
  std::vector<faiss::Index::idx_t> labels(size_t(m) * size_t(k));
  const size_t before = faiss::indexIVF_stats.ndis;
  faiss_call(options_.ivfpq.threads, "search", [&] { f.ivf->search(m, rows.data(), k, dist.data(), labels.data()); });
  out.candidates = int64_t(faiss::indexIVF_stats.ndis - before);
  const bool augment = options_.transform == MipsTransform::L2Augment;
  for (int64_t i = 0; i < m; ++i) {
    const float qn = dot(queries + size_t(i) * size_t(f.dim), queries + size_t(i) * size_t(f.dim), f.dim);
    for (int j = 0; j < k; ++j) {
      const size_t at = size_t(i) * size_t(k) + size_t(j);
      // Fewer than k keys in the probed lists: faiss pads with -1.
      out.ids[at] = int64_t(labels[at]);
      if (labels[at] < 0) out.scores[at] = -std::numeric_limits<float>::infinity();
      else out.scores[at] = augment ? f.augmenter.inner_product(dist[at], qn) : dist[at];
    }
  }
}

void IvfPqKeyIndex::do_set_search_breadth(int breadth) {
  options_.ivfpq.nprobe = breadth;
  f_->ivf->nprobe = size_t(breadth);
}

size_t IvfPqKeyIndex::do_memory_bytes() const {
  const Faiss& f = *f_;
  size_t bytes = f.query_sample.capacity() * sizeof(float);
  bytes += f.quantizer->codes.size();                      // centroids
  bytes += f.ivf->pq.centroids.size() * sizeof(float);     // PQ codebooks
  bytes += f.ivf->precomputed_table.size() * sizeof(float);  // per-list distance tables (L2 only)
  if (const auto* lists = dynamic_cast<const faiss::ArrayInvertedLists*>(f.ivf->invlists))
    for (size_t l = 0; l < lists->nlist; ++l)
      bytes += lists->codes[l].capacity() + lists->ids[l].capacity() * sizeof(faiss::Index::idx_t);
  return bytes;
}

std::string IvfPqKeyIndex::describe() const {
  const IvfPqOptions& o = options_.ivfpq;
  return fmt::format("ivfpq(nlist={},nprobe={},pq={}x{}b,train={}{})/{}", o.nlist, o.nprobe,
                     f_->index_dim / o.pq_sub_dim, o.pq_bits, o.train_keys,
                     o.coarse_from_queries ? ",coarse=queries" : "", mips_transform_name(options_.transform));
}

}  // namespace kvserve
