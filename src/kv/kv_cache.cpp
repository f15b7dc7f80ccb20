#include "kv/kv_cache.h"

#include <cassert>

#include "util/error.h"

namespace kvserve {
namespace {

constexpr int32_t kMaxBlockSize = 1024;

// Bytes one block takes across all layers (K and V, every KV head).
size_t block_bytes_all_layers(const ModelConfig& m, const KvCacheOptions& o) {
  const KvCodec& codec = kv_codec(o.dtype);
  return size_t(m.n_layers) * 2 * size_t(m.n_kv_heads) * codec.slab_bytes(o.block_size, m.head_dim());
}

int32_t resolve_num_blocks(const ModelConfig& m, const KvCacheOptions& o) {
  if (o.block_size <= 0 || o.block_size > kMaxBlockSize)
    fail("--block-size {} is out of range (1..{})", o.block_size, kMaxBlockSize);
  if (o.num_blocks < 0 || o.budget_bytes < 0) fail("KV cache capacity cannot be negative");
  int64_t blocks = o.num_blocks;
  if (blocks == 0 && o.budget_bytes > 0) {
    blocks = o.budget_bytes / int64_t(block_bytes_all_layers(m, o));
    if (blocks == 0)
      fail("KV budget of {} bytes is smaller than one block ({} bytes)", o.budget_bytes,
           block_bytes_all_layers(m, o));
  }
  if (blocks == 0) blocks = (int64_t(m.seq_len) + o.block_size - 1) / o.block_size;
  if (blocks > (int64_t(1) << 30)) fail("KV cache of {} blocks is too large", blocks);
  return int32_t(blocks);
}

}  // namespace

KvCache::KvCache(const ModelConfig& model, const KvCacheOptions& options)
    : options_(options),
      n_kv_heads_(model.n_kv_heads),
      head_dim_(model.head_dim()),
      pool_(resolve_num_blocks(model, options)) {
  options_.num_blocks = pool_.num_blocks();
  layers_.resize(size_t(model.n_layers));
  for (auto& layer : layers_) {
    layer.k_codec = &kv_codec(options.dtype);
    layer.v_codec = &kv_codec(options.dtype);
    layer.k_slab_bytes = layer.k_codec->slab_bytes(options.block_size, head_dim_);
    layer.v_slab_bytes = layer.v_codec->slab_bytes(options.block_size, head_dim_);
    layer.block_bytes = size_t(n_kv_heads_) * (layer.k_slab_bytes + layer.v_slab_bytes);
    layer.arena = PageArena(layer.block_bytes * size_t(pool_.num_blocks()));
  }
}

int32_t KvCache::blocks_for(int64_t n_tokens) const {
  return int32_t((n_tokens + options_.block_size - 1) / options_.block_size);
}

bool KvCache::reserve(BlockTable& table, int32_t n_new) {
  int64_t needed = int64_t(blocks_for(int64_t(table.num_tokens) + n_new)) - int64_t(table.blocks.size());
  if (needed <= 0) return true;
  return pool_.allocate(int32_t(needed), table.blocks);
}

void KvCache::commit(BlockTable& table, int32_t n) {
  assert(table.num_tokens + n <= table.capacity(options_.block_size));
  table.num_tokens += n;
  tokens_stored_ += n;
}

void KvCache::release(BlockTable& table) {
  for (int32_t id : table.blocks) pool_.release(id);
  tokens_stored_ -= table.num_tokens;
  table.blocks.clear();
  table.num_tokens = 0;
}

uint8_t* KvCache::block_base(int layer, int32_t block) const {
  const Layer& l = layers_[size_t(layer)];
  return l.arena.data() + size_t(block) * l.block_bytes;
}

const uint8_t* KvCache::k_slab(int layer, int32_t block, int kv_head) const {
  return block_base(layer, block) + size_t(kv_head) * layers_[size_t(layer)].k_slab_bytes;
}

const uint8_t* KvCache::v_slab(int layer, int32_t block, int kv_head) const {
  const Layer& l = layers_[size_t(layer)];
  return block_base(layer, block) + size_t(n_kv_heads_) * l.k_slab_bytes + size_t(kv_head) * l.v_slab_bytes;
}

void KvCache::write(int layer, const BlockTable& table, int32_t pos, const float* k, const float* v) {
  assert(pos < table.capacity(options_.block_size));
  const Layer& l = layers_[size_t(layer)];
  const int32_t block = table.blocks[size_t(pos / options_.block_size)];
  const int slot = pos % options_.block_size;
  uint8_t* base = block_base(layer, block);
  for (int h = 0; h < n_kv_heads_; ++h) {
    l.k_codec->encode(base + size_t(h) * l.k_slab_bytes, slot, k + size_t(h) * head_dim_, head_dim_);
    l.v_codec->encode(base + size_t(n_kv_heads_) * l.k_slab_bytes + size_t(h) * l.v_slab_bytes, slot,
                      v + size_t(h) * head_dim_, head_dim_);
  }
}

size_t KvCache::bytes_per_block_all_layers() const {
  size_t total = 0;
  for (const auto& l : layers_) total += l.block_bytes;
  return total;
}

KvStats KvCache::stats() const {
  KvStats s;
  s.block_size = options_.block_size;
  s.bytes_per_block = int64_t(bytes_per_block_all_layers());
  s.bytes_per_token = s.bytes_per_block / options_.block_size;
  s.blocks_total = pool_.num_blocks();
  s.blocks_free = pool_.num_free();
  s.blocks_used = pool_.num_used();
  s.tokens_stored = tokens_stored_;
  s.bytes_used = int64_t(s.blocks_used) * s.bytes_per_block;
  s.bytes_capacity = int64_t(s.blocks_total) * s.bytes_per_block;
  const int64_t slots = int64_t(s.blocks_used) * options_.block_size;
  s.fragmentation = slots == 0 ? 0.0 : 1.0 - double(tokens_stored_) / double(slots);
  return s;
}

}  // namespace kvserve
