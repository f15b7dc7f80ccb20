#include "kv/kv_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {
namespace {

KvBlockShape block_shape(const ModelConfig& m, const KvCacheOptions& o) {
  return KvBlockShape{o.block_size, m.n_kv_heads, m.head_dim()};
}

}  // namespace

KvCache::KvCache(const ModelConfig& model, const KvCacheOptions& options)
    : options_(options),
      n_kv_heads_(model.n_kv_heads),
      head_dim_(model.head_dim()),
      rope_freqs_(model.rope_frequencies()),
      pool_([&] {
        if (options.block_size <= 0 || options.block_size > kMaxBlockSize)
          fail("--block-size {} is out of range (1..{})", options.block_size, kMaxBlockSize);
        if (!options.layers.empty() && options.layers.size() != size_t(model.n_layers))
          fail("per-layer KV codecs given for {} layers, the model has {}", options.layers.size(), model.n_layers);
        if (options.num_blocks < 0 || options.budget_bytes < 0) fail("KV cache capacity cannot be negative");
        // Build the codecs first: the block size in bytes decides the capacity.
        const KvBlockShape shape = block_shape(model, options);
        bool quantized = false;
        for (int l = 0; l < model.n_layers; ++l) {
          const KvLayerCodecs lc = options.layers.empty() ? KvLayerCodecs{options.k, options.v} : options.layers[size_t(l)];
          Layer layer;
          layer.k = make_kv_codec(lc.k, shape);
          layer.v = make_kv_codec(lc.v, shape);
          layer.k_bytes = layer.k->block_bytes();
          layer.v_bytes = layer.v->block_bytes();
          quantized = quantized || kv_dtype_is_quantized(lc.k.dtype) || kv_dtype_is_quantized(lc.v.dtype);
          layers_.push_back(std::move(layer));
        }
        residual_ = options.residual < 0 ? options.block_size : options.residual;
        if (residual_ % options.block_size != 0)
          fail("--kv-residual {} must be a multiple of the block size {}", residual_, options.block_size);
        // Float codecs stage nothing: no window exists to report (a preset's
        // window after --kv-dtype fp16, as the float presets set 0).
        if (!quantized) residual_ = 0;
        for (auto& layer : layers_) {
          layer.k_staged = residual_ > 0 && kv_dtype_is_quantized(layer.k->dtype());
          layer.v_staged = residual_ > 0 && kv_dtype_is_quantized(layer.v->dtype());
          if ((!layer.k_staged && !layer.k->encodes_tokens()) || (!layer.v_staged && !layer.v->encodes_tokens()))
            fail("KV codecs that encode whole blocks (per-channel groups, 8-bit scales) need a residual window "
                 "of at least one block (--kv-residual {})",
                 options.block_size);
          staged_ = staged_ || layer.k_staged || layer.v_staged;
        }
        for (const auto& layer : layers_) {
          if (layer.v->config().pre_rope) fail("pre-RoPE storage applies to keys only");
          if (layer.k->config().pre_rope && layer.k->config().is_static())
            fail("pre-RoPE keys with static scales are not supported (calibration measures keys after RoPE)");
          if (layer.k->config().pre_rope && !rope_table_)
            rope_table_ = std::make_unique<RopeTable>(model.seq_len, model.head_dim(), rope_freqs_);
        }
        if (staged_) {
          KvCodecConfig fp16;
          fp16.dtype = KvDType::F16;
          staging_codec_ = make_kv_codec(fp16, shape);
        }
        size_t block_bytes = 0;
        for (const auto& layer : layers_) block_bytes += layer.k_bytes + layer.v_bytes;
        int64_t blocks = options.num_blocks;
        if (blocks == 0 && options.budget_bytes > 0) {
          blocks = options.budget_bytes / int64_t(block_bytes);
          if (blocks == 0)
            fail("KV budget of {} bytes is smaller than one block ({} bytes)", options.budget_bytes, block_bytes);
        }
        if (blocks == 0) blocks = (int64_t(model.seq_len) + options.block_size - 1) / options.block_size;
        if (blocks > (int64_t(1) << 30)) fail("KV cache of {} blocks is too large", blocks);
        return int32_t(blocks);
      }()) {
  options_.num_blocks = pool_.num_blocks();
  const size_t n = size_t(pool_.num_blocks());
  for (auto& layer : layers_) {
    layer.arena = PageArena((layer.k_bytes + layer.v_bytes) * n);
    if (layer.k_staged || layer.v_staged) layer.staging = PageArena(2 * staging_codec_->block_bytes() * n);
  }
  sealed_.assign(n, 0);
  if (staged_) {
    free_staging_.resize(n);
    for (size_t i = 0; i < n; ++i) free_staging_[i] = int32_t(n - 1 - i);  // pop_back yields 0, 1, 2, ...
    staging_refs_.assign(n, 0);
    // A byte budget pays for staging: a slot in use holds the pool blocks its bytes are worth.
    if (options.num_blocks == 0 && options.budget_bytes > 0) {
      const KvStats s = stats();
      staging_cost_ = int32_t((s.staging_bytes_per_block + s.bytes_per_block - 1) / s.bytes_per_block);
      staging_ballast_.assign(n * size_t(staging_cost_), -1);
    }
  }
}

