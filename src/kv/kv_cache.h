// The paged KV cache: a BlockPool of fixed-size blocks and, per layer, an arena
// indexed by block id holding that layer's K block then V block, each in the
// layer's own codec (mixed precision per layer costs no extra tables).
//
// Residual window (KIVI): with quantized codecs the most recent `residual`
// tokens stay in FP16. Their blocks also own a staging slot (one block of FP16
// K and V for every layer); a block is encoded into its quantized form once
// `residual - block_size` newer tokens exist (with the default residual of one
// block: as soon as it fills), then its staging slot returns to a LIFO free
// list, so resident staging memory stays bounded by the open blocks. Whether
// attention reads block b from staging or from its codec follows from the
// query's position alone (sealed_blocks), so a prefill chunk sees exactly what
// token-by-token decode would have seen.
//
// Capacity is fixed at construction (in blocks or bytes); nothing is allocated
// per sequence, so the only waste is the unfilled tail of each sequence's last
// block. A byte budget covers the FP16 staging slots too: each slot in use
// holds enough pool blocks (never written, so never resident) to pay for its
// bytes, so blocks plus staging never exceed the budget. Staging slots are
// taken only for the blocks the next write lands in (reserve's n_write), not
// for a whole reserved prompt. A capacity given in blocks counts encoded
// blocks only; staging then comes on top.
//
// Thread safety: reserve/commit/release/seal and the sharing calls from one
// thread (the engine's).
// Reads and writes of different (layer, block) pairs may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kernels/rope_table.h"
#include "kv/kv_codec.h"
#include "model/model_config.h"
#include "util/page_arena.h"

namespace kvserve {

constexpr int32_t kMaxBlockSize = 1024;  // tokens per KV block, at most

struct KvLayerCodecs {
  KvCodecConfig k;
  KvCodecConfig v;
};

struct KvCacheOptions {
  int32_t block_size = 16;        // tokens per block
  KvCodecConfig k;                // keys of every layer (unless `layers` overrides)
  KvCodecConfig v;                // values of every layer
  std::vector<KvLayerCodecs> layers;  // empty, or one entry per layer (mixed precision)
  int32_t residual = -1;          // tokens kept in FP16 before encoding (multiple of block_size);
                                  // -1 = one block; 0 whatever is given when no codec is quantized
  int64_t num_blocks = 0;         // capacity in blocks; 0 means "derive from budget_bytes"
  int64_t budget_bytes = 0;       // capacity in bytes when num_blocks is 0; when both are 0,
                                  // enough blocks for one sequence of the model's full context

  // Sets keys and values of every layer to the plain storage type t.
  void set_dtype(KvDType t) { k.dtype = v.dtype = t; }
};

// Exact accounting, all sizes in bytes unless stated.
struct KvStats {
  int64_t bytes_per_token = 0;    // K + V of one encoded token over all layers, metadata included
  int64_t bytes_per_block = 0;    // one block over all layers
  int64_t staging_bytes_per_block = 0;  // one FP16 staging slot (0 without a residual window)
  int32_t block_size = 0;         // tokens per block
  int32_t residual = 0;           // tokens kept in FP16
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;         // blocks holding tokens (staging's pool share excluded)
  int32_t blocks_free = 0;
  int32_t blocks_for_staging = 0;  // pool blocks that pay for staging slots in use (byte budgets)
  int32_t blocks_cached_idle = 0; // prefix-cache blocks no sequence references (reclaimable)
  int32_t staging_used = 0;       // staging slots in use
  int64_t tokens_stored = 0;      // tokens written into live sequences (not evicted)
  int64_t bytes_used = 0;         // blocks_used * bytes_per_block + staging_used * staging_bytes_per_block
  int64_t bytes_capacity = 0;     // blocks_total * bytes_per_block (staging included with a byte budget)
  double fragmentation = 0.0;     // unused fraction of the slots in used blocks, 0..1
  int64_t tokens_evicted = 0;     // tokens evicted by sparsity policies so far, per (layer, KV head)
  int64_t compactions = 0;        // compact() calls that moved tokens
};

// Where attention reads one layer's K or V of one block.
struct KvBlockView {
  const KvCodec* codec;
  const uint8_t* data;
};

class KvCache {
 public:
  // Throws kvserve::Error on invalid options (block size, budget below one
  // block, codec combinations, residual not a multiple of the block size).
  KvCache(const ModelConfig& model, const KvCacheOptions& options);

