// One sequence's map from slots to physical KV blocks: slot s lives in block
// blocks[s / block_size] at offset s % block_size. Until a sparsity policy
// evicts tokens, slot s holds the token at position s.
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

struct BlockTable {
  std::vector<int32_t> blocks;   // physical block ids, in logical order
  // For quantized caches with a residual window: the FP16 staging slot that
  // holds each block's recent tokens until the block is encoded, or -1 (same
  // length as blocks). Empty for caches without a residual window.
  std::vector<int32_t> staging;
  int32_t num_tokens = 0;        // slots whose K/V are written, in tokens (live and evicted)

  // Tokens the table's blocks can hold (block_size each).
  int32_t capacity(int32_t block_size) const { return int32_t(blocks.size()) * block_size; }

  // ---- Eviction (KV sparsity, issue 4; KvCache "Eviction and compaction") ----
  // Once a sparsity policy evicts, a slot no longer equals its token's
  // position, and each (layer, KV head) keeps its own tokens: slot s of layer
  // l, head h holds the token at position slot_positions[(s * n_layers + l) *
  // n_kv_heads + h] in the text, or -1 when that token was evicted and its
  // slot not yet compacted away (attention skips it). (num_tokens, n_layers,
  // n_kv_heads); empty until the first eviction, meaning slot s holds
  // position s. Every (layer, head) has the same number of evicted slots.
  std::vector<int32_t> slot_positions;
  int32_t dead = 0;                 // evicted slots not yet compacted, per (layer, KV head), in tokens
  int32_t evicted = 0;              // tokens evicted so far, per (layer, KV head)
  // RoPE positions: the token's position in the text (default), or its
  // rank among the tokens the cache holds (positions within the cache, as
  // StreamingLLM: keys are stored before RoPE and rotated by their rank when
  // read). A rank counts no evicted slot, so it is the slot the token takes
  // once compaction closes the gaps: outputs do not depend on when that
  // happens (block size, compaction slack).
  bool positions_in_cache = false;

  // Tokens attention reads per (layer, KV head).
  int32_t live_tokens() const { return num_tokens - dead; }
  // The position in the text of a token appended at `slot`: the slot plus
  // the tokens compacted away before it.
  int32_t position_of_new(int32_t slot) const { return slot + evicted - dead; }
  // The position RoPE rotates a token appended at `slot` by (every evicted
  // slot lies before it).
  int32_t rope_position_of_new(int32_t slot) const { return positions_in_cache ? slot - dead : position_of_new(slot); }
};

}  // namespace kvserve