bool KvCache::fits(int64_t n_tokens, int64_t chunk_tokens) const {
  int64_t staging = 0;
  if (staging_cost_ > 0) {
    // Slots held at once: the unsealed blocks behind the write and the blocks of one chunk.
    const int64_t window = residual_ / options_.block_size + 1 + blocks_for(std::max<int64_t>(chunk_tokens, 1));
    staging = std::min<int64_t>(blocks_for(n_tokens), window) * staging_cost_;
  }
  return blocks_for(n_tokens) + staging <= pool_.num_blocks();
}

int64_t KvCache::max_tokens(int64_t chunk_tokens) const {
  // fits() only grows harder with n: the largest n it accepts, by bisection.
  int64_t lo = 0, hi = int64_t(pool_.num_blocks()) * options_.block_size;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid, chunk_tokens)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

bool KvCache::take_staging(int32_t n, std::vector<int32_t>& out) {
  if (n <= 0) return true;
  if (free_staging_.size() < size_t(n)) return false;
  std::vector<int32_t> ballast;
  // Reclaiming idle prefix-cache blocks here may release their sidecar slots:
  // free_staging_ only grows meanwhile.
  if (staging_cost_ > 0 && !pool_.allocate(n * staging_cost_, ballast)) return false;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t slot = free_staging_.back();
    free_staging_.pop_back();
    staging_refs_[size_t(slot)] = 1;
    for (int32_t c = 0; c < staging_cost_; ++c)
      staging_ballast_[size_t(slot) * size_t(staging_cost_) + size_t(c)] = ballast[size_t(i * staging_cost_ + c)];
    out.push_back(slot);
  }
  ballast_blocks_ += n * staging_cost_;
  return true;
}

int32_t KvCache::blocks_for(int64_t n_tokens) const {
  return int32_t((n_tokens + options_.block_size - 1) / options_.block_size);
}

int32_t KvCache::sealed_blocks(int32_t n_ctx) const {
  if (!staged_) return blocks_for(n_ctx);
  const int32_t lag = residual_ - options_.block_size;  // newer tokens a full block waits for
  return n_ctx > lag ? (n_ctx - lag) / options_.block_size : 0;
}

bool KvCache::reserve(BlockTable& table, int32_t n_new, int32_t n_write) {
  const int32_t bs = options_.block_size;
  if (n_write < 0 || n_write > n_new) n_write = n_new;
  const int64_t needed =
      std::max<int64_t>(0, int64_t(blocks_for(int64_t(table.num_tokens) + n_new)) - int64_t(table.blocks.size()));
  // Copy-on-write: the next token would land in a partially filled block
  // another sequence (a fork) shares.
  const size_t open = size_t(table.num_tokens / bs);
  const bool copy = n_new > 0 && table.num_tokens % bs != 0 && pool_.ref_count(table.blocks[open]) > 1;
  // The blocks the next n_write tokens land in need a staging slot.
  std::vector<size_t> stage;
  if (staged_ && n_write > 0) {
    const size_t last = size_t(blocks_for(int64_t(table.num_tokens) + n_write));
    for (size_t b = open; b < last; ++b)
      if (b >= table.staging.size() || table.staging[b] < 0) stage.push_back(b);
  }
  if (needed == 0 && !copy && stage.empty()) return true;
  std::vector<int32_t> fresh;
  if (!pool_.allocate(int32_t(needed) + (copy ? 1 : 0), fresh)) return false;
  std::vector<int32_t> slots;
  if (!take_staging(int32_t(stage.size()), slots)) {
    for (int32_t id : fresh) pool_.release(id);
    return false;
  }
  for (int32_t id : fresh) sealed_[size_t(id)] = 0;
  size_t next = 0;
  if (copy) {
    const int32_t from = table.blocks[open], to = fresh[next++];
    for (int l = 0; l < n_layers(); ++l) {
      const Layer& layer = layers_[size_t(l)];
      std::memcpy(block_base(l, to), block_base(l, from), layer.k_bytes + layer.v_bytes);
    }
    pool_.release(from);
    table.blocks[open] = to;
  }
  table.blocks.insert(table.blocks.end(), fresh.begin() + long(next), fresh.end());
  if (staged_) {
    table.staging.resize(table.blocks.size(), -1);
    for (size_t i = 0; i < stage.size(); ++i) table.staging[stage[i]] = slots[i];
  }
  return true;
}

