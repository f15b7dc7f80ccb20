#include "attention/key_index.h"

#include <algorithm>
#include <cmath>

#include "attention/hnsw_key_index.h"
#include "attention/ivfpq_key_index.h"
#include "attention/retrieval_metrics.h"
#include "kernels/vector_ops.h"
#include "util/error.h"
#include "util/timer.h"

namespace kvserve {

std::string_view key_index_backend_name(KeyIndexBackend b) {
  return b == KeyIndexBackend::Hnsw ? "hnsw" : "ivfpq";
}

std::string_view mips_transform_name(MipsTransform t) {
  return t == MipsTransform::InnerProduct ? "ip" : "l2aug";
}

KeyIndexBackend parse_key_index_backend(std::string_view name) {
  if (name == "hnsw") return KeyIndexBackend::Hnsw;
  if (name == "ivfpq") return KeyIndexBackend::IvfPq;
  fail("unknown key index back-end '{}' (expected hnsw or ivfpq)", name);
}

MipsTransform parse_mips_transform(std::string_view name) {
  if (name == "ip") return MipsTransform::InnerProduct;
  if (name == "l2aug") return MipsTransform::L2Augment;
  fail("unknown MIPS transform '{}' (expected ip or l2aug)", name);
}

namespace {

// Rows of dim floats in a span, or an error naming the mismatch.
int64_t rows_of(std::span<const float> x, int dim, const char* what) {
  if (x.size() % size_t(dim) != 0)
    fail("key index: {} hold {} floats, not whole rows of dim {}", what, x.size(), dim);
  return int64_t(x.size() / size_t(dim));
}

}  // namespace

void KeyIndex::train_coarse(std::span<const float> queries) {
  const int64_t n = rows_of(queries, dim(), "training queries");
  Timer timer;
  do_train_coarse(queries, n);
  build_seconds_ += timer.seconds();
}

void KeyIndex::add(std::span<const float> keys, std::span<const int64_t> ids) {
  const int64_t n = rows_of(keys, dim(), "keys");
  if (size_t(n) != ids.size()) fail("key index: {} keys but {} ids", n, ids.size());
  for (int64_t id : ids)
    if (id < 0) fail("key index: key id {} is negative", id);
  if (n == 0) return;
  Timer timer;
  if (built_) {
    do_add(keys.data(), ids.data(), n);
  } else {
    const size_t old_keys = pending_.size(), old_ids = pending_ids_.size();
    pending_.insert(pending_.end(), keys.begin(), keys.end());
    pending_ids_.insert(pending_ids_.end(), ids.begin(), ids.end());
    if (int64_t(pending_ids_.size()) >= warmup_keys()) {
      try {
        do_add(pending_.data(), pending_ids_.data(), int64_t(pending_ids_.size()));
      } catch (...) {
        // A failed build (e.g. training queries missing) leaves the index as it was.
        pending_.resize(old_keys);
        pending_ids_.resize(old_ids);
        throw;
      }
      built_ = true;
      std::vector<float>().swap(pending_);
      std::vector<int64_t>().swap(pending_ids_);
    }
  }
  size_ += n;
  build_seconds_ += timer.seconds();
}

void KeyIndex::search_buffer(const float* queries, int64_t m, int k, KeySearchResult& out) const {
  const int d = dim();
  const int64_t n = int64_t(pending_ids_.size());
  for (int64_t i = 0; i < m; ++i) {
    const float* qi = queries + size_t(i) * size_t(d);
    const std::vector<int64_t> top = exact_top_k(pending_.data(), n, d, qi, k);
    for (int j = 0; j < k; ++j) {
      const size_t at = size_t(i) * size_t(k) + size_t(j), t = size_t(top[size_t(j)]);
      out.ids[at] = pending_ids_[t];
      out.scores[at] = dot(qi, pending_.data() + t * size_t(d), d);
    }
  }
  out.candidates = n * m;
}

size_t KeyIndex::memory_bytes() const {
  return do_memory_bytes() + pending_.capacity() * sizeof(float) + pending_ids_.capacity() * sizeof(int64_t);
}

void KeyIndex::search(std::span<const float> queries, int k, KeySearchResult& out) const {
  const int64_t m = rows_of(queries, dim(), "queries");
  if (size_ == 0) fail("key index: search on an empty index (add keys first)");
  if (k < 1 || k > size_) fail("key index: k = {} must be in [1, {}] (the keys in the index)", k, size_);
  out.queries = m;
  out.k = k;
  out.ids.assign(size_t(m) * size_t(k), -1);
  out.scores.assign(size_t(m) * size_t(k), 0.0f);
  out.candidates = 0;
  if (m == 0) return;
  if (built_) do_search(queries.data(), m, k, out);
  else search_buffer(queries.data(), m, k, out);
}

KeySearchResult KeyIndex::search(std::span<const float> queries, int k) const {
  KeySearchResult out;
  search(queries, k, out);
  return out;
}

void KeyIndex::set_search_breadth(int breadth) {
  if (breadth < 1) fail("key index: search breadth {} must be at least 1", breadth);
  do_set_search_breadth(breadth);
}

std::unique_ptr<KeyIndex> make_key_index(const KeyIndexOptions& o) {
  if (o.dim < 1) fail("key index: dim {} must be positive", o.dim);
  if (o.transform == MipsTransform::L2Augment && !(o.norm_margin >= 1.0f))
    fail("key index: norm_margin {} must be >= 1", o.norm_margin);
  if (o.backend == KeyIndexBackend::Hnsw) return std::make_unique<HnswKeyIndex>(o);
  return std::make_unique<IvfPqKeyIndex>(o);
}

void MipsAugmenter::fit(const float* keys, int64_t n, float margin) {
  float largest = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    float s = 0.0f;
    for (int c = 0; c < dim_; ++c) s += keys[size_t(t) * size_t(dim_) + size_t(c)] * keys[size_t(t) * size_t(dim_) + size_t(c)];
    largest = std::max(largest, std::sqrt(s));
  }
  // All-zero keys still need a positive M to mark the augmenter as fitted.
  max_norm_ = std::max(largest * margin, 1e-20f);
}

void MipsAugmenter::keys(const float* keys, int64_t n, float* out) const {
  const float m2 = max_norm_ * max_norm_;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + size_t(t) * size_t(dim_);
    float* o = out + size_t(t) * size_t(out_dim_);
    float s = 0.0f;
    for (int c = 0; c < dim_; ++c) {
      o[c] = k[c];
      s += k[c] * k[c];
    }
    o[dim_] = std::sqrt(std::max(m2 - s, 0.0f));
    std::fill(o + dim_ + 1, o + out_dim_, 0.0f);
  }
}

void MipsAugmenter::queries(const float* queries, int64_t n, float* out) const {
  for (int64_t t = 0; t < n; ++t) {
    std::copy(queries + size_t(t) * size_t(dim_), queries + size_t(t + 1) * size_t(dim_), out + size_t(t) * size_t(out_dim_));
    std::fill(out + size_t(t) * size_t(out_dim_) + dim_, out + size_t(t + 1) * size_t(out_dim_), 0.0f);
  }
}

}  // namespace kvserve
