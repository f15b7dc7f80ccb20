// Prefill attention over a tile of consecutive query tokens of one sequence.
//
// attend_kv_head reads a sequence's whole KV for every query token: a 512-
// token prefill chunk at 16K context streams each layer's KV from DRAM 512
// times, and the kernels wait on memory. A tile reads each block once for
// all its tokens: every codec kernel already scores and accumulates any
// number of query rows against a block, so the tile's rows (token, query
// head) go through the same kernels, with the same numbers per row, while
// the block stays in L1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/paged_attention.h"

namespace kvserve {

// Tokens of the context a tile scores before it weighs values: one part's
// scores for 48 rows, 768 KB, stay in L2 between its two passes.
constexpr int32_t kTilePartTokens = 4096;

// The attention output of KV head `kv_head`'s query group for `tokens`
// consecutive query tokens of `table`: token i sees the first n_ctx0 + i
// slots (causal). Each token's rows read the block views it would read alone
// (a block still staged in FP16 for an earlier token may be sealed for a
// later one), so every row equals attend_kv_head's result for its token, up
// to float rounding.
//   q:   token i's group at q + i * stride: (group, head_dim) floats, RoPE applied
//   out: token i's group at out + i * stride, overwritten
// Keys stored before RoPE in spans (the int2 presets) rotate the tile's rows
// once per span, as attend_kv_head rotates its group. Returns false, writing
// nothing, where the layer needs attend_kv_head per token: keys stored
// exactly before RoPE (a rotated query per position), keys in spans once
// slots are no longer positions (after compaction), or evicted slots not
// yet compacted.
// The context goes in parts of part_tokens (whole blocks), each a two-pass
// softmax whose scores stay in L2, merged as they come (online softmax):
// the scratch does not grow with the context.
bool attend_kv_head_tile(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx0, int tokens,
                         int kv_head, int group, int head_dim, const float* q, size_t stride, float* out,
                         AttentionScratch& scratch, int32_t part_tokens = kTilePartTokens);

}  // namespace kvserve
