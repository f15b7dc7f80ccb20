// Queries rotated back to the first position of each RoPE span of a block,
// for keys stored within spans (KvCodecConfig::rope_span), shared by decode
// (attend_kv_head) and prefill tiles (attend_kv_head_tile).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/rope_table.h"

namespace kvserve {

// Span s of a block starting at position `first` takes the queries rotated
// back to p = first + s * span, in two steps: to p's multiple of kCoarse
// (kept while blocks stay under it), then by the rest, under kCoarse + a
// block. Both read rope rows the blocks share, which stay in cache; one row
// per block at its own position missed it (rotate_back 8-9% of
// int2-small's step at 16K). (Positions stay below the rope table's size:
// the context-length check; sinks keep them under budget + a block.)
class SpanQueries {
 public:
  static constexpr int32_t kCoarse = 1024;
  // q: (n_q, head_dim) queries; coarse: (n_q, head_dim) scratch for them
  // rotated back to a multiple of kCoarse.
  // rope: null where no layer keeps keys before RoPE (then rotate is never called).
  SpanQueries(const RopeTable* rope, const float* q, int n_q, int head_dim, float* coarse)
      : rope_(rope), q_(q), n_q_(n_q), head_dim_(head_dim), coarse_(coarse) {}

  // Queries [r0, r0 + nr) for the n tokens of the block at `first`, in spans
  // of `span`, into out: (spans, nr, head_dim), span s at s * nr * head_dim.
  void rotate(int32_t first, int n, int span, int r0, int nr, float* out) {
    const int32_t coarse = first / kCoarse * kCoarse;
    if (coarse != coarse_pos_) {
      rope_->rotate_back(q_, n_q_, coarse, coarse_);
      coarse_pos_ = coarse;
    }
    const size_t set = size_t(nr) * size_t(head_dim_);
    for (int s0 = 0; s0 < n; s0 += span)
      rope_->rotate_back(coarse_ + size_t(r0) * head_dim_, nr, first - coarse + s0, out + size_t(s0 / span) * set);
  }

 private:
  const RopeTable* rope_;
  const float* q_;
  int n_q_, head_dim_;
  float* coarse_;
  int32_t coarse_pos_ = -1;  // what coarse_ holds the queries rotated back by
};

}  // namespace kvserve
