#include "attention/paged_attention.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "attention/head_slice_prefetch.h"
#include "attention/span_queries.h"
#include "kernels/vector_ops.h"

namespace kvserve {

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
  // RoPE positions differ from slots: text positions after an eviction, or
  // ranks in the cache while evicted slots wait for compaction.
  const bool moved = !table.slot_positions.empty() && (!table.positions_in_cache || masked);
  if (moved && cache.k_pre_rope(layer)) {
    if (scratch.positions.size() < size_t(n_ctx)) scratch.positions.resize(size_t(n_ctx));
    cache.key_rope_positions(table, layer, kv_head, n_ctx, scratch.positions.data());
  }

  const bool pre_rope = cache.k_pre_rope(layer);
  if (pre_rope && scratch.rotated.size() < size_t(bs + 1) * group * head_dim)
    scratch.rotated.resize(size_t(bs + 1) * group * head_dim);
  // The group's queries rotated back to position p, into scratch.rotated.
  auto rotate_block_query = [&](int32_t p) {
    if (p >= cache.rope_table().max_pos()) return false;
    for (int i = 0; i < group; ++i)
      cache.rope_table().rotate_back(q + size_t(i) * head_dim, p, scratch.rotated.data() + size_t(i) * head_dim);
    return true;
  };
  // Keys in RoPE spans (KvCodecConfig::rope_span): the key at text position
  // p is stored rotated by p mod span. While slots are positions (nothing
  // evicted yet) a span's keys share one query, rotated back to the span's
  // first position.
  const int rope_span = pre_rope ? cache.k_rope_span(layer) : 1;
  const bool spans_aligned = rope_span > 1 && table.slot_positions.empty();
  const size_t set = size_t(group) * size_t(head_dim);
  SpanQueries span_queries(cache.rope_table_if_any(), q, group, head_dim,
                           pre_rope ? scratch.rotated.data() + size_t(bs) * set : nullptr);
  auto score_spans = [&](const KvBlockView& k, int32_t b, int n, float* block_scores) {
    float* sets = scratch.rotated.data();  // (spans, group, head_dim): spans <= bs
    span_queries.rotate(b * bs, n, rope_span, 0, group, sets);
    k.codec->score_spans(sets, group, k.data, n, rope_span, kv_head, scale, block_scores, stride);
  };
  // What the query is rotated back by for the key in `slot`: its RoPE
  // position, less the rotation the key was stored with; `evicted` (masked
  // below, any rotation will do) when the slot holds no token.
  constexpr int32_t kEvicted = INT32_MIN;
  auto query_rotation = [&](int32_t slot) {
    const int32_t pos = moved ? scratch.positions[size_t(slot)] : slot;
    if (rope_span == 1) return std::max(0, pos);
    const int32_t text_pos = cache.slot_position(table, layer, kv_head, slot);
    return text_pos < 0 ? kEvicted : pos - text_pos % rope_span;
  };
  // The group's queries rotated back by `rotation` into out, forward when it
  // is negative (a key compacted below its stored rotation).
  auto rotate_query = [&](int32_t rotation, float* out) {
    if (rotation >= 0) {
      cache.rope_table().rotate_back(q, group, rotation, out);
      return;
    }
    std::copy(q, q + set, out);
    rope(out, group, head_dim, -rotation, cache.rope_frequencies());
  };
  // Keys in RoPE spans once slots stopped being positions: runs of slots
  // that need the same rotation (a span's tokens, mostly) share one query
  // set and one score_span call; channel-major codecs have no vector
  // per-key kernel (a per-key query there measured ~7x slower).
  auto score_runs = [&](const KvBlockView& k, int32_t b, int n, float* block_scores) {
    float* run_q = scratch.rotated.data();
    for (int t0 = 0, t1; t0 < n; t0 = t1) {
      int32_t rotation = query_rotation(b * bs + t0);
      for (t1 = t0 + 1; t1 < n; ++t1) {
        const int32_t r = query_rotation(b * bs + t1);
        if (rotation == kEvicted) rotation = r;
        else if (r != rotation && r != kEvicted) break;
      }
      rotate_query(rotation == kEvicted ? 0 : rotation, run_q);
      k.codec->score_span(run_q, group, k.data, t0, t1, kv_head, scale, block_scores, stride);
    }
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
    } else if (rope_span > 1) {
      // Keys at positions b * bs + t, stored rotated by t mod rope_span;
      // after an eviction, one query set per run of slots.
      if (spans_aligned) score_spans(k, b, n, block_scores);
      else score_runs(k, b, n, block_scores);
    } else if (!moved && rotate_block_query(b * bs) &&
               k.codec->score_offsets(scratch.rotated.data(), group, k.data, n, kv_head, scale, cache.rope_table(),
                                      block_scores, stride)) {
      // Keys at positions b * bs + t: the query rotated back once per block,
      // each key by its offset t in the codec's kernel.
    } else {
      // Keys are stored before RoPE: q·rope(k, p) = rotate_back(q, p)·k.
      float* rq = scratch.rotated.data();  // (n, group, head_dim)
      for (int t = 0; t < n; ++t) rotate_query(query_rotation(b * bs + t), rq + size_t(t) * set);
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
    float max_score;
    const float sum = exp_shifted(scores + i * stride, span, &max_score);
    inv_sum[i] = sum > 0 ? 1.0f / sum : 0.0f;  // nothing read: a zero output, as before
    if (sparsity.softmax_stats != nullptr) {
      sparsity.softmax_stats[2 * i] = max_score;
      sparsity.softmax_stats[2 * i + 1] = sum > 0 ? sum : 0.0f;  // NaN when every score is -inf
    }
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

void merge_attention_parts(const float* outs, const float* stats, int parts, int group, int head_dim, float* out) {
  std::fill(out, out + size_t(group) * size_t(head_dim), 0.0f);
  for (int i = 0; i < group; ++i) {
    float top = -INFINITY;
    for (int p = 0; p < parts; ++p) {
      const float* s = stats + (size_t(p) * size_t(group) + size_t(i)) * 2;
      if (s[1] > 0) top = std::max(top, s[0]);
    }
    if (top == -INFINITY) continue;  // no part read anything: a zero output, as a single pass gives
    // Part p's weights were divided by its own sum; in the whole pass they
    // are exp(score - top) / total, i.e. its output times sum_p e^(max_p - top).
    float total = 0;
    float* o = out + size_t(i) * size_t(head_dim);
    for (int p = 0; p < parts; ++p) {
      const float* s = stats + (size_t(p) * size_t(group) + size_t(i)) * 2;
      if (!(s[1] > 0)) continue;
      const float w = s[1] * std::exp(s[0] - top);
      total += w;
      const float* po = outs + (size_t(p) * size_t(group) + size_t(i)) * size_t(head_dim);
      for (int d = 0; d < head_dim; ++d) o[d] += w * po[d];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < head_dim; ++d) o[d] *= inv;
  }
}

int attention_parts(int64_t units, int threads, int32_t n_ctx, int32_t block_size, int32_t min_part_tokens) {
  if (threads <= 1 || units <= 0) return 1;
  const int64_t blocks = (int64_t(n_ctx) + block_size - 1) / block_size;
  const int64_t min_blocks = std::max<int64_t>(1, (int64_t(min_part_tokens) + block_size - 1) / block_size);
  const int64_t most = std::min<int64_t>(threads, blocks / min_blocks);
  // The busiest thread's share, in whole passes, with every pass cut in p:
  // ceil(units p / threads) parts of 1/p of a pass each.
  auto busiest = [&](int64_t p) { return double((units * p + threads - 1) / threads) / double(p); };
  int64_t best = 1;
  for (int64_t p = 2; p <= most; ++p)
    if (busiest(p) < busiest(best)) best = p;
  // A part's start costs a few percent of a pass (its first blocks' misses):
  // cut only for a tenth off the busiest thread's share.
  return busiest(best) <= 0.9 * busiest(1) ? int(best) : 1;
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
      if (cache.k_pre_rope(layer)) {  // stored rotated by its text position mod the span (1: not at all)
        const int32_t stored = cache.slot_position(table, layer, kv_head, t) % cache.k_rope_span(layer);
        rope(k.data() + size_t(kv_head) * head_dim, 1, head_dim,
             cache.key_rope_position(table, layer, kv_head, t) - stored, cache.rope_frequencies());
      }
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