  const KvCacheOptions& options() const { return options_; }
  int32_t block_size() const { return options_.block_size; }
  int32_t residual() const { return residual_; }
  // Whether some layer keeps its newest tokens in FP16 (an integer codec with a residual window).
  bool staged() const { return staged_; }
  int n_layers() const { return int(layers_.size()); }

  // Makes room for n_new more tokens after table.num_tokens, allocating blocks
  // as needed, and staging slots for the blocks the first n_write of them
  // land in (default all n_new: a caller reserving a whole prompt but writing
  // a chunk passes the chunk, and reserves again before each later chunk); a
  // shared partially filled last block is copied first (copy-on-write, see
  // "Sharing"). Returns false, changing nothing, when the pool has too few
  // free blocks: an ordinary result the caller handles.
  [[nodiscard]] bool reserve(BlockTable& table, int32_t n_new, int32_t n_write = -1);
  // Marks n tokens after table.num_tokens as written (every layer written and
  // sealed); frees the staging slots of blocks now encoded.
  void commit(BlockTable& table, int32_t n);
  // Returns all of the table's blocks (tail first, so a prefix cache evicts
  // chain tails before their parents) and staging slots, and empties it.
  void release(BlockTable& table);

  // Blocks a sequence of n tokens needs.
  int32_t blocks_for(int64_t n_tokens) const;
  // Whether a sequence of n_tokens, written at most chunk_tokens at a time,
  // could ever fit (the whole pool, ignoring other sequences; staging slots
  // included where the budget pays for them).
  bool fits(int64_t n_tokens, int64_t chunk_tokens = 1) const;
  // The most tokens one sequence may hold by fits() (0: not even one). With
  // a byte budget and a residual window this is below blocks * block_size:
  // the FP16 staging of the window and of a prefill chunk takes pool blocks.
  int64_t max_tokens(int64_t chunk_tokens = 1) const;
  // Pool blocks one staging slot in use holds (0: a capacity in blocks, or no staging).
  int32_t staging_cost_blocks() const { return staging_cost_; }

  // Writes the K and V of token `pos` in `layer`. k, v: (kv_dim) floats.
  // REQUIRES: pos < table capacity.
  void write(int layer, const BlockTable& table, int32_t pos, const float* k, const float* v);
  // Encodes `layer`'s blocks that become sealed when the table holds n_tokens
  // tokens (call after writing the layer, before attention reads it).
  void seal(int layer, const BlockTable& table, int32_t n_tokens);
  // Blocks of a sequence of n_ctx tokens that are read in encoded form; the
  // rest are read from FP16 staging.
  int32_t sealed_blocks(int32_t n_ctx) const;

  // Where attention over the first n_ctx tokens reads block index b (logical).
  KvBlockView k_view(int layer, const BlockTable& table, int32_t b, int32_t n_ctx) const;
  KvBlockView v_view(int layer, const BlockTable& table, int32_t b, int32_t n_ctx) const;
  // Whether `layer` stores keys before RoPE; attention then rotates queries
  // with rope_table() instead.
  bool k_pre_rope(int layer) const { return layers_[size_t(layer)].k->config().pre_rope; }
  // Pre-RoPE keys' span (KvCodecConfig::rope_span): the key of the token at
  // position p is stored rotated by p mod span. 1 = exactly before RoPE.
  int k_rope_span(int layer) const { return layers_[size_t(layer)].k->config().rope_span; }
  const RopeTable& rope_table() const { return *rope_table_; }  // REQUIRES: some layer keeps keys before RoPE
  const RopeTable* rope_table_if_any() const { return rope_table_.get(); }
  // RoPE's angle per position for each pair of a head (the model's, scaling applied).
  const float* rope_frequencies() const { return rope_freqs_.data(); }
  const KvCodec& k_codec(int layer) const { return *layers_[size_t(layer)].k; }
  const KvCodec& v_codec(int layer) const { return *layers_[size_t(layer)].v; }

  const BlockPool& pool() const { return pool_; }
  KvStats stats() const;

  // ---- Sharing: forks, copy-on-write, the prefix cache (kv/prefix_cache.h) ----
  // A block with ref_count > 1 is never written: full blocks take no more
  // tokens, and reserve() copies a shared, partially filled last block before
  // tokens are appended to it. Staging slots are reference counted too: the
  // FP16 staging of a full block no longer changes, so forks and the prefix
  // cache share it instead of copying. A block is "sealed" once its encoded
  // form is written (all layers); seal() never encodes a block twice, so
  // sequences sharing a block never write into it.

