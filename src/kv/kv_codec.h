// How one KV head's vectors are stored inside a block: the byte layout of a
// "slab" (block_size tokens x head_dim values of one KV head of one layer),
// how a token's vector is encoded into it, and the attention inner loops that
// read it directly (no decoded copy of the cache is ever made).
//
// Codecs are values chosen per layer and per K/V at start-up; the attention
// kernel is specialised per codec, everything else is codec-blind. The next
// codecs (INT8/INT4/INT2, per-channel groups) implement the same interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kvserve {

enum class KvDType : uint8_t { F32, F16 };

std::string_view kv_dtype_name(KvDType t);
// Parses "fp32" / "fp16" (also "f32", "f16"); throws kvserve::Error otherwise.
KvDType parse_kv_dtype(std::string_view name);

class KvCodec {
 public:
  virtual ~KvCodec() = default;

  virtual KvDType dtype() const = 0;
  // Bytes of one slab of block_size tokens x head_dim values.
  virtual size_t slab_bytes(int block_size, int head_dim) const = 0;

  // Stores x (head_dim floats) as token `slot` of the slab.
  virtual void encode(uint8_t* slab, int slot, const float* x, int head_dim) const = 0;
  // Reads token `slot` of the slab back into out (head_dim floats).
  virtual void decode(const uint8_t* slab, int slot, float* out, int head_dim) const = 0;

  // Attention scores against the keys of the first n tokens of a slab, for
  // n_q query vectors that share this KV head (GQA):
  //   scores[i * stride + t] = scale * dot(q + i * head_dim, key_t)
  // q: (n_q, head_dim) floats; scores: (n_q, stride) floats, stride >= n.
  virtual void score(const float* q, int n_q, const uint8_t* slab, int n, int head_dim,
                     float scale, float* scores, int stride) const = 0;

  // Weighted sum of the values of the first n tokens of a slab:
  //   out[i * head_dim + d] += sum_t weights[i * stride + t] * value_t[d]
  virtual void accumulate(const float* weights, int n_q, int stride, const uint8_t* slab, int n,
                          int head_dim, float* out) const = 0;
};

// The codec for a storage type. Codecs are stateless: one shared instance each.
const KvCodec& kv_codec(KvDType t);

}  // namespace kvserve

namespace kvserve {

// Scalar references for any codec, built on decode(): tests compare each
// codec's score/accumulate against these.
void score_reference(const KvCodec& codec, const float* q, int n_q, const uint8_t* slab, int n,
                     int head_dim, float scale, float* scores, int stride);
void accumulate_reference(const KvCodec& codec, const float* weights, int n_q, int stride,
                          const uint8_t* slab, int n, int head_dim, float* out);

}  // namespace kvserve
