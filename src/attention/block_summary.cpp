#include "attention/block_summary.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kv/attention_simd.h"
#include "util/error.h"

namespace kvserve {

BlockSummary::BlockSummary(const BlockSummaryOptions& options) : options_(options) {
  if (options.block_size < 1 || options.n_kv_heads < 1 || options.head_dim < 1)
    fail("block summary: block_size ({}), n_kv_heads ({}) and head_dim ({}) must be positive", options.block_size,
         options.n_kv_heads, options.head_dim);
  bounds_.resize(size_t(options.n_kv_heads));
}

void BlockSummary::append(std::span<const float> keys) {
  const int d = options_.head_dim, heads = options_.n_kv_heads;
  const size_t kv_dim = size_t(heads) * size_t(d);
  if (keys.size() % kv_dim != 0)
    fail("block summary: {} key floats are not whole rows of n_kv_heads * head_dim = {}", keys.size(), kv_dim);
  const int64_t n = int64_t(keys.size() / kv_dim);
  for (int64_t t = 0; t < n; ++t, ++num_tokens_) {
    const bool opens_block = num_tokens_ % options_.block_size == 0;
    const int64_t block = num_tokens_ / options_.block_size;
    for (int h = 0; h < heads; ++h) {
      const float* k = keys.data() + size_t(t) * kv_dim + size_t(h) * size_t(d);
      std::vector<float>& rows = bounds_[size_t(h)];
      if (opens_block) {
        // A block's first key is both its minimum and its maximum.
        rows.insert(rows.end(), k, k + d);
        rows.insert(rows.end(), k, k + d);
        continue;
      }
      float* mn = rows.data() + size_t(block) * 2 * size_t(d);
      float* mx = mn + d;
      for (int c = 0; c < d; ++c) {
        mn[c] = std::min(mn[c], k[c]);
        mx[c] = std::max(mx[c], k[c]);
      }
    }
  }
}

void BlockSummary::clear() {
  num_tokens_ = 0;
  for (auto& rows : bounds_) rows.clear();
}

const float* BlockSummary::block_min(int64_t block, int kv_head) const {
  return bounds_[size_t(kv_head)].data() + size_t(block) * 2 * size_t(options_.head_dim);
}

const float* BlockSummary::block_max(int64_t block, int kv_head) const {
  return block_min(block, kv_head) + options_.head_dim;
}

void BlockSummary::check_head(int kv_head, int group) const {
  if (kv_head < 0 || kv_head >= options_.n_kv_heads)
    fail("block summary: KV head {} is out of range (n_kv_heads = {})", kv_head, options_.n_kv_heads);
  if (group < 1) fail("block summary: a query group needs at least one query head (got {})", group);
}

namespace {

float combine_into(GroupCombine combine, float acc, float x, bool first) {
  if (first) return x;
  return combine == GroupCombine::Max ? std::max(acc, x) : acc + x;
}

}  // namespace

void BlockSummary::upper_bounds(int kv_head, const float* q, int group, GroupCombine combine, float* bounds) const {
  check_head(kv_head, group);
  const int d = options_.head_dim;
  const int64_t nb = num_blocks();
  const float* rows = bounds_[size_t(kv_head)].data();
#if defined(__AVX512F__)
  // max(q*min, q*max) = max(q, 0) * max + min(q, 0) * min: two FMAs per
  // channel and no compare. The query halves are zero-padded to whole
  // vectors, so only the summary rows need a masked tail load.
  const int chunks = (d + 15) / 16;
  const __mmask16 tail = (d % 16 == 0) ? __mmask16(0xFFFF) : __mmask16((1u << (d % 16)) - 1);
  std::vector<float> halves(size_t(group) * 2 * size_t(chunks) * 16, 0.0f);  // (group, pos|neg, chunks * 16)
  for (int i = 0; i < group; ++i) {
    float* pos = halves.data() + size_t(i) * 2 * size_t(chunks) * 16;
    float* neg = pos + size_t(chunks) * 16;
    for (int c = 0; c < d; ++c) {
      pos[c] = std::max(q[size_t(i) * size_t(d) + size_t(c)], 0.0f);
      neg[c] = std::min(q[size_t(i) * size_t(d) + size_t(c)], 0.0f);
    }
  }
  alignas(64) float tile[16];
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int n = int(std::min<int64_t>(16, nb - b0));
    for (int i = 0; i < group; ++i) {
      const float* pos = halves.data() + size_t(i) * 2 * size_t(chunks) * 16;
      const float* neg = pos + size_t(chunks) * 16;
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      for (int t = 0; t < n; ++t) {
        const float* mn = rows + size_t(b0 + t) * 2 * size_t(d);
        const float* mx = mn + d;
        for (int c = 0; c < chunks; ++c) {
          const __mmask16 m = c + 1 == chunks ? tail : __mmask16(0xFFFF);
          acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(pos + c * 16), _mm512_maskz_loadu_ps(m, mx + c * 16), acc[t]);
          acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(neg + c * 16), _mm512_maskz_loadu_ps(m, mn + c * 16), acc[t]);
        }
      }
      _mm512_store_ps(tile, simd::hsum16(acc));
      for (int t = 0; t < n; ++t) bounds[b0 + t] = combine_into(combine, bounds[b0 + t], tile[t], i == 0);
    }
  }
