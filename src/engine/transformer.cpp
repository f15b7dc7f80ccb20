#include "engine/transformer.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "attention/tile_attention.h"
#include "kernels/matmul.h"
#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {

namespace {

// Runs a call into batch entry `entry`'s sparsity policy during the pass: an
// exception it throws (kvserve::Error, or a library's: hnswlib and faiss
// throw std::runtime_error and faiss::FaissException) names the entry
// (BatchEntryError). others_untouched: whether the pass has yet written or
// fed anything of the other entries.
template <class F>
void policy_call(size_t entry, F&& f, bool others_untouched = false) {
  try {
    f();
  } catch (const std::exception& e) {
    throw BatchEntryError(entry, others_untouched, e.what());
  }
}

}  // namespace

void Transformer::plan_dense_attention(int32_t block_size, const std::vector<const BlockTable*>& tables,
                                       const std::vector<int32_t>& n_ctx) {
  const ModelConfig& c = config_;
  const int64_t n = int64_t(n_ctx.size());
  auto blocks_of = [&](int32_t slots) { return (slots + block_size - 1) / block_size; };
  // Consecutive tokens of one sequence (a prefill chunk) share their passes
  // in tiles of up to prefill_tile_tokens_, which read each block once;
  // any other token is a pass of its own.
  struct Run {
    int64_t first;
    int32_t tokens;
  };
  std::vector<Run> tiles, singles;
  for (int64_t t = 0, e; t < n; t = e) {
    for (e = t + 1; e < n && e - t < prefill_tile_tokens_ && tables[size_t(e)] == tables[size_t(t)] &&
                    n_ctx[size_t(e)] == n_ctx[size_t(e - 1)] + 1;)
      ++e;
    (e - t > 1 ? tiles : singles).push_back({t, int32_t(e - t)});
  }
  attention_work_.clear();
  // Tiles head by head: a thread's contiguous range then holds whole heads
  // of a chunk, whose later tiles read more blocks than its first.
  for (int h = 0; h < c.n_kv_heads; ++h)
    for (const Run& r : tiles)
      attention_work_.push_back({r.first, r.tokens, h, 0, blocks_of(n_ctx[size_t(r.first + r.tokens - 1)]), -1, 1});
  // A single token's long context whose passes would leave threads idle or
  // unevenly loaded is cut into parts of whole blocks (flash-decoding,
  // attention_parts), merged after the passes.
  const int64_t units = int64_t(tiles.size() + singles.size()) * c.n_kv_heads;
  int32_t parts_total = 0, most_blocks = 0;
  for (const Run& r : singles) {
    const int32_t blocks = blocks_of(n_ctx[size_t(r.first)]);
    most_blocks = std::max(most_blocks, blocks);
    const int parts = attention_parts(units, pool_.num_threads(), n_ctx[size_t(r.first)], block_size,
                                      attention_part_tokens_);
    for (int h = 0; h < c.n_kv_heads; ++h) {
      if (parts == 1) {
        attention_work_.push_back({r.first, 1, h, 0, blocks, -1, 1});
        continue;
      }
      for (int p = 0; p < parts; ++p)
        attention_work_.push_back({r.first, 1, h, int32_t(int64_t(blocks) * p / parts),
                                   int32_t(int64_t(blocks) * (p + 1) / parts), parts_total++, parts});
    }
  }
  // Each thread's contiguous range of the work, cut where the blocks read
  // (times the tokens reading them) are shared most evenly: a chunk's tiles
  // weigh many decode passes.
  std::vector<int64_t> cost(attention_work_.size() + 1, 0);  // prefix sums
  for (size_t i = 0; i < attention_work_.size(); ++i) {
    const AttentionWork& w = attention_work_[i];
    cost[i + 1] = cost[i] + int64_t(w.tokens) * (w.end_block - w.first_block);
  }
  const int threads = pool_.num_threads();
  work_ranges_.assign(size_t(threads) + 1, int64_t(attention_work_.size()));
  work_ranges_[0] = 0;
  for (int k = 1; k < threads; ++k) {
    const double target = double(cost.back()) * k / threads;
    int64_t i = std::lower_bound(cost.begin(), cost.end(), int64_t(std::ceil(target))) - cost.begin();
    if (i > 0 && target - double(cost[size_t(i - 1)]) < double(cost[size_t(i)]) - target) --i;  // the nearer cut
    work_ranges_[size_t(k)] = std::max(work_ranges_[size_t(k - 1)], i);
  }
  if (parts_total == 0) return;
  if (block_ids_.size() < size_t(most_blocks)) {
    const size_t old = block_ids_.size();
    block_ids_.resize(size_t(most_blocks));
    for (size_t i = old; i < block_ids_.size(); ++i) block_ids_[i] = int32_t(i);
  }
  part_out_.resize(size_t(parts_total) * size_t(c.gqa_group()) * size_t(c.head_dim()));
  part_stats_.resize(size_t(parts_total) * size_t(c.gqa_group()) * 2);
}

