#include "kv/block_view.h"

#include <cstring>
#include <vector>

namespace kvserve {
namespace {

// Per-thread scratch of one block in the codec's own layout.
uint8_t* block_scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

size_t slice_bytes(const KvCodec& c) { return c.block_bytes() / size_t(c.shape().n_kv_heads); }

}  // namespace

void KvBlockView::decode_token(int slot, float* out) const {
  if (head_step == 0) {
    codec->decode_token(data, slot, out);
    return;
  }
  // Through head h's pointer the codec reads head h right (the other heads'
  // values are another block's): keep each head's part.
  const int hd = codec->shape().head_dim, heads = codec->shape().n_kv_heads;
  thread_local std::vector<float> row;
  row.resize(size_t(heads) * size_t(hd));
  for (int h = 0; h < heads; ++h) {
    codec->decode_token(head(h), slot, row.data());
    std::memcpy(out + size_t(h) * hd, row.data() + size_t(h) * hd, size_t(hd) * sizeof(float));
  }
}

void KvBlockView::gather(uint8_t* out) const {
  if (head_step == 0) {
    std::memcpy(out, data, codec->block_bytes());
    return;
  }
  const size_t slice = slice_bytes(*codec);
  for (int h = 0; h < codec->shape().n_kv_heads; ++h)
    std::memcpy(out + size_t(h) * slice, head(h) + size_t(h) * slice, slice);
}

void KvBlockRef::scatter(const uint8_t* in) const {
  if (head_step == 0) {
    std::memcpy(data, in, codec->block_bytes());
    return;
  }
  const size_t slice = slice_bytes(*codec);
  for (int h = 0; h < codec->shape().n_kv_heads; ++h)
    std::memcpy(head(h) + size_t(h) * slice, in + size_t(h) * slice, slice);
}

void KvBlockRef::encode_token(int slot, const float* x) const {
  if (head_step == 0) {
    codec->encode_token(data, slot, x);
    return;
  }
  uint8_t* scratch = block_scratch(codec->block_bytes());
  ByteSpan spans[2];
  if (codec->token_spans(slot, 0, spans) == 0) {  // the token shares bytes with others: the whole block
    view().gather(scratch);
    codec->encode_token(scratch, slot, x);
    scatter(scratch);
    return;
  }
  // Only the token's own bytes change: encode it in scratch, move its spans.
  codec->encode_token(scratch, slot, x);
  for (int h = 0; h < codec->shape().n_kv_heads; ++h) {
    const int k = codec->token_spans(slot, h, spans);
    for (int i = 0; i < k; ++i) std::memcpy(head(h) + spans[i].offset, scratch + spans[i].offset, spans[i].size);
  }
}

void KvBlockRef::encode_block(const float* x, int n) const {
  if (head_step == 0) {
    codec->encode_block(data, x, n);
    return;
  }
  uint8_t* scratch = block_scratch(codec->block_bytes());
  codec->encode_block(scratch, x, n);
  scatter(scratch);
}

void KvBlockRef::copy_from(const KvBlockView& src) const {
  if (head_step == 0) {
    src.gather(data);
    return;
  }
  const size_t slice = slice_bytes(*codec);
  for (int h = 0; h < codec->shape().n_kv_heads; ++h)
    std::memcpy(head(h) + size_t(h) * slice, src.head(h) + size_t(h) * slice, slice);
}

}  // namespace kvserve
