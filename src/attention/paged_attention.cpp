#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/vector_ops.h"

namespace kvserve {
namespace {

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
// between the two in one run); int4-small's 19-line slices did not change
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
      slice_ = codec_->block_bytes() / size_t(codec_->shape().n_kv_heads);
      half_ = (slice_ / 2 + 63) / 64 * 64;
    }
    const uint8_t* p = view.data + size_t(kv_head_) * slice_;
    const size_t begin = part == Part::SecondHalf ? half_ : 0, end = part == Part::FirstHalf ? half_ : slice_;
    for (size_t off = begin; off < end; off += 64) __builtin_prefetch(p + off, 0, 2);
  }

  int kv_head_;
  int32_t n_;
  ViewAt view_at_;
  const KvCodec* codec_ = nullptr;
  size_t slice_ = 0, half_ = 0;
};

}  // namespace

void attend_kv_head(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                    int kv_head, int group, int head_dim, const float* q, float* out,
                    AttentionScratch& scratch, const AttentionSparsity& sparsity) {
  const int32_t bs = cache.block_size();
  const int32_t n_blocks = (n_ctx + bs - 1) / bs;
  // Block j of the blocks read is logical block block_at(j); its scores sit at
  // column j * bs, so the read blocks form one row per query head.
  const bool selected = !sparsity.blocks.empty();
  const int32_t n_read = selected ? int32_t(sparsity.blocks.size()) : n_blocks;
  auto block_at = [&](int32_t j) { return selected ? sparsity.blocks[size_t(j)] : j; };
  const int stride = n_read * bs;
  if (scratch.scores.size() < size_t(group) * size_t(stride)) scratch.scores.resize(size_t(group) * size_t(stride));
  float* scores = scratch.scores.data();  // (group, stride)
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const bool masked = table.dead > 0;     // evicted slots still in place
  const bool moved = !table.slot_positions.empty() && !table.positions_in_cache;  // positions differ from slots

  const bool pre_rope = cache.k_pre_rope(layer);
  if (pre_rope && scratch.rotated.size() < size_t(bs) * group * head_dim)
    scratch.rotated.resize(size_t(bs) * group * head_dim);
  // The group's queries rotated back to position p, into scratch.rotated.
  auto rotate_block_query = [&](int32_t p) {
    if (p >= cache.rope_table().max_pos()) return false;
    for (int i = 0; i < group; ++i)
      cache.rope_table().rotate_back(q + size_t(i) * head_dim, p, scratch.rotated.data() + size_t(i) * head_dim);
    return true;
  };
  int32_t span = 0;  // columns of the rows in use
  HeadSlicePrefetch prefetch_k(kv_head, n_read, [&](int32_t i) { return cache.k_view(layer, table, block_at(i), n_ctx); });
  HeadSlicePrefetch prefetch_v(kv_head, n_read, [&](int32_t i) { return cache.v_view(layer, table, block_at(i), n_ctx); });
  for (int32_t j = 0; j < n_read; ++j) {
    const int32_t b = block_at(j);
    const int n = std::min(bs, n_ctx - b * bs);
    span = j * bs + n;
    const KvBlockView k = cache.k_view(layer, table, b, n_ctx);
    prefetch_k.before(j);
    float* block_scores = scores + j * bs;
    if (!pre_rope) {
      k.codec->score(q, group, k.data, n, kv_head, scale, block_scores, stride);
    } else if (!moved && rotate_block_query(b * bs) &&
               k.codec->score_offsets(scratch.rotated.data(), group, k.data, n, kv_head, scale, cache.rope_table(),
                                      block_scores, stride)) {
      // Keys at positions b * bs + t: the query rotated back once per block,
      // each key by its offset t in the codec's kernel.
    } else {
      // Keys are stored before RoPE: q·rope(k, p) = rotate_back(q, p)·k.
      float* rq = scratch.rotated.data();  // (n, group, head_dim)
      for (int t = 0; t < n; ++t) {
        const int32_t slot = b * bs + t;
        const int32_t pos = moved ? std::max(0, cache.key_rope_position(table, layer, kv_head, slot)) : slot;
        for (int i = 0; i < group; ++i)
          cache.rope_table().rotate_back(q + size_t(i) * head_dim, pos, rq + (size_t(t) * group + i) * head_dim);
      }
      k.codec->score_tokens(rq, group, k.data, n, kv_head, scale, block_scores, stride);
    }
    if (masked || !sparsity.keep.empty())
      for (int t = 0; t < n; ++t) {
        const int32_t slot = b * bs + t;
        const bool skip = (masked && cache.slot_position(table, layer, kv_head, slot) < 0) ||
                          (!sparsity.keep.empty() && sparsity.keep[size_t(slot)] == 0);
        if (skip)
          for (int i = 0; i < group; ++i) block_scores[size_t(i) * stride + t] = -INFINITY;
      }
  }
  // Unnormalized weights (the largest is 1); the outputs are divided by the
  // sums at the end.
  if (scratch.inv_sums.size() < size_t(group)) scratch.inv_sums.resize(size_t(group));
  float* inv_sum = scratch.inv_sums.data();
  for (int i = 0; i < group; ++i) {
    const float sum = exp_shifted(scores + i * stride, span);
    inv_sum[i] = sum > 0 ? 1.0f / sum : 0.0f;  // nothing read: a zero output, as before
  }
  if (sparsity.weights != nullptr) {
    if (selected) std::fill(sparsity.weights, sparsity.weights + n_ctx, 0.0f);
    for (int32_t j = 0; j < n_read; ++j) {
      const int32_t b = block_at(j);
      const int n = std::min(bs, n_ctx - b * bs);
      for (int t = 0; t < n; ++t) {
        float w = 0;
        for (int i = 0; i < group; ++i) w += scores[size_t(i) * stride + j * bs + t] * inv_sum[i];
        sparsity.weights[b * bs + t] = w;
      }
    }
  }
  std::fill(out, out + size_t(group) * head_dim, 0.0f);
  for (int32_t j = 0; j < n_read; ++j) {
    const int32_t b = block_at(j);
    const int n = std::min(bs, n_ctx - b * bs);
    const KvBlockView v = cache.v_view(layer, table, b, n_ctx);
    prefetch_v.before(j);
    v.codec->accumulate(scores + j * bs, group, stride, v.data, n, kv_head, out);
  }
  for (int i = 0; i < group; ++i)
    for (int d = 0; d < head_dim; ++d) out[size_t(i) * head_dim + d] *= inv_sum[i];
}

