// Software prefetch of one KV head's slices of the blocks an attention pass
// reads, shared by attend_kv_head and bench/attention_bench (which must hint
// exactly as decode does for its layer timings to mean anything).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kv/kv_cache.h"

namespace kvserve {

// Hints KV head kv_head's slice of a block into L2 one block ahead of its use:
// blocks of one sequence lie anywhere in the pool, so the hardware prefetchers
// cannot run ahead into the next one, and the codecs' own prefetch of the
// current block comes too late to hide the miss. Head-major layouts keep all of
// a head's codes and metadata in bytes [kv_head, kv_head + 1) * block_bytes /
// n_kv_heads (kv_codec.h); for the token-major exceptions the hint is merely
// useless. bench/attention_bench, which does the same: 1.5-2.5x faster at
// 16K context on top of the head-major layouts. The hint runs kPrefetchAhead
// blocks ahead: a quantized head slice (under 1 KB) is read faster than one
// DRAM round trip, and int4 attention at 16K measured 2.10 ms per layer one
// block ahead, 1.65 ms four ahead (1 thread; fp16 unchanged).
constexpr int32_t kPrefetchAhead = 4;
// Hints the head slices of the blocks a pass over n blocks reads
// (view_at(i): block i's view), kPrefetchAhead blocks ahead: before block j,
// blocks 0 .. kPrefetchAhead - 1 whole when j = 0, then the first half of
// block j + kPrefetchAhead and the second half of the block before it. A
// whole slice's hints at once (32 lines for an fp16 block of 16 tokens)
// overran what the core keeps in flight: FP16 decode at 16K took 0.86-0.97x
// the step time with halves (median 0.88x, ten rounds, steps alternating
// between the two in one run); int4-small's 19-line slices (32-token blocks then) did not change
// beyond the comparison's +-1.5%. The slice's size is looked up once per
// codec, not per block (a virtual call and a division; ~1% of int4-small's
// decode step at 16K).
template <class ViewAt>
class HeadSlicePrefetch {
 public:
  HeadSlicePrefetch(int kv_head, int32_t n, ViewAt view_at) : kv_head_(kv_head), n_(n), view_at_(view_at) {}
  void before(int32_t j) {
    if (j == 0)
      for (int32_t i = 0; i < std::min(kPrefetchAhead, n_); ++i) hint(i, Part::Whole);
    if (j + kPrefetchAhead < n_) hint(j + kPrefetchAhead, Part::FirstHalf);
    if (j >= 1 && j + kPrefetchAhead - 1 < n_) hint(j + kPrefetchAhead - 1, Part::SecondHalf);
  }

 private:
  enum class Part { Whole, FirstHalf, SecondHalf };
  void hint(int32_t i, Part part) {
    const KvBlockView view = view_at_(i);
    if (view.codec != codec_) {  // one codec per layer for sealed blocks, another for staging
      codec_ = view.codec;
      shared_ = codec_->shared_bytes();
      slice_ = (codec_->block_bytes() - shared_.size) / size_t(codec_->shape().n_kv_heads);
      half_ = (slice_ / 2 + 63) / 64 * 64;
    }
    const uint8_t* p = view.data + size_t(kv_head_) * slice_;
    const size_t begin = part == Part::SecondHalf ? half_ : 0, end = part == Part::FirstHalf ? half_ : slice_;
    for (size_t off = begin; off < end; off += 64) __builtin_prefetch(p + off, 0, 2);
    if (part != Part::SecondHalf)  // bytes every head reads (outlier entries), with the first half
      for (size_t off = 0; off < shared_.size; off += 64) __builtin_prefetch(view.data + shared_.offset + off, 0, 2);
  }

  int kv_head_;
  int32_t n_;
  ViewAt view_at_;
  const KvCodec* codec_ = nullptr;
  size_t slice_ = 0, half_ = 0;
  ByteSpan shared_;
};

}  // namespace kvserve
