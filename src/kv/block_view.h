// Where one layer's K or V of one block lives, and the few whole-block
// operations the cache needs when that block is not one run of bytes.
//
// A codec addresses KV head h of a block at `block + h * slice` (slice =
// block_bytes / n_kv_heads, head-sliced codecs: KvCodec::head_sliced). The
// cache may store a head's slices of neighbouring blocks side by side
// instead (head runs, kv/kv_cache.h): head h's slice of a block then sits
// `head_step` bytes further per head than the codec expects, and
// `head(h)` is the pointer to hand the codec for that head. head_step = 0
// is the plain block, one run of block_bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/kv_codec.h"

namespace kvserve {

struct KvBlockView {
  const KvCodec* codec;
  const uint8_t* data;
  size_t head_step = 0;

  // The block pointer the codec reads KV head h through.
  const uint8_t* head(int h) const { return data + size_t(h) * head_step; }
  // The view of KV head h alone: per-head calls (kv_head = h) take its data.
  KvBlockView head_view(int h) const { return {codec, head(h), 0}; }
  // Token `slot` of every head as kv_dim floats (codec->decode_token).
  void decode_token(int slot, float* out) const;
  // The block's bytes in the codec's own layout (block_bytes) into out.
  void gather(uint8_t* out) const;
};

// The writable side of a view: the cache's arena.
struct KvBlockRef {
  const KvCodec* codec;
  uint8_t* data;
  size_t head_step = 0;

  KvBlockView view() const { return {codec, data, head_step}; }
  uint8_t* head(int h) const { return data + size_t(h) * head_step; }
  // Overwrites the block with bytes in the codec's own layout.
  void scatter(const uint8_t* in) const;
  // codec->encode_token / encode_block on the block wherever its slices lie.
  void encode_token(int slot, const float* x) const;
  void encode_block(const float* x, int n) const;
  // Copies another block of the same codec (any head_step on either side).
  void copy_from(const KvBlockView& src) const;
};

}  // namespace kvserve
