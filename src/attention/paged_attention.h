// Attention of one query token over a sequence's paged KV: keys and values are
// read block by block through the block table, in each layer's codec, never
// gathered into a contiguous copy.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/block_table.h"
#include "kv/kv_cache.h"

namespace kvserve {

// Per-thread scratch space, reused across calls.
struct AttentionScratch {
  std::vector<float> scores;  // (gqa_group, n_ctx rounded up to a block)
  std::vector<float> rotated; // (block_size, gqa_group, head_dim) queries for pre-RoPE keys
};

// The attention output of the query heads that share KV head `kv_head`, for
// one query token that sees the first n_ctx tokens of `table` (causal: n_ctx
// = its position + 1).
//   q:   (group, head_dim) floats — the group's query heads, RoPE applied
//   out: (group, head_dim) floats, overwritten
// Scores are scaled by 1/sqrt(head_dim) and softmax-normalised in fp32.
void attend_kv_head(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                    int kv_head, int group, int head_dim, const float* q, float* out,
                    AttentionScratch& scratch);

// Scalar reference: decodes every token with the codec and computes the same
// result in double precision. Same shapes as attend_kv_head.
void attend_kv_head_reference(const KvCache& cache, int layer, const BlockTable& table,
                              int32_t n_ctx, int kv_head, int group, int head_dim,
                              const float* q, float* out);

}  // namespace kvserve