  // Makes the empty dst a copy of src sharing src's blocks up to
  // src.num_tokens (blocks reserved beyond are not shared). The open block's
  // staging slot, if any, is copied into a new slot, since both sequences
  // keep writing there. Returns false, changing nothing, when no staging slot
  // is free.
  [[nodiscard]] bool fork(const BlockTable& src, BlockTable& dst);
  // Starts the empty table with shared full, final blocks (a prefix-cache
  // hit): one reference per block (idle cached blocks come back into use)
  // and, where staging[i] >= 0, one reference to that slot, which holds block
  // i's FP16 form for queries that read it from the residual window.
  // staging: empty or blocks.size() slots.
  void attach_prefix(BlockTable& table, std::span<const int32_t> blocks, std::span<const int32_t> staging);
  // Encodes, in every layer, the table's full blocks still held in FP16
  // staging (they keep their staging slot), so they become final and can be
  // shared. Used when a sequence finishes.
  void seal_full_blocks(const BlockTable& table);
  // Whether block b of the table is full and in its final stored form.
  bool block_final(const BlockTable& table, int32_t b) const;
  // Of the first n_blocks full blocks of a sequence, how many at the end a
  // query at position n_blocks * block_size reads from FP16 staging (0
  // without a residual window longer than one block).
  int32_t staged_before(int32_t n_blocks) const;
  void retain_staging(int32_t slot) { ++staging_refs_[size_t(slot)]; }
  void release_staging(int32_t slot);
  // The pool, for the prefix cache that marks, revives and evicts cached blocks.
  BlockPool& shared_pool() { return pool_; }

  // --- Block export and import (the tiered KV store, issue 7) ---
  // A sealed block's K and V of every layer, exactly as stored (codes and
  // metadata: an INT4 block travels as INT4 with its scales), moved to and
  // from the tiers below memory (src/store/). Layout: per layer in order, its
  // K block then its V block, k_codec(l).block_bytes() + v_codec(l).block_bytes().

  // The bytes export_block writes (equals stats().bytes_per_block).
  size_t block_record_bytes() const;
  // A hash of everything that gives those bytes their meaning: the block
  // shape and each layer's K and V codec (type, grouping, group size, static
  // ranges, pre-RoPE). Blocks move only between caches whose hashes are equal;
  // the store's record header carries it and refuses any other.
  uint64_t block_codec_hash() const;
  // Copies block `block` into out (resized to block_record_bytes()).
  // REQUIRES: the block is sealed in every layer (its FP16 staging slot, if
  // any, is not exported: only the encoded form is).
  void export_block(int32_t block, std::vector<uint8_t>& out) const;
  // Overwrites block `block` with bytes exported by a cache with the same
  // block_codec_hash(). Throws kvserve::Error when the size differs.
  // Attention reads the block in encoded form only at positions where it is
  // sealed; with a residual window a sequence that reuses k imported blocks
  // must therefore import only blocks b < sealed_blocks(k * block_size + 1)
  // and recompute the rest (their next queries read FP16 staging).
  void import_block(int32_t block, std::span<const uint8_t> bytes);

  // ---- Eviction and compaction (KV sparsity, issue 4) ----
  // Evicting sparsity policies drop tokens per (layer, KV head), the same
  // number in each, so every head keeps the same count and the block table
  // stays shared by all layers and heads (see BlockTable::slot_positions).
  // evict() only marks: attention skips the slots at once. compact() then
  // moves each (layer, head)'s live tokens down, in order, to slots [0, live)
  // and returns the emptied blocks and their staging slots to the pool.
  // Keeping the order keeps the newest tokens in the FP16 residual window.
  //
  // Codecs: a token whose head data sits apart (token_spans: fp32/fp16/bf16,
  // head-major token groups, q4_0 with 32 | head_dim, static channel scales)
  // moves as bytes, exactly. A block of a codec without spans (dynamic
  // channel groups, groups spanning heads) is decoded and re-encoded when its
  // contents change: one more rounding of the tokens in that block, bounded by
  // half a step of its new grid; blocks whose tokens stay put are untouched.
  // Tokens crossing the residual boundary are encoded as sealing would
  // encode them (staging to block) or decoded into FP16 staging (block to
  // staging, only when a policy evicts inside the residual window).
  //
  // Shared blocks (ref_count > 1, prefix caching) are never written: a block
  // that must change is copied to a fresh block first (copy on write).

