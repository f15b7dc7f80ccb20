// Attention of one query token over a sequence's paged KV: keys and values are
// read block by block through the block table, in each layer's codec, never
// gathered into a contiguous copy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_table.h"
#include "kv/kv_cache.h"

namespace kvserve {

// Per-thread scratch space, reused across calls.
struct AttentionScratch {
  std::vector<float> scores;  // (gqa_group, n_ctx rounded up to a block)
  std::vector<float> rotated; // (block_size, gqa_group, head_dim) queries for pre-RoPE keys
  std::vector<float> inv_sums; // (gqa_group) 1 / the sum of each query's unnormalized weights
  std::vector<float> tile_q;   // (tokens, gqa_group, head_dim) a prefill tile's queries (tile_attention.h)
  std::vector<float> tile_out; // (tokens, gqa_group, head_dim) its unnormalized outputs
  std::vector<float> tile_stats; // (2, tokens * gqa_group) each row's largest score, then its exp-sum
  std::vector<int32_t> positions; // (n_ctx) RoPE positions of pre-RoPE keys once they differ from slots
};

// What a sparsity policy asks of one attention call (issue 4). The default
// reads every block and reports nothing, at no extra cost.
struct AttentionSparsity {
  // Logical blocks to read, ascending, the query's own block included (read
  // time policies: Quest's top-K blocks); empty = every block. The softmax
  // runs over the blocks read.
  std::span<const int32_t> blocks;
  // When non-empty: (n_ctx) flags, only slots flagged 1 get weight (retrieved
  // keys, sinks and a window: ann). The blocks above still hold them all.
  std::span<const uint8_t> keep;
  // When set: (n_ctx) floats, the softmax weight of every slot summed over
  // the group's query heads (0 for slots not read or evicted). Policies that
  // score tokens by the attention they receive (h2o, snapkv) read it.
  float* weights = nullptr;
  // When set: (group, 2) floats, each query head's largest scaled score over
  // the blocks read and the sum of exp(score - largest). Passes over
  // disjoint block ranges then merge into the whole pass's output
  // (merge_attention_parts): decode splits a long context across threads.
  float* softmax_stats = nullptr;
};

// The attention output of the query heads that share KV head `kv_head`, for
// one query token that sees the first n_ctx slots of `table` (causal: n_ctx
// = its slot + 1). Slots evicted for this (layer, KV head) get no weight;
// keys stored before RoPE are rotated by their position in the table
// (KvCache::key_rope_position).
//   q:   (group, head_dim) floats — the group's query heads, RoPE applied
//   out: (group, head_dim) floats, overwritten
// Scores are scaled by 1/sqrt(head_dim) and softmax-normalised in fp32.
void attend_kv_head(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                    int kv_head, int group, int head_dim, const float* q, float* out,
                    AttentionScratch& scratch, const AttentionSparsity& sparsity = {});

// Merges `parts` attention outputs of one KV head's query group over disjoint
// block ranges into the output over their union, exactly as one pass would
// weigh them: part p's output (group, head_dim) at outs + p * group *
// head_dim, its softmax_stats at stats + p * group * 2. A part with no weight
// (nothing read, every slot evicted) adds nothing; out is (group, head_dim).
void merge_attention_parts(const float* outs, const float* stats, int parts, int group, int head_dim, float* out);

// Decode attention split across threads (flash-decoding): how many parts of
// consecutive blocks each of `units` (token, KV head) passes over n_ctx
// slots is cut into when the passes do not share out evenly (one sequence
// of a model with fewer KV heads than threads, or 8 KV heads on 3 or 6
// threads): the fewest parts, of at least min_part_tokens and at most one
// per thread, that leave the busiest thread the least work. 1 (no split)
// unless that takes a tenth off the busiest thread's share; parts are whole
// blocks.
int attention_parts(int64_t units, int threads, int32_t n_ctx, int32_t block_size, int32_t min_part_tokens);

// Scalar reference: decodes every live token with the codec and computes the
// same result in double precision. Same shapes as attend_kv_head; weights,
// when given, receives the softmax weights, (group, n_ctx).
void attend_kv_head_reference(const KvCache& cache, int layer, const BlockTable& table,
                              int32_t n_ctx, int kv_head, int group, int head_dim,
                              const float* q, float* out, std::vector<double>* weights = nullptr);

}  // namespace kvserve