void attend_kv_head_reference(const KvCache& cache, int layer, const BlockTable& table,
                              int32_t n_ctx, int kv_head, int group, int head_dim,
                              const float* q, float* out, std::vector<double>* weights) {
  const int32_t bs = cache.block_size();
  if (weights != nullptr) weights->assign(size_t(group) * size_t(n_ctx), 0.0);
  const int kv_dim = cache.k_codec(layer).shape().kv_dim();
  std::vector<float> k(static_cast<size_t>(kv_dim)), v(static_cast<size_t>(kv_dim));
  std::vector<double> s(static_cast<size_t>(n_ctx));
  for (int i = 0; i < group; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    double max_s = -INFINITY;
    for (int32_t t = 0; t < n_ctx; ++t) {
      if (cache.slot_position(table, layer, kv_head, t) < 0) {  // evicted
        s[size_t(t)] = -INFINITY;
        continue;
      }
      const KvBlockView kb = cache.k_view(layer, table, t / bs, n_ctx);
      kb.codec->decode_token(kb.data, t % bs, k.data());
      if (cache.k_pre_rope(layer))
        rope(k.data() + size_t(kv_head) * head_dim, 1, head_dim, cache.key_rope_position(table, layer, kv_head, t),
             cache.rope_theta());
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) dot += double(qi[d]) * k[size_t(kv_head * head_dim + d)];
      s[size_t(t)] = dot / std::sqrt(double(head_dim));
      max_s = std::max(max_s, s[size_t(t)]);
    }
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - max_s));
    if (weights != nullptr)
      for (int32_t t = 0; t < n_ctx; ++t) (*weights)[size_t(i) * size_t(n_ctx) + size_t(t)] = s[size_t(t)] / sum;
    std::vector<double> acc(static_cast<size_t>(head_dim), 0.0);
    for (int32_t t = 0; t < n_ctx; ++t) {
      if (s[size_t(t)] == 0) continue;  // evicted (or underflowed: adds nothing)
      const KvBlockView vb = cache.v_view(layer, table, t / bs, n_ctx);
      vb.codec->decode_token(vb.data, t % bs, v.data());
      for (int d = 0; d < head_dim; ++d) acc[size_t(d)] += s[size_t(t)] / sum * v[size_t(kv_head * head_dim + d)];
    }
    for (int d = 0; d < head_dim; ++d) out[size_t(i) * head_dim + d] = float(acc[size_t(d)]);
  }
}

}  // namespace kvserve
