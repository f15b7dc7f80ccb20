// How close a sparse attention step comes to full attention: the exact top-k
// keys by q·k, the recall of a selected key set against them, and the
// relative error of an attention output. Used by tests and the attention
// benchmark (kvserve bench --attention-only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "attention/sparse_attention.h"

namespace kvserve {

// The ids of the k keys with the largest q·k, best first (ties: the lower id).
//   keys: (n, head_dim) floats; q: head_dim floats
// Throws kvserve::Error when k is not in [1, n].
[[nodiscard]] std::vector<int64_t> exact_top_k(const float* keys, int64_t n, int head_dim, const float* q, int k);

// The fraction of `exact` ids (e.g. exact_top_k's) that the selected ranges
// cover. 1 when exact is empty.
[[nodiscard]] double recall(std::span<const int64_t> exact, std::span<const KeyRange> selected);
// The fraction of `exact` ids found among `found` (any order).
[[nodiscard]] double recall(std::span<const int64_t> exact, std::span<const int64_t> found);

// ||out - ref|| / ||ref|| over n floats (0 when both are zero).
[[nodiscard]] double relative_error(const float* out, const float* ref, size_t n);

}  // namespace kvserve