void KvCache::commit(BlockTable& table, int32_t n) {
  assert(table.num_tokens + n <= table.capacity(options_.block_size));
  if (!table.slot_positions.empty()) {  // after an eviction, positions are explicit
    const size_t per_slot = layers_.size() * size_t(n_kv_heads_);
    for (int32_t s = table.num_tokens; s < table.num_tokens + n; ++s)
      table.slot_positions.insert(table.slot_positions.end(), per_slot, table.position_of_new(s));
  }
  table.num_tokens += n;
  tokens_stored_ += n;
  if (!staged_) return;
  const int32_t sealed = std::min<int32_t>(sealed_blocks(table.num_tokens), int32_t(table.staging.size()));
  for (int32_t b = 0; b < sealed; ++b) {
    if (table.staging[size_t(b)] < 0) continue;
    sealed_[size_t(table.blocks[size_t(b)])] = 1;
    release_staging(table.staging[size_t(b)]);
    table.staging[size_t(b)] = -1;
  }
}

void KvCache::release(BlockTable& table) {
  for (auto id = table.blocks.rbegin(); id != table.blocks.rend(); ++id) pool_.release(*id);
  for (int32_t slot : table.staging)
    if (slot >= 0) release_staging(slot);
  tokens_stored_ -= table.live_tokens();
  table = BlockTable{};
}

uint8_t* KvCache::block_base(int layer, int32_t block) const {
  const Layer& l = layers_[size_t(layer)];
  return l.arena.data() + size_t(block) * (l.k_bytes + l.v_bytes);
}

uint8_t* KvCache::staging_base(int layer, int32_t slot) const {
  return layers_[size_t(layer)].staging.data() + size_t(slot) * 2 * staging_codec_->block_bytes();
}

void KvCache::write(int layer, const BlockTable& table, int32_t pos, const float* k, const float* v) {
  assert(pos < table.capacity(options_.block_size));
  const Layer& l = layers_[size_t(layer)];
  const size_t b = size_t(pos / options_.block_size);
  const int slot = pos % options_.block_size;
  uint8_t* base = block_base(layer, table.blocks[b]);
  if (l.k_staged || l.v_staged) {
    assert(table.staging[b] >= 0);
    uint8_t* stage = staging_base(layer, table.staging[b]);
    if (l.k_staged) staging_codec_->encode_token(stage, slot, k);
    if (l.v_staged) staging_codec_->encode_token(stage + staging_codec_->block_bytes(), slot, v);
  }
  if (!l.k_staged) l.k->encode_token(base, slot, k);
  if (!l.v_staged) l.v->encode_token(base + l.k_bytes, slot, v);
}

void KvCache::seal(int layer, const BlockTable& table, int32_t n_tokens) {
  const Layer& l = layers_[size_t(layer)];
  if (!l.k_staged && !l.v_staged) return;
  const int32_t bs = options_.block_size;
  std::vector<float> rows(size_t(bs) * size_t(n_kv_heads_ * head_dim_));  // (block_size, kv_dim)
  const int kv_dim = n_kv_heads_ * head_dim_;
  const int32_t last = std::min<int32_t>(sealed_blocks(n_tokens), int32_t(table.blocks.size()));
  for (int32_t b = sealed_blocks(table.num_tokens); b < last; ++b) {
    if (sealed_[size_t(table.blocks[size_t(b)])]) continue;  // shared and already encoded
    const int32_t slot = table.staging[size_t(b)];
    assert(slot >= 0);
    const uint8_t* stage = staging_base(layer, slot);
    uint8_t* base = block_base(layer, table.blocks[size_t(b)]);
    if (l.k_staged) {
      for (int t = 0; t < bs; ++t) staging_codec_->decode_token(stage, t, rows.data() + size_t(t) * kv_dim);
      l.k->encode_block(base, rows.data(), bs);
    }
    if (l.v_staged) {
      for (int t = 0; t < bs; ++t)
        staging_codec_->decode_token(stage + staging_codec_->block_bytes(), t, rows.data() + size_t(t) * kv_dim);
      l.v->encode_block(base + l.k_bytes, rows.data(), bs);
    }
  }
}

