#include "kv/kv_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include "util/error.h"

namespace kvserve {
namespace {

constexpr int32_t kMaxBlockSize = 1024;

KvBlockShape block_shape(const ModelConfig& m, const KvCacheOptions& o) {
  return KvBlockShape{o.block_size, m.n_kv_heads, m.head_dim()};
}

}  // namespace

KvCache::KvCache(const ModelConfig& model, const KvCacheOptions& options)
    : options_(options),
      n_kv_heads_(model.n_kv_heads),
      head_dim_(model.head_dim()),
      rope_theta_(model.rope_theta),
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
        residual_ = options.residual < 0 ? (quantized ? options.block_size : 0) : options.residual;
        if (residual_ % options.block_size != 0)
          fail("--kv-residual {} must be a multiple of the block size {}", residual_, options.block_size);
        for (auto& layer : layers_) {
          layer.k_staged = residual_ > 0 && kv_dtype_is_quantized(layer.k->dtype());
          layer.v_staged = residual_ > 0 && kv_dtype_is_quantized(layer.v->dtype());
          if ((!layer.k_staged && !layer.k->encodes_tokens()) || (!layer.v_staged && !layer.v->encodes_tokens()))
            fail("per-channel KV groups need a residual window of at least one block (--kv-residual {})",
                 options.block_size);
          staged_ = staged_ || layer.k_staged || layer.v_staged;
        }
        for (const auto& layer : layers_) {
          if (layer.v->config().pre_rope) fail("pre-RoPE storage applies to keys only");
          if (layer.k->config().pre_rope && layer.k->config().is_static())
            fail("pre-RoPE keys with static scales are not supported (calibration measures keys after RoPE)");
          if (layer.k->config().pre_rope && !rope_table_)
            rope_table_ = std::make_unique<RopeTable>(model.seq_len, model.head_dim(), model.rope_theta);
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
  if (staged_) {
    free_staging_.resize(n);
    for (size_t i = 0; i < n; ++i) free_staging_[i] = int32_t(n - 1 - i);  // pop_back yields 0, 1, 2, ...
  }
}

int32_t KvCache::blocks_for(int64_t n_tokens) const {
  return int32_t((n_tokens + options_.block_size - 1) / options_.block_size);
}

int32_t KvCache::sealed_blocks(int32_t n_ctx) const {
  if (!staged_) return blocks_for(n_ctx);
  const int32_t lag = residual_ - options_.block_size;  // newer tokens a full block waits for
  return n_ctx > lag ? (n_ctx - lag) / options_.block_size : 0;
}

bool KvCache::reserve(BlockTable& table, int32_t n_new) {
  const int64_t needed = int64_t(blocks_for(int64_t(table.num_tokens) + n_new)) - int64_t(table.blocks.size());
  if (needed <= 0) return true;
  const size_t before = table.blocks.size();
  if (!pool_.allocate(int32_t(needed), table.blocks)) return false;
  if (staged_) {
    // Capacity equals the block count, so a free slot always exists.
    table.staging.resize(before, -1);
    for (size_t i = before; i < table.blocks.size(); ++i) {
      table.staging.push_back(free_staging_.back());
      free_staging_.pop_back();
    }
  }
  return true;
}

void KvCache::commit(BlockTable& table, int32_t n) {
  assert(table.num_tokens + n <= table.capacity(options_.block_size));
  table.num_tokens += n;
  tokens_stored_ += n;
  if (!staged_) return;
  const int32_t sealed = std::min<int32_t>(sealed_blocks(table.num_tokens), int32_t(table.staging.size()));
  for (int32_t b = 0; b < sealed; ++b) {
    if (table.staging[size_t(b)] < 0) continue;
    free_staging_.push_back(table.staging[size_t(b)]);
    table.staging[size_t(b)] = -1;
  }
}

void KvCache::release(BlockTable& table) {
  for (int32_t id : table.blocks) pool_.release(id);
  for (int32_t slot : table.staging)
    if (slot >= 0) free_staging_.push_back(slot);
  tokens_stored_ -= table.num_tokens;
  table.blocks.clear();
  table.staging.clear();
  table.num_tokens = 0;
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
  s.blocks_used = pool_.num_used();
  s.staging_used = staged_ ? pool_.num_blocks() - int32_t(free_staging_.size()) : 0;
  s.tokens_stored = tokens_stored_;
  s.bytes_used = int64_t(s.blocks_used) * s.bytes_per_block + int64_t(s.staging_used) * s.staging_bytes_per_block;
  s.bytes_capacity = int64_t(s.blocks_total) * s.bytes_per_block;
  const int64_t slots = int64_t(s.blocks_used) * options_.block_size;
  s.fragmentation = slots == 0 ? 0.0 : 1.0 - double(tokens_stored_) / double(slots);
  return s;
}

// --- Block export and import (the tiered KV store, issue 7) ---

size_t KvCache::block_record_bytes() const {
  size_t bytes = 0;
  for (const auto& l : layers_) bytes += l.k_bytes + l.v_bytes;
  return bytes;
}

uint64_t KvCache::block_codec_hash() const {
  std::string desc = fmt::format("kvblock/v1 bs={} kv_heads={} head_dim={} layers={}", options_.block_size,
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
}

}  // namespace kvserve