void Transformer::attend_dense(const KvCache& cache, int layer, const std::vector<const BlockTable*>& tables,
                               const std::vector<int32_t>& n_ctx) {
  const ModelConfig& c = config_;
  const int head_dim = c.head_dim(), group = c.gqa_group(), q_dim = c.n_heads * head_dim;
  // One contiguous range of the work list per thread (work_ranges_): a
  // thread keeps whole KV heads. (Threads claiming passes one at a time,
  // so that neighbours read neighbouring heads, made FP16 decode at 16K 8%
  // slower, int4-small unchanged.)
  pool_.parallel_for(int64_t(work_ranges_.size()) - 1, 1, [&](int64_t first, int64_t last, int thread) {
    for (int64_t i = work_ranges_[size_t(first)]; i < work_ranges_[size_t(last)]; ++i) {
      const AttentionWork& w = attention_work_[size_t(i)];
      const size_t off = size_t(w.token) * q_dim + size_t(w.kv_head) * group * head_dim;
      const BlockTable& table = *tables[size_t(w.token)];
      if (w.tokens > 1) {
        if (attend_kv_head_tile(cache, layer, table, n_ctx[size_t(w.token)], w.tokens, w.kv_head, group, head_dim,
                                q_.data() + off, size_t(q_dim), att_.data() + off, scratch_[size_t(thread)]))
          continue;
        for (int32_t t = 0; t < w.tokens; ++t)  // the layer reads per token (tile_attention.h)
          attend_kv_head(cache, layer, table, n_ctx[size_t(w.token + t)], w.kv_head, group, head_dim,
                         q_.data() + off + size_t(t) * q_dim, att_.data() + off + size_t(t) * q_dim,
                         scratch_[size_t(thread)]);
        continue;
      }
      AttentionSparsity part;
      float* out = att_.data() + off;
      if (w.part >= 0) {
        part.blocks = std::span<const int32_t>(block_ids_.data() + w.first_block, size_t(w.end_block - w.first_block));
        part.softmax_stats = part_stats_.data() + size_t(w.part) * group * 2;
        out = part_out_.data() + size_t(w.part) * group * head_dim;
      }
      attend_kv_head(cache, layer, table, n_ctx[size_t(w.token)], w.kv_head, group, head_dim, q_.data() + off, out,
                     scratch_[size_t(thread)], part);
    }
  });
  // Each cut pass, at its first part: its parts are numbered consecutively.
  for (const AttentionWork& w : attention_work_)
    if (w.part >= 0 && w.first_block == 0)
      merge_attention_parts(part_out_.data() + size_t(w.part) * group * head_dim,
                            part_stats_.data() + size_t(w.part) * group * 2, w.parts, group, head_dim,
                            att_.data() + size_t(w.token) * q_dim + size_t(w.kv_head) * group * head_dim);
}

const float* Logits::last(size_t e, const std::vector<BatchEntry>& batch) const {
  int32_t rows = batch[e].all_logits ? int32_t(batch[e].tokens.size()) : 1;
  return row(first_row[e] + rows - 1);
}

Transformer::Transformer(const Model& model, ThreadPool& pool)
    : model_(model),
      config_(model.config()),
      pool_(pool),
      scratch_(size_t(pool.num_threads())),
      policy_scratch_(size_t(pool.num_threads())),
      rope_freqs_(config_.rope_frequencies()),
      query_scale_(rope_score_scale(config_.rope_scaling)) {
  const char* parts = std::getenv("KVSERVE_ATTENTION_PARTS");
  attention_part_tokens_ = parts != nullptr && std::string_view(parts) == "0" ? INT32_MAX : kAttentionPartTokens;
  const char* tile = std::getenv("KVSERVE_PREFILL_TILE");
  prefill_tile_tokens_ = tile != nullptr ? std::max(1, std::atoi(tile)) : std::max(1, kPrefillTileRows / config_.gqa_group());
}