KvBlockView KvCache::k_view(int layer, const BlockTable& table, int32_t b, int32_t n_ctx) const {
  const Layer& l = layers_[size_t(layer)];
  if (l.k_staged && b >= sealed_blocks(n_ctx))
    return {staging_codec_.get(), staging_base(layer, table.staging[size_t(b)])};
  return {l.k.get(), block_base(layer, table.blocks[size_t(b)])};
}

void KvCache::read_keys(int layer, const BlockTable& table, int32_t begin, int32_t end, float* out) const {
  assert(end <= table.num_tokens);
  const int32_t bs = block_size();
  const size_t kv_dim = size_t(n_kv_heads_) * size_t(head_dim_);
  const bool pre_rope = k_pre_rope(layer);
  const int span = k_rope_span(layer);
  for (int32_t s = begin; s < end; ++s) {
    float* row = out + size_t(s - begin) * kv_dim;
    const KvBlockView view = k_view(layer, table, s / bs, table.num_tokens);
    view.codec->decode_token(view.data, s % bs, row);
    if (!pre_rope) continue;
    // Stored rotated by position mod span (1: not at all); the rest of the rotation now.
    for (int h = 0; h < n_kv_heads_; ++h) {
      const int32_t pos = key_rope_position(table, layer, h, s);
      rope(row + size_t(h) * size_t(head_dim_), 1, head_dim_, pos - pos % span, rope_freqs_.data());
    }
  }
}

int32_t KvCache::key_rope_position(const BlockTable& table, int layer, int kv_head, int32_t slot) const {
  if (!table.positions_in_cache) return slot_position(table, layer, kv_head, slot);
  if (table.dead == 0) return slot;
  int32_t rank = 0;
  for (int32_t s = 0; s < slot; ++s) rank += slot_position(table, layer, kv_head, s) >= 0;
  return rank;
}

void KvCache::key_rope_positions(const BlockTable& table, int layer, int kv_head, int32_t n, int32_t* out) const {
  int32_t rank = 0;
  for (int32_t s = 0; s < n; ++s) {
    const int32_t p = slot_position(table, layer, kv_head, s);
    out[s] = table.positions_in_cache ? rank : p;
    rank += p >= 0;
  }
}

KvBlockView KvCache::v_view(int layer, const BlockTable& table, int32_t b, int32_t n_ctx) const {
  const Layer& l = layers_[size_t(layer)];
  if (l.v_staged && b >= sealed_blocks(n_ctx))
    return {staging_codec_.get(), staging_base(layer, table.staging[size_t(b)]) + staging_codec_->block_bytes()};
  return {l.v.get(), block_base(layer, table.blocks[size_t(b)]) + l.k_bytes};
}

KvStats KvCache::stats() const {
  KvStats s;
  s.block_size = options_.block_size;
  s.residual = residual_;
  for (const auto& l : layers_) {
    s.bytes_per_block += int64_t(l.k_bytes + l.v_bytes);
    if (l.k_staged) s.staging_bytes_per_block += int64_t(staging_codec_->block_bytes());
    if (l.v_staged) s.staging_bytes_per_block += int64_t(staging_codec_->block_bytes());
  }
  s.bytes_per_token = s.bytes_per_block / options_.block_size;
  s.blocks_total = pool_.num_blocks();
  s.blocks_free = pool_.num_free();
  s.blocks_cached_idle = pool_.num_idle();
  s.blocks_used = pool_.num_used() - ballast_blocks_;
  s.blocks_for_staging = ballast_blocks_;
  s.staging_used = staged_ ? pool_.num_blocks() - int32_t(free_staging_.size()) : 0;
  s.tokens_stored = tokens_stored_;
  s.bytes_used = int64_t(s.blocks_used) * s.bytes_per_block + int64_t(s.staging_used) * s.staging_bytes_per_block;
  s.bytes_capacity = int64_t(s.blocks_total) * s.bytes_per_block;  // staging's share inside it when paid for
  const int64_t slots = int64_t(s.blocks_used) * options_.block_size;
  // Sequences sharing blocks count their tokens once each, so clamp at 0.
  s.fragmentation = slots == 0 ? 0.0 : std::max(0.0, 1.0 - double(tokens_stored_) / double(slots));
  s.tokens_evicted = tokens_evicted_;
  s.compactions = compactions_;
  return s;
}

