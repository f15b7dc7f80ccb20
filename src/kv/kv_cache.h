// The paged KV cache: a BlockPool of fixed-size blocks and, per layer, an arena
// indexed by block id holding that layer's K and V slabs.
//
// Layout of block b in layer l's arena (bytes):
//   [K slab of kv head 0] ... [K slab of kv head H-1] [V slab of head 0] ... [V slab of head H-1]
// each slab being (block_size tokens, head_dim) values in the layer's codec.
// Capacity is fixed at construction (in blocks or bytes); nothing is allocated
// per sequence, so there is no contiguous per-request reservation and the only
// waste is the unfilled tail of each sequence's last block.
//
// Thread safety: reserve/commit/release from one thread (the engine's). Slab
// reads and writes of different (layer, block) pairs may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_codec.h"
#include "model/model_config.h"
#include "util/page_arena.h"

namespace kvserve {

struct KvCacheOptions {
  int32_t block_size = 16;        // tokens per block
  KvDType dtype = KvDType::F32;   // K and V storage in every layer
  int64_t num_blocks = 0;         // capacity in blocks; 0 means "derive from budget_bytes"
  int64_t budget_bytes = 0;       // capacity in bytes when num_blocks is 0; when both are 0,
                                  // enough blocks for one sequence of the model's full context
};

// Exact accounting, all sizes in bytes unless stated.
struct KvStats {
  int64_t bytes_per_token = 0;    // K + V of one token over all layers, metadata included
  int64_t bytes_per_block = 0;    // bytes_per_token * block_size
  int32_t block_size = 0;         // tokens per block
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;
  int32_t blocks_free = 0;
  int64_t tokens_stored = 0;      // tokens written into live sequences
  int64_t bytes_used = 0;         // blocks_used * bytes_per_block
  int64_t bytes_capacity = 0;     // blocks_total * bytes_per_block
  double fragmentation = 0.0;     // unused fraction of the slots in used blocks, 0..1
};

class KvCache {
 public:
  // Throws kvserve::Error on invalid options (block size, budget < one block).
  KvCache(const ModelConfig& model, const KvCacheOptions& options);

  const KvCacheOptions& options() const { return options_; }
  int32_t block_size() const { return options_.block_size; }

  // Makes room for n_new more tokens after table.num_tokens, allocating blocks
  // as needed. Returns false, changing nothing, when the pool has too few free
  // blocks: an ordinary result the caller handles (preempt, reject, wait).
  [[nodiscard]] bool reserve(BlockTable& table, int32_t n_new);
  // Marks n tokens after table.num_tokens as written. REQUIRES: reserved.
  void commit(BlockTable& table, int32_t n);
  // Returns all of the table's blocks to the pool and empties it.
  void release(BlockTable& table);

  // Blocks a sequence of n tokens needs.
  int32_t blocks_for(int64_t n_tokens) const;
  // Whether n_tokens could ever fit (the whole pool, ignoring other sequences).
  bool fits(int64_t n_tokens) const { return blocks_for(n_tokens) <= pool_.num_blocks(); }

  // Writes the K and V of token `pos` of the table in `layer`.
  // k, v: (n_kv_heads, head_dim) floats.  REQUIRES: pos < table capacity.
  void write(int layer, const BlockTable& table, int32_t pos, const float* k, const float* v);

  // The K or V slab of (layer, block, kv_head).
  const uint8_t* k_slab(int layer, int32_t block, int kv_head) const;
  const uint8_t* v_slab(int layer, int32_t block, int kv_head) const;
  const KvCodec& k_codec(int layer) const { return *layers_[size_t(layer)].k_codec; }
  const KvCodec& v_codec(int layer) const { return *layers_[size_t(layer)].v_codec; }

  const BlockPool& pool() const { return pool_; }
  KvStats stats() const;

 private:
  struct Layer {
    const KvCodec* k_codec = nullptr;
    const KvCodec* v_codec = nullptr;
    size_t k_slab_bytes = 0;  // one (block_size, head_dim) K slab
    size_t v_slab_bytes = 0;
    size_t block_bytes = 0;   // all K and V slabs of one block in this layer
    PageArena arena;          // (num_blocks, block_bytes)
  };

  uint8_t* block_base(int layer, int32_t block) const;
  size_t bytes_per_block_all_layers() const;

  KvCacheOptions options_;
  int n_kv_heads_ = 0;
  int head_dim_ = 0;
  std::vector<Layer> layers_;  // (n_layers)
  BlockPool pool_;
  int64_t tokens_stored_ = 0;
};

}  // namespace kvserve