void Transformer::ensure_capacity(int64_t n_tokens, int64_t n_rows) {
  const ModelConfig& c = config_;
  if (n_tokens > capacity_) {
    const size_t t = size_t(n_tokens);
    const size_t q_dim = size_t(c.n_heads) * size_t(c.head_dim());
    x_.resize(t * size_t(c.dim));
    xb_.resize(t * size_t(c.dim));
    q_.resize(t * q_dim);
    k_.resize(t * size_t(c.kv_dim()));
    v_.resize(t * size_t(c.kv_dim()));
    att_.resize(t * q_dim);
    hb_.resize(t * size_t(c.hidden_dim));
    hb2_.resize(t * size_t(c.hidden_dim));
    capacity_ = n_tokens;
  }
  if (size_t(n_rows) * size_t(c.dim) > rows_.size()) rows_.resize(size_t(n_rows) * size_t(c.dim));
}

void Transformer::forward(const std::vector<BatchEntry>& batch, KvCache& cache, Logits& out) {
  const ModelConfig& c = config_;
  const Weights& w = model_.weights();
  const int dim = c.dim, head_dim = c.head_dim(), kv_dim = c.kv_dim(), hidden = c.hidden_dim;
  const int q_dim = c.n_heads * head_dim, group = c.gqa_group();

  // Where each stacked token comes from: its entry, its slot in the entry's
  // table and its RoPE position (the same until a policy evicts).
  struct TokenSlot {
    int32_t entry;
    int32_t pos;
    int32_t rope;
  };
  std::vector<TokenSlot> slots;
  int64_t n_rows = 0;
  out.first_row.assign(batch.size(), 0);
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& b = batch[e];
    const int32_t start = b.table->num_tokens;
    const int64_t positions = int64_t(b.table->rope_position_of_new(start)) + int64_t(b.tokens.size());
    // Checked for every entry before anything changes, so an entry that
    // cannot run is the only one to fail.
    auto refuse = [e](std::string message) { throw BatchEntryError(e, /*others_untouched=*/true, message); };
    if (positions > c.seq_len)
      refuse(fmt::format("sequence of {} tokens exceeds the model's context length of {}", positions, c.seq_len));
    if (b.table->capacity(cache.block_size()) < start + int32_t(b.tokens.size()))
      refuse(fmt::format("internal: KV space for {} tokens was not reserved", b.tokens.size()));
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= c.vocab_size)
        refuse(fmt::format("token id {} is out of range (vocabulary of {})", b.tokens[i], c.vocab_size));
      slots.push_back({int32_t(e), start + int32_t(i), b.table->rope_position_of_new(start + int32_t(i))});
    }
    out.first_row[e] = int32_t(n_rows);
    n_rows += b.tokens.empty() ? 0 : (b.all_logits ? int64_t(b.tokens.size()) : 1);
  }
  const int64_t n = int64_t(slots.size());
  if (n == 0) {
    out.values.clear();
    return;
  }
  ensure_capacity(n, n_rows);

  // Sparsity: who needs keys, and whether attention runs through the policies.
  bool any_kv = false, any_sparse = false;
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& b = batch[e];
    if (b.policy == nullptr) continue;
    // Before any KV write of the pass; the others' begin_forward calls so
    // far only caught up with their committed tokens, which running them
    // again does not repeat: they stay as they were, and run on without a
    // preemption.
    policy_call(e, [&] { b.policy->begin_forward(cache, *b.table, int32_t(b.tokens.size())); },
                /*others_untouched=*/true);
    any_kv = any_kv || b.policy->wants_kv();
    any_sparse = any_sparse || b.policy->selects_reads() || b.policy->wants_attention_weights();
  }
  // Attention work units: one token's query heads that share one KV head;
  // for a policy that observes attention weights, all of its sequence's new
  // tokens for one KV head in order (observe() sees a head's queries in order).
  // A prefill chunk's tokens otherwise go in tiles (tile_attention.h):
  // read-time choices apply to decode queries only, so a chunk reads
  // everything, and a tile reads each block once for its tokens.
  struct Unit {
    int64_t first;  // first stacked token
    int32_t count;  // tokens, in order
    int kv_head;
    bool tile;      // the tokens may share one tile pass
  };
  std::vector<Unit> units;
  if (any_sparse) {
    int64_t t0 = 0;
    for (const BatchEntry& b : batch) {
      const int32_t count = int32_t(b.tokens.size());
      const bool ordered = b.policy != nullptr && b.policy->wants_attention_weights();
      const bool tiled = !ordered && !b.decode && count > 1;  // decode queries choose their reads one by one
      const int32_t step = ordered ? count : (tiled ? prefill_tile_tokens_ : 1);
      for (int32_t i = 0; i < count; i += step)
        for (int h = 0; h < c.n_kv_heads; ++h)
          units.push_back({t0 + i, std::min(step, count - i), h, tiled});
      t0 += count;
    }
  }

  for (int64_t t = 0; t < n; ++t) {
    const BatchEntry& b = batch[size_t(slots[size_t(t)].entry)];
    dequantize_row(w.token_embedding, b.tokens[size_t(slots[size_t(t)].pos - b.table->num_tokens)],
                   x_.data() + t * dim);
  }

  // Every token's table and the slots it sees (causal), for attend_dense.
  std::vector<const BlockTable*> token_tables(static_cast<size_t>(n));
  std::vector<int32_t> token_ctx(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    token_tables[size_t(t)] = batch[size_t(slots[size_t(t)].entry)].table;
    token_ctx[size_t(t)] = slots[size_t(t)].pos + 1;
  }
  if (!any_sparse) plan_dense_attention(cache.block_size(), token_tables, token_ctx);  // the same for every layer

  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& lw = w.layers[size_t(layer)];
    for (int64_t t = 0; t < n; ++t) rmsnorm(xb_.data() + t * dim, x_.data() + t * dim, lw.attn_norm, dim, c.norm_eps);
    matmul_shared_input({&lw.wq, &lw.wk, &lw.wv}, {q_.data(), k_.data(), v_.data()}, xb_.data(), n, &pool_);
    const bool pre_rope = cache.k_pre_rope(layer);
    const int rope_span = pre_rope ? cache.k_rope_span(layer) : 1;
    for (int64_t t = 0; t < n; ++t) {
      const TokenSlot& s = slots[size_t(t)];
      const BatchEntry& b = batch[size_t(s.entry)];
      float* k = k_.data() + t * kv_dim;
      float* q = q_.data() + t * q_dim;
      rope(q, c.n_heads, head_dim, s.rope, rope_freqs_.data());
      // YaRN scales q.k by mscale^2 (llama.cpp: cos and sin of q and k by
      // mscale); on q alone the scores are the same, and keys stay as
      // stored, whichever codec and rotation path reads them.
      if (query_scale_ != 1.0f)
        for (int64_t i = 0; i < q_dim; ++i) q[i] *= query_scale_;
      if (!pre_rope) rope(k, c.n_kv_heads, head_dim, s.rope, rope_freqs_.data());
      const float* stored_k = k;
      if (rope_span > 1) {  // rotated by its text position's offset within its span (KvCodecConfig::rope_span)
        key_in_span_.assign(k, k + kv_dim);
        rope(key_in_span_.data(), c.n_kv_heads, head_dim, b.table->position_of_new(s.pos) % rope_span,
             rope_freqs_.data());
        stored_k = key_in_span_.data();
      }
      cache.write(layer, *b.table, s.pos, stored_k, v_.data() + t * kv_dim);
      if (any_kv && b.policy != nullptr && b.policy->wants_kv()) {
        const float* key = k;
        if (pre_rope) {
          key_after_rope_.assign(k, k + kv_dim);
          rope(key_after_rope_.data(), c.n_kv_heads, head_dim, s.rope, rope_freqs_.data());
          key = key_after_rope_.data();
        }
        policy_call(size_t(s.entry), [&] { b.policy->on_kv(layer, s.pos, key, v_.data() + t * kv_dim); });
      }
    }
    for (const BatchEntry& b : batch)
      cache.seal(layer, *b.table, b.table->num_tokens + int32_t(b.tokens.size()));
    if (observer_) observer_(layer, k_.data(), v_.data(), n);
    if (query_observer_) query_observer_(layer, q_.data(), n);
    if (!any_sparse) {
      attend_dense(cache, layer, token_tables, token_ctx);
    } else {
      pool_.parallel_for(int64_t(units.size()), 1, [&](int64_t begin, int64_t end, int thread) {
        PolicyScratch& ps = policy_scratch_[size_t(thread)];
        for (int64_t u = begin; u < end; ++u) {
          const Unit& unit = units[size_t(u)];
          if (unit.tile && unit.count > 1) {
            const TokenSlot& s = slots[size_t(unit.first)];
            const size_t off = size_t(unit.first) * q_dim + size_t(unit.kv_head) * group * head_dim;
            if (attend_kv_head_tile(cache, layer, *batch[size_t(s.entry)].table, s.pos + 1, unit.count, unit.kv_head,
                                    group, head_dim, q_.data() + off, size_t(q_dim), att_.data() + off,
                                    scratch_[size_t(thread)]))
              continue;
          }
          for (int64_t t = unit.first; t < unit.first + unit.count; ++t) {
            const TokenSlot& s = slots[size_t(t)];
            const BatchEntry& b = batch[size_t(s.entry)];
            const size_t off = size_t(t) * q_dim + size_t(unit.kv_head) * group * head_dim;
            const int32_t n_ctx = s.pos + 1;
            AttentionSparsity sparsity;
            SparsityPolicy* policy = b.policy;
            // Read-time choices apply to decode queries; prefill reads everything.
            if (policy != nullptr && policy->selects_reads() && b.decode) {
              // On a pool thread: the pool hands the throw to forward's caller.
              policy_call(size_t(s.entry),
                          [&] { policy->select(layer, unit.kv_head, q_.data() + off, group, n_ctx, ps.reads); });
              sparsity.blocks = ps.reads.blocks;
              sparsity.keep = ps.reads.keep;
              int64_t read = n_ctx;
              if (!ps.reads.keep.empty()) {
                read = std::count(ps.reads.keep.begin(), ps.reads.keep.end(), uint8_t(1));
              } else if (!ps.reads.blocks.empty()) {
                read = 0;
                for (int32_t blk : ps.reads.blocks) read += std::min(cache.block_size(), n_ctx - blk * cache.block_size());
              }
              policy->record_reads(read, n_ctx);
            }
            if (policy != nullptr && policy->wants_attention_weights()) {
              if (ps.weights.size() < size_t(n_ctx)) ps.weights.resize(size_t(n_ctx));
              sparsity.weights = ps.weights.data();
            }
            attend_kv_head(cache, layer, *b.table, n_ctx, unit.kv_head, group, head_dim, q_.data() + off,
                           att_.data() + off, scratch_[size_t(thread)], sparsity);
            if (sparsity.weights != nullptr)
              policy_call(size_t(s.entry), [&] { policy->observe(layer, unit.kv_head, sparsity.weights, n_ctx); });
          }
        }
      });
    }
    matmul(lw.wo, att_.data(), xb_.data(), n, &pool_);
    for (int64_t i = 0; i < n * dim; ++i) x_[size_t(i)] += xb_[size_t(i)];

    for (int64_t t = 0; t < n; ++t) rmsnorm(xb_.data() + t * dim, x_.data() + t * dim, lw.ffn_norm, dim, c.norm_eps);
    matmul_shared_input({&lw.w_gate, &lw.w_up}, {hb_.data(), hb2_.data()}, xb_.data(), n, &pool_);
    for (int64_t t = 0; t < n; ++t) silu_mul(hb_.data() + t * hidden, hb2_.data() + t * hidden, hidden);
    matmul(lw.w_down, hb_.data(), xb_.data(), n, &pool_);
    for (int64_t i = 0; i < n * dim; ++i) x_[size_t(i)] += xb_[size_t(i)];
  }

  // Final norm and classifier only for the tokens whose logits are wanted.
  int64_t r = 0, t0 = 0;
  for (const BatchEntry& b : batch) {
    const int64_t count = int64_t(b.tokens.size());
    const int64_t first = b.all_logits ? 0 : count - 1;
    for (int64_t i = std::max<int64_t>(first, 0); i < count; ++i, ++r)
      rmsnorm(rows_.data() + r * dim, x_.data() + (t0 + i) * dim, w.final_norm, dim, c.norm_eps);
    t0 += count;
  }
  out.vocab = c.vocab_size;
  out.values.resize(size_t(n_rows) * size_t(c.vocab_size));
  matmul(w.classifier, rows_.data(), out.values.data(), n_rows, &pool_);

  for (const BatchEntry& b : batch) cache.commit(*b.table, int32_t(b.tokens.size()));
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& b = batch[e];
    if (b.policy != nullptr) policy_call(e, [&] { b.policy->after_forward(cache, *b.table, int32_t(b.tokens.size())); });
  }
}

}  // namespace kvserve