// ---- Sharing ----

void KvCache::release_staging(int32_t slot) {
  assert(staging_refs_[size_t(slot)] > 0);
  if (--staging_refs_[size_t(slot)] > 0) return;
  free_staging_.push_back(slot);
  for (int32_t c = 0; c < staging_cost_; ++c) {
    int32_t& block = staging_ballast_[size_t(slot) * size_t(staging_cost_) + size_t(c)];
    pool_.release(block);
    block = -1;
  }
  ballast_blocks_ -= staging_cost_;
}

bool KvCache::fork(const BlockTable& src, BlockTable& dst) {
  assert(dst.blocks.empty() && dst.num_tokens == 0);
  const int32_t n = blocks_for(src.num_tokens);
  const bool open = src.num_tokens % options_.block_size != 0;
  int32_t copy = -1;  // the new staging slot of the open block
  if (staged_ && open && src.staging[size_t(n - 1)] >= 0) {
    std::vector<int32_t> slot;
    if (!take_staging(1, slot)) return false;
    copy = slot[0];
    const size_t bytes = 2 * staging_codec_->block_bytes();
    for (int l = 0; l < n_layers(); ++l)
      if (layers_[size_t(l)].k_staged || layers_[size_t(l)].v_staged)
        std::memcpy(staging_base(l, copy), staging_base(l, src.staging[size_t(n - 1)]), bytes);
  }
  for (int32_t b = 0; b < n; ++b) {
    pool_.retain(src.blocks[size_t(b)]);
    dst.blocks.push_back(src.blocks[size_t(b)]);
    if (!staged_) continue;
    int32_t slot = src.staging[size_t(b)];
    if (b == n - 1 && copy >= 0) slot = copy;
    else if (slot >= 0) retain_staging(slot);
    dst.staging.push_back(slot);
  }
  dst.num_tokens = src.num_tokens;
  tokens_stored_ += src.num_tokens;
  return true;
}

void KvCache::attach_prefix(BlockTable& table, std::span<const int32_t> blocks, std::span<const int32_t> staging) {
  assert(table.blocks.empty() && table.num_tokens == 0);
  assert(staging.empty() || staging.size() == blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    pool_.retain(blocks[i]);
    table.blocks.push_back(blocks[i]);
    if (!staged_) continue;
    const int32_t slot = staging.empty() ? -1 : staging[i];
    if (slot >= 0) retain_staging(slot);
    table.staging.push_back(slot);
  }
  table.num_tokens = int32_t(blocks.size()) * options_.block_size;
  tokens_stored_ += table.num_tokens;
}

void KvCache::seal_full_blocks(const BlockTable& table) {
  if (!staged_) return;
  const int32_t full = table.num_tokens / options_.block_size;
  // seal() encodes blocks below sealed_blocks(n); this n puts exactly the full ones there.
  const int32_t n = full * options_.block_size + (residual_ - options_.block_size);
  for (int l = 0; l < n_layers(); ++l) seal(l, table, n);
  for (int32_t b = 0; b < full; ++b) sealed_[size_t(table.blocks[size_t(b)])] = 1;
}

bool KvCache::block_final(const BlockTable& table, int32_t b) const {
  if (b >= table.num_tokens / options_.block_size) return false;
  return !staged_ || sealed_[size_t(table.blocks[size_t(b)])];
}

int32_t KvCache::staged_before(int32_t n_blocks) const {
  return n_blocks - std::min(n_blocks, sealed_blocks(n_blocks * options_.block_size + 1));
}

// --- Block export and import (the tiered KV store, issue 7) ---

size_t KvCache::block_record_bytes() const {
  size_t bytes = 0;
  for (const auto& l : layers_) bytes += l.k_bytes + l.v_bytes;
  return bytes;
}