  // Marks `per_head` slots of every (layer, KV head) evicted; slots is
  // (n_layers, n_kv_heads, per_head) slot indices of live tokens. Throws
  // kvserve::Error, changing nothing, for a slot out of range, evicted twice
  // or a size mismatch.
  void evict(BlockTable& table, std::span<const int32_t> slots, int32_t per_head);
  // Compacts the evicted slots away (see above). Returns false, changing
  // nothing, when shared blocks need copies and too few blocks are free; the
  // evicted slots then stay masked until a later call succeeds.
  [[nodiscard]] bool compact(BlockTable& table);
  // The position of the token in `slot` of (layer, kv_head): its RoPE
  // position and causal order. -1 once evicted.
  int32_t slot_position(const BlockTable& table, int layer, int kv_head, int32_t slot) const {
    const size_t i = (size_t(slot) * size_t(layers_.size()) + size_t(layer)) * size_t(n_kv_heads_) + size_t(kv_head);
    return i < table.slot_positions.size() ? table.slot_positions[i] : table.position_of_new(slot);
  }
  // The keys of slots [begin, end) of `layer` after RoPE, as attention scores
  // them: decoded from the blocks (or their FP16 staging) and, when stored
  // before RoPE, rotated by their position. out: (end - begin, kv_dim)
  // floats. For policies that index keys and were not there when these were
  // written (a prefix-cache hit).  REQUIRES: end <= table.num_tokens.
  void read_keys(int layer, const BlockTable& table, int32_t begin, int32_t end, float* out) const;
  // The position RoPE rotates the key in `slot` by (pre-RoPE keys): with
  // positions in the cache its rank among the slots not evicted (O(slot)
  // while evicted slots wait for compaction), else the token's position.
  int32_t key_rope_position(const BlockTable& table, int layer, int kv_head, int32_t slot) const;
  // The same for slots [0, n) at once, in O(n): out holds n positions
  // (meaningless for evicted slots).
  void key_rope_positions(const BlockTable& table, int layer, int kv_head, int32_t n, int32_t* out) const;

 private:
  struct Layer {
    std::unique_ptr<KvCodec> k, v;
    bool k_staged = false, v_staged = false;  // encoded via the FP16 staging slot
    size_t k_bytes = 0, v_bytes = 0;          // one block of K / V in this layer's codecs
    PageArena arena;                          // (num_blocks, k_bytes + v_bytes)
    PageArena staging;                        // (num_blocks, 2 * staging_bytes) when staged
  };

  uint8_t* block_base(int layer, int32_t block) const;
  uint8_t* staging_base(int layer, int32_t slot) const;
  // Takes n free staging slots, each with its staging_cost_ pool blocks, and
  // appends them to out; false, taking nothing, when either is short.
  bool take_staging(int32_t n, std::vector<int32_t>& out);

  KvCacheOptions options_;
  int n_kv_heads_ = 0;
  int head_dim_ = 0;
  std::vector<float> rope_freqs_;  // (head_dim / 2)
  int32_t residual_ = 0;
  bool staged_ = false;                      // any layer uses staging
  std::unique_ptr<KvCodec> staging_codec_;   // FP16, one block of one layer's K or V
  std::unique_ptr<RopeTable> rope_table_;    // when some layer keeps keys before RoPE
  std::vector<Layer> layers_;                // (n_layers)
  BlockPool pool_;
  std::vector<int32_t> free_staging_;        // LIFO: reuse the warmest slots first
  std::vector<int32_t> staging_refs_;        // (num_blocks) references per staging slot
  int32_t staging_cost_ = 0;                 // pool blocks held per staging slot in use
  std::vector<int32_t> staging_ballast_;     // (num_blocks, staging_cost_) the blocks each slot holds
  int32_t ballast_blocks_ = 0;               // pool blocks held for staging now
  std::vector<uint8_t> sealed_;              // (num_blocks) 1 once a block's encoded form is written
  int64_t tokens_stored_ = 0;
  int64_t tokens_evicted_ = 0;
  int64_t compactions_ = 0;
};

}  // namespace kvserve
