// Exact softmax attention over a chosen subset of one (layer, KV head)'s
// keys: the read-time sparsity of Quest (whole blocks chosen from key
// summaries) and of retrieval attention (keys an index returned, plus
// attention sinks and a recent window). The softmax runs over the selected
// keys only — the keys left out get weight zero, and the rest are
// renormalised among themselves — so with every key selected the result is
// full attention.
//
// A subset is a sorted list of disjoint key ranges: blocks, sinks and windows
// are long runs that the kernel reads as contiguous memory; retrieved keys are
// runs of length one. Raw float arrays only (no KV cache types), so the
// routine serves any caller that can point at one head's keys and values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvserve {

// Keys [begin, end) of one head, in tokens.
struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const KeyRange&) const = default;
};

// One (layer, KV head)'s keys and values, token-major.
struct HeadKv {
  const float* keys = nullptr;    // (n, head_dim)
  const float* values = nullptr;  // (n, head_dim)
  int64_t n = 0;                  // keys held, in tokens
  int head_dim = 0;
};

// Scratch reused across calls (one per thread).
struct SparseAttentionScratch {
  std::vector<float> scores;  // (group, selected keys rounded up to 16)
};

// The attention output of the `group` query heads sharing this KV head over
// the selected keys:
//   out_i = sum_{t in ranges} softmax_t(scale * q_i·k_t) * v_t
//   q:   (group, head_dim) floats
//   out: (group, head_dim) floats, overwritten
// Ranges must be sorted, disjoint, non-empty and within [0, kv.n); at least
// one is required. Throws kvserve::Error otherwise. AVX-512 when available.
void attend_ranges(const HeadKv& kv, const float* q, int group, float scale, std::span<const KeyRange> ranges,
                   float* out, SparseAttentionScratch& scratch);
// Scalar reference of attend_ranges in double precision (same shapes).
void attend_ranges_reference(const HeadKv& kv, const float* q, int group, float scale,
                             std::span<const KeyRange> ranges, float* out);

// The keys a retrieval step attends to: the first `sinks` keys, the last
// `window` keys and the retrieved ids (any order, duplicates allowed, e.g.
// the union of a GQA group's searches), as sorted disjoint ranges of [0, n).
// Ids of -1 (a search that found fewer than k keys pads with them) are
// skipped. Throws kvserve::Error for another id outside [0, n) or a negative
// count.
[[nodiscard]] std::vector<KeyRange> retrieval_ranges(std::span<const int64_t> ids, int64_t n, int64_t sinks,
                                                     int64_t window);
// The keys of the chosen blocks (ascending, as BlockSummary::select returns
// them) plus sinks and window, as sorted disjoint ranges of [0, n).
[[nodiscard]] std::vector<KeyRange> block_ranges(std::span<const int32_t> blocks, int block_size, int64_t n,
                                                 int64_t sinks, int64_t window);
// Total keys covered by the ranges, in tokens.
int64_t ranges_size(std::span<const KeyRange> ranges);

}  // namespace kvserve
