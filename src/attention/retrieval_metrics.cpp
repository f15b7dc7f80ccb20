#include "attention/retrieval_metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {

std::vector<int64_t> exact_top_k(const float* keys, int64_t n, int head_dim, const float* q, int k) {
  if (k < 1 || k > n) fail("exact top-k: k = {} must be in [1, {}] (the number of keys)", k, n);
  std::vector<float> s(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) s[size_t(t)] = dot(q, keys + size_t(t) * size_t(head_dim), head_dim);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  const auto better = [&](int64_t a, int64_t b) { return s[size_t(a)] > s[size_t(b)] || (s[size_t(a)] == s[size_t(b)] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
  ids.resize(size_t(k));
  return ids;
}

double recall(std::span<const int64_t> exact, std::span<const KeyRange> selected) {
  if (exact.empty()) return 1.0;
  size_t hits = 0;
  for (int64_t id : exact) {
    // The first range ending after id; it covers id when it begins at or before it.
    auto it = std::upper_bound(selected.begin(), selected.end(), id,
                               [](int64_t x, const KeyRange& r) { return x < r.end; });
    if (it != selected.end() && it->begin <= id) ++hits;
  }
  return double(hits) / double(exact.size());
}

double recall(std::span<const int64_t> exact, std::span<const int64_t> found) {
  if (exact.empty()) return 1.0;
  std::vector<int64_t> sorted(found.begin(), found.end());
  std::sort(sorted.begin(), sorted.end());
  size_t hits = 0;
  for (int64_t id : exact) hits += std::binary_search(sorted.begin(), sorted.end(), id) ? 1 : 0;
  return double(hits) / double(exact.size());
}

double relative_error(const float* out, const float* ref, size_t n) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

}  // namespace kvserve