uint64_t KvCache::block_codec_hash() const {
  std::string desc = fmt::format("kvblock/v2 bs={} kv_heads={} head_dim={} layers={}", options_.block_size,
                                 n_kv_heads_, head_dim_, layers_.size());
  for (const auto& l : layers_) {
    for (const KvCodec* c : {l.k.get(), l.v.get()}) {
      const KvCodecConfig& cfg = c->config();
      desc += fmt::format(" |{} g{} b{}", cfg.describe(), cfg.group_size, c->block_bytes());
      // Static ranges are part of what a code means, not only the type.
      for (const std::vector<float>* range : {&cfg.static_min, &cfg.static_max})
        desc.append(reinterpret_cast<const char*>(range->data()), range->size() * sizeof(float));
    }
  }
  return XXH3_64bits(desc.data(), desc.size());
}

void KvCache::export_block(int32_t block, std::vector<uint8_t>& out) const {
  assert(block >= 0 && block < pool_.num_blocks());
  out.resize(block_record_bytes());
  uint8_t* p = out.data();
  for (int layer = 0; layer < n_layers(); ++layer) {
    const Layer& l = layers_[size_t(layer)];
    std::memcpy(p, block_base(layer, block), l.k_bytes + l.v_bytes);
    p += l.k_bytes + l.v_bytes;
  }
}

void KvCache::import_block(int32_t block, std::span<const uint8_t> bytes) {
  if (bytes.size() != block_record_bytes())
    fail("KV block of {} bytes cannot be imported into a cache whose blocks have {} bytes", bytes.size(),
         block_record_bytes());
  assert(block >= 0 && block < pool_.num_blocks());
  const uint8_t* p = bytes.data();
  for (int layer = 0; layer < n_layers(); ++layer) {
    const Layer& l = layers_[size_t(layer)];
    std::memcpy(block_base(layer, block), p, l.k_bytes + l.v_bytes);
    p += l.k_bytes + l.v_bytes;
  }
  sealed_[size_t(block)] = 1;  // its encoded form is written: final, shareable
}

// ---- Eviction and compaction (KV sparsity, issue 4) ----

void KvCache::evict(BlockTable& table, std::span<const int32_t> slots, int32_t per_head) {
  const size_t rows = layers_.size() * size_t(n_kv_heads_);
  if (per_head < 0 || slots.size() != rows * size_t(per_head))
    fail("evict: {} slots given for {} (layer, KV head) rows of {} each", slots.size(), rows, per_head);
  if (per_head == 0) return;
  if (table.slot_positions.empty()) {
    table.slot_positions.resize(size_t(table.num_tokens) * rows);
    for (int32_t s = 0; s < table.num_tokens; ++s)
      std::fill_n(table.slot_positions.begin() + int64_t(s) * int64_t(rows), rows, table.position_of_new(s));
  }
  // Mark row by row; on a bad slot, restore what was marked and report it.
  std::vector<std::pair<size_t, int32_t>> undo;  // (index, old position)
  for (size_t r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < per_head; ++i) {
      const int32_t s = slots[r * size_t(per_head) + size_t(i)];
      const size_t at = s >= 0 && s < table.num_tokens ? size_t(s) * rows + r : 0;
      if (s < 0 || s >= table.num_tokens || table.slot_positions[at] < 0) {
        for (const auto& [index, pos] : undo) table.slot_positions[index] = pos;
        fail("evict: slot {} of layer {}, KV head {} is {}", s, r / size_t(n_kv_heads_), r % size_t(n_kv_heads_),
             s < 0 || s >= table.num_tokens ? "out of range" : "already evicted");
      }
      undo.emplace_back(at, table.slot_positions[at]);
      table.slot_positions[at] = -1;
    }
  }
  table.dead += per_head;
  table.evicted += per_head;
  tokens_stored_ -= per_head;
  tokens_evicted_ += per_head;
}