#else
  for (int64_t b = 0; b < nb; ++b) {
    const float* mn = rows + size_t(b) * 2 * size_t(d);
    const float* mx = mn + d;
    for (int i = 0; i < group; ++i) {
      const float* qi = q + size_t(i) * size_t(d);
      float s = 0.0f;
      for (int c = 0; c < d; ++c) s += std::max(qi[c] * mn[c], qi[c] * mx[c]);
      bounds[b] = combine_into(combine, bounds[b], s, i == 0);
    }
  }
#endif
}

void BlockSummary::upper_bounds_reference(int kv_head, const float* q, int group, GroupCombine combine,
                                          double* bounds) const {
  check_head(kv_head, group);
  const int d = options_.head_dim;
  for (int64_t b = 0; b < num_blocks(); ++b) {
    const float* mn = block_min(b, kv_head);
    const float* mx = block_max(b, kv_head);
    for (int i = 0; i < group; ++i) {
      double s = 0.0;
      for (int c = 0; c < d; ++c) {
        const double qc = q[size_t(i) * size_t(d) + size_t(c)];
        s += std::max(qc * mn[c], qc * mx[c]);
      }
      bounds[b] = i == 0 ? s : (combine == GroupCombine::Max ? std::max(bounds[b], s) : bounds[b] + s);
    }
  }
}

void BlockSummary::select(int kv_head, const float* q, int group, int k, GroupCombine combine,
                          std::vector<int32_t>& blocks, std::vector<float>& bounds) const {
  check_head(kv_head, group);
  if (k < 1) fail("block summary: cannot select {} blocks (k must be at least 1)", k);
  const int64_t nb = num_blocks();
  bounds.resize(size_t(nb));
  blocks.resize(size_t(nb));
  std::iota(blocks.begin(), blocks.end(), 0);
  upper_bounds(kv_head, q, group, combine, bounds.data());
  if (k >= nb) return;
  const auto better = [&](int32_t a, int32_t b) {
    return bounds[size_t(a)] > bounds[size_t(b)] || (bounds[size_t(a)] == bounds[size_t(b)] && a < b);
  };
  std::nth_element(blocks.begin(), blocks.begin() + k, blocks.end(), better);
  blocks.resize(size_t(k));
  std::sort(blocks.begin(), blocks.end());
}

std::vector<int32_t> BlockSummary::select(int kv_head, const float* q, int group, int k,
                                          GroupCombine combine) const {
  std::vector<int32_t> blocks;
  std::vector<float> bounds;
  select(kv_head, q, group, k, combine, blocks, bounds);
  return blocks;
}

size_t BlockSummary::memory_bytes() const {
  size_t bytes = 0;
  for (const auto& rows : bounds_) bytes += rows.capacity() * sizeof(float);
  return bytes;
}

}  // namespace kvserve