bool KvCache::compact(BlockTable& table) {
  if (table.dead == 0) return true;
  const int n_layers = int(layers_.size()), H = n_kv_heads_, bs = options_.block_size;
  const size_t rows = size_t(n_layers) * size_t(H);
  const int32_t n_old = table.num_tokens, m = n_old - table.dead;
  const int32_t nb_new = blocks_for(m);
  const int32_t old_sealed = sealed_blocks(n_old), new_sealed = sealed_blocks(m);
  auto at = [rows](int32_t slot, size_t row) { return size_t(slot) * rows + row; };

  // Plan: the source slot of every (new slot, layer, head); live tokens keep their order.
  std::vector<int32_t> src(size_t(m) * rows), positions(size_t(m) * rows);  // (new slot, layer, head)
  for (size_t r = 0; r < rows; ++r) {
    int32_t j = 0;
    for (int32_t s = 0; s < n_old; ++s) {
      const int32_t p = table.slot_positions[at(s, r)];
      if (p < 0) continue;
      src[at(j, r)] = s;
      positions[at(j, r)] = p;
      ++j;
    }
    assert(j == m);
  }
  // Whether new block d of a plane changes: a token arrives from another slot,
  // or the block's form (encoded or FP16 staging) changes under it.
  auto staged_after = [&](bool plane_staged, int32_t d) { return plane_staged && d >= new_sealed; };
  auto staged_before = [&](bool plane_staged, int32_t slot) { return plane_staged && slot / bs >= old_sealed; };
  auto plane_changes = [&](int layer, bool plane_staged, int32_t d) {
    const int32_t end = std::min(m, (d + 1) * bs);
    for (int32_t t = d * bs; t < end; ++t)
      for (int h = 0; h < H; ++h) {
        const int32_t s = src[at(t, size_t(layer) * H + h)];
        if (s != t || staged_before(plane_staged, s) != staged_after(plane_staged, d)) return true;
      }
    return false;
  };
  // Blocks whose encoded bytes are written, and shared ones among them that
  // need a private copy (also any shared block that returns to staging: the
  // next seal() writes it).
  std::vector<int32_t> cow;  // new block indices to copy
  for (int32_t d = 0; d < nb_new; ++d) {
    if (pool_.ref_count(table.blocks[size_t(d)]) <= 1) continue;
    bool writes = staged_ && d >= new_sealed;
    for (int l = 0; l < n_layers && !writes; ++l) {
      const Layer& ly = layers_[size_t(l)];
      writes = (!staged_after(ly.k_staged, d) && plane_changes(l, ly.k_staged, d)) ||
               (!staged_after(ly.v_staged, d) && plane_changes(l, ly.v_staged, d));
    }
    if (writes) cow.push_back(d);
  }
  std::vector<int32_t> staging_needed;  // new block indices that enter the FP16 window
  std::vector<int32_t> staging_cow;     // new block indices whose staging slot is shared and written
  if (staged_) {
    for (int32_t d = new_sealed; d < std::min(nb_new, old_sealed); ++d) staging_needed.push_back(d);
    // A staging slot another table references (a fork, a prefix-cache
    // sidecar) is never written in place either.
    for (int32_t d = std::max(new_sealed, old_sealed); d < nb_new; ++d) {
      const int32_t slot = table.staging[size_t(d)];
      bool writes = false;
      for (int l = 0; l < n_layers && !writes; ++l) {
        const Layer& ly = layers_[size_t(l)];
        writes = plane_changes(l, ly.k_staged, d) || plane_changes(l, ly.v_staged, d);
      }
      if (slot >= 0 && staging_refs_[size_t(slot)] > 1 && writes) staging_cow.push_back(d);
    }
  }
  std::vector<int32_t> fresh;
  if (!pool_.allocate(int32_t(cow.size()), fresh)) return false;
  std::vector<int32_t> slots;  // for staging_needed, then staging_cow
  if (!take_staging(int32_t(staging_needed.size() + staging_cow.size()), slots)) {
    for (int32_t id : fresh) pool_.release(id);
    return false;
  }

  // Apply. New block d reads only slots >= d * block_size, so writing the new
  // blocks in order never overwrites a source still to be read.
  std::vector<int32_t> new_blocks(table.blocks.begin(), table.blocks.begin() + nb_new);
  std::vector<int32_t> new_staging;
  if (staged_) new_staging.assign(table.staging.begin(), table.staging.begin() + nb_new);
  for (size_t i = 0; i < cow.size(); ++i) {
    const int32_t d = cow[i];
    new_blocks[size_t(d)] = fresh[i];
    for (int l = 0; l < n_layers; ++l) {
      const Layer& ly = layers_[size_t(l)];
      std::memcpy(block_base(l, fresh[i]), block_base(l, table.blocks[size_t(d)]), ly.k_bytes + ly.v_bytes);
    }
  }
  size_t next_slot = 0;
  for (int32_t d : staging_needed) new_staging[size_t(d)] = slots[next_slot++];
  for (int32_t d : staging_cow) {
    const int32_t from = table.staging[size_t(d)], to = slots[next_slot++];
    for (int l = 0; l < n_layers; ++l)
      if (layers_[size_t(l)].k_staged || layers_[size_t(l)].v_staged)
        std::memcpy(staging_base(l, to), staging_base(l, from), 2 * staging_codec_->block_bytes());
    new_staging[size_t(d)] = to;
  }
  const int kv_dim = n_kv_heads_ * head_dim_;
  std::vector<float> rows_buf(size_t(bs) * size_t(kv_dim)), row(static_cast<size_t>(kv_dim));  // (block_size, kv_dim), (kv_dim)
  std::vector<uint8_t> temp;  // one encoded block, to re-encode a single token
  for (int l = 0; l < n_layers; ++l) {
    const Layer& ly = layers_[size_t(l)];
    for (int plane = 0; plane < 2; ++plane) {
      const bool plane_staged = plane == 0 ? ly.k_staged : ly.v_staged;
      const KvCodec& codec = plane == 0 ? *ly.k : *ly.v;
      const size_t arena_off = plane == 0 ? 0 : ly.k_bytes;
      const size_t stage_off = plane == 0 || !staged_ ? 0 : staging_codec_->block_bytes();
      // Where a slot lives before compaction, and where a new block is written.
      auto source = [&](int32_t s) -> KvBlockView {
        const size_t b = size_t(s / bs);
        if (staged_before(plane_staged, s)) return {staging_codec_.get(), staging_base(l, table.staging[b]) + stage_off};
        return {&codec, block_base(l, table.blocks[b]) + arena_off};
      };
      for (int32_t d = 0; d < nb_new; ++d) {
        if (!plane_changes(l, plane_staged, d)) continue;
        const bool to_stage = staged_after(plane_staged, d);
        const KvCodec& dc = to_stage ? *staging_codec_ : codec;
        uint8_t* dst = to_stage ? staging_base(l, new_staging[size_t(d)]) + stage_off
                                : block_base(l, new_blocks[size_t(d)]) + arena_off;
        const int n = std::min(bs, m - d * bs);
        ByteSpan probe[2];
        if (dc.token_spans(0, 0, probe) == 0) {
          // No spans: decode the block's new contents, then encode it whole.
          for (int t = 0; t < n; ++t)
            for (int h = 0; h < H; ++h) {
              const int32_t s = src[at(d * bs + t, size_t(l) * H + h)];
              const KvBlockView v = source(s);
              v.codec->decode_token(v.data, s % bs, row.data());
              std::copy_n(row.begin() + h * head_dim_, head_dim_, rows_buf.begin() + int64_t(t) * kv_dim + h * head_dim_);
            }
          dc.encode_block(dst, rows_buf.data(), n);
          continue;
        }
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < H; ++h) {
            const int32_t s = src[at(d * bs + t, size_t(l) * H + h)];
            const bool moved = s != d * bs + t || staged_before(plane_staged, s) != to_stage;
            if (!moved) continue;
            const KvBlockView v = source(s);
            ByteSpan from[2], into[2];
            const int k = dc.token_spans(t, h, into);
            const uint8_t* bytes = v.data;
            if (v.codec == &dc) {
              v.codec->token_spans(s % bs, h, from);
            } else {
              // Another form (staging <-> codec): encode the decoded token at
              // slot t of a scratch block, then move its spans.
              temp.resize(dc.block_bytes());
              v.codec->decode_token(v.data, s % bs, row.data());
              dc.encode_token(temp.data(), t, row.data());
              bytes = temp.data();
              std::copy_n(into, k, from);
            }
            for (int i = 0; i < k; ++i) std::memmove(dst + into[i].offset, bytes + from[i].offset, into[i].size);
          }
      }
    }
  }

  // Return what is no longer needed: tail blocks, their staging slots, and
  // this table's references to blocks it copied.
  for (size_t b = size_t(nb_new); b < table.blocks.size(); ++b) {
    pool_.release(table.blocks[b]);
    if (staged_ && table.staging[b] >= 0) release_staging(table.staging[b]);
  }
  for (int32_t d : cow) pool_.release(table.blocks[size_t(d)]);
  for (int32_t d : staging_cow) release_staging(table.staging[size_t(d)]);
  // Blocks below the new sealed count hold their encoded form; the ones that
  // went back into the FP16 window (all private by now) must be encoded again.
  if (staged_)
    for (int32_t d = 0; d < nb_new; ++d) sealed_[size_t(new_blocks[size_t(d)])] = d < new_sealed ? 1 : 0;
  table.blocks = std::move(new_blocks);
  if (staged_) table.staging = std::move(new_staging);
  table.slot_positions = std::move(positions);
  table.num_tokens = m;
  table.dead = 0;
  ++compactions_;
  return true;
}

}  // namespace kvserve
