// How one layer's keys (or values) of one KV block are stored: the byte
// layout of the block, how token vectors are encoded into it, and the
// attention inner loops that read it in place (no decoded copy of the cache is
// ever made: quantized codes are dequantized in registers).
//
// faiss-style: a codec is a value built from a KvCodecConfig and the block's
// shape; code size, encode and decode are its whole contract. The attention
// kernel is specialised per codec; everything else is codec-blind. Keys and
// values, and every layer, pick their codec independently.
//
// Layouts (one layer, K or V, one block; kv_dim = n_kv_heads * head_dim).
// Head-major wherever the format allows: everything stored for KV head h
// (codes and metadata of all the block's tokens) is the contiguous h-th of
// n_kv_heads equal slices of the block, so a (block, kv_head) kernel call
// reads one run of bytes, and callers may prefetch exactly that slice.
//   fp32/fp16/bf16      (kv_head, block_size, head_dim) values
//   int8/int4/int2,     head-major when group_size divides head_dim and a
//   token groups          head's codes fill whole bytes (head_dim * bits % 8
//                         == 0): per KV head, codes (block_size, head_dim)
//                         (little-endian bit packing), then (block_size,
//                         head_dim / group_size) fp16 (scale, min) pairs;
//                         x = min + scale * code. Groups spanning heads:
//                         token-major, per token the codes of the kv_dim row,
//                         then a pair per group along the row
//   int8/int4/int2,     head-major (same condition on bytes): per KV head,
//   channel groups        codes (block_size, head_dim), then per token group
//                         (of group_size tokens) a pair per channel:
//                         (block_size / group_size, head_dim) pairs (KIVI's
//                         layout for keys). Dynamic post-RoPE groups store
//                         the codes channel-major instead (byte row per
//                         channel byte, across the block's tokens); 4-bit
//                         heads of whole octets as (octet, token, 4 bytes),
//                         byte j = channels 8o + j (low nibble) and
//                         8o + j + 4 (high): kv/channel_codec.cpp. Otherwise
//                         codes (block_size, kv_dim) rows, then (token
//                         group, kv_dim) pairs
//   static scales       as channel groups without per-group metadata: fixed
//                         per-channel ranges from calibration live in the codec
//   q4_0 (llama.cpp)    blocks of 32 consecutive values, each an fp16 scale d
//                         and 16 bytes of nibbles, x = d * (nib - 8); when
//                         head_dim % 32 == 0, per KV head (block_size,
//                         head_dim / 32) blocks, else per token the row's
//                         kv_dim / 32 blocks (a block may span heads)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

class RopeTable;

// FP8 is E4M3, FP8_E5M2 the other OCP 8-bit float (util/half.h); new types
// go at the end: the values are stored.
enum class KvDType : uint8_t { F32, F16, BF16, INT8, INT4, INT2, Q4_0, FP8, FP8_E5M2 };
enum class KvGrouping : uint8_t { Token, Channel };

std::string_view kv_dtype_name(KvDType t);
// Parses fp32, fp16, bf16, fp8 (E4M3; also fp8_e4m3), fp8_e5m2, int8, int4, int2, q4_0;
// throws kvserve::Error otherwise.
KvDType parse_kv_dtype(std::string_view name);
std::string_view kv_grouping_name(KvGrouping g);
KvGrouping parse_kv_grouping(std::string_view name);
// Bits per stored code: 32, 16, 16, 8, 4, 2, 4, 8, 8.
int kv_dtype_bits(KvDType t);
// Whether the type stores integer codes (and so may need a residual window).
bool kv_dtype_is_quantized(KvDType t);
// Whether the type stores asymmetric integer codes with a (scale, min) per
// group (int8, int4, int2; not q4_0): the types that groupings, static
// ranges, 8-bit scales and outliers apply to.
bool kv_dtype_is_affine(KvDType t);

// The geometry of one layer's K or V inside one block.
struct KvBlockShape {
  int block_size = 16;  // tokens
  int n_kv_heads = 1;
  int head_dim = 64;
  int kv_dim() const { return n_kv_heads * head_dim; }
};

struct KvCodecConfig {
  KvDType dtype = KvDType::F32;
  KvGrouping grouping = KvGrouping::Token;
  // Values per (scale, min) group: along the row for token grouping (may span
  // KV heads; must divide kv_dim), in tokens for channel grouping (must divide
  // block_size). 0 = the default: head_dim for token groups, block_size for
  // channel groups. q4_0 always uses 32.
  int group_size = 0;
  // Static scales: fixed per-channel ranges (kv_dim each) from calibration.
  // When set, no min/max pass runs at encode time, values are clamped, and no
  // per-group metadata is stored.
  std::vector<float> static_min, static_max;
  // Keys only: store keys before RoPE (KVQuant); attention then rotates the
  // query by each key's position instead. Per-channel groups see stable
  // channel statistics this way instead of channel pairs rotating within a block.
  bool pre_rope = false;
  // Pre-RoPE keys only: tokens that share one rotation of the query. A key
  // at text position p is stored rotated by p mod rope_span (RoPE at that
  // offset), so attention rotates the query back to each span's first
  // position once and scores the span with the plain integer kernels,
  // instead of one rotation per key (1: keys stored exactly before RoPE).
  // Channel statistics then rotate only within a span: TinyStories
  // int2-small, KL 0.019 at 1, 0.023 at 16, 0.043 at 64 (BENCHMARKS.md,
  // "Keys rotated within 16-token spans"). Must divide the block size.
  int rope_span = 1;
  // Bits of each stored (scale, min) pair member of dynamic integer groups:
  // 16 (fp16 pairs) or 8 (kv/scale8.h: one byte each plus an fp16 header per
  // run of groups; head-major layouts only, and token groups then encode
  // whole blocks, like channel groups). Ignored by types without such pairs
  // (float, q4_0, static scales).
  int scale_bits = 16;
  // Values per token row kept exactly beside the codes (kv/outlier_codec.h:
  // the row's furthest from their group's centre, as index and fp16 delta).
  // 0 = none. Integer types only.
  int outliers = 0;

  bool is_static() const { return !static_min.empty(); }
  // Sets dtype, dropping the static ranges and outliers that only affine
  // integer types keep (kv_dtype_is_affine).
  void retype(KvDType t);
  std::string describe() const;  // e.g. "int4/channel/g16", "+prerope" when pre_rope ("+prerope16" with 16-token spans), "+s8" with 8-bit scales, "+o2" with 2 outliers
};

// A run of bytes inside a block: [offset, offset + size).
struct ByteSpan {
  size_t offset = 0;
  size_t size = 0;
};

class KvCodec {
 public:
  virtual ~KvCodec() = default;

  const KvCodecConfig& config() const { return config_; }
  const KvBlockShape& shape() const { return shape_; }
  KvDType dtype() const { return config_.dtype; }

  // Bytes of one block (all tokens, all KV heads, metadata included).
  virtual size_t block_bytes() const = 0;
  // Bytes at the end of the block that every head's kernels read besides
  // the head's own slice (kv/outlier_codec.h's entries); empty for the
  // others. Head slices divide the bytes before them (head-major layouts).
  virtual ByteSpan shared_bytes() const { return {}; }
  // Whether a single token can be encoded on its own (false for channel
  // groups, which need every token of the block at once).
  virtual bool encodes_tokens() const { return true; }

  // Stores x (kv_dim floats) as token `slot`.  REQUIRES: encodes_tokens().
  virtual void encode_token(uint8_t* block, int slot, const float* x) const = 0;
  // Stores the first n tokens of x ((n, kv_dim) floats); slots >= n are zero.
  virtual void encode_block(uint8_t* block, const float* x, int n) const;
  // Reads token `slot` back into out (kv_dim floats).
  virtual void decode_token(const uint8_t* block, int slot, float* out) const = 0;
  // Whether decode_head is a plain conversion of stored floats (the float
  // types): prefill tiles (attention/tile_attention.h) then run float
  // kernels over many query rows at once instead of score and accumulate.
  virtual bool stores_floats() const { return false; }
  // Tokens [0, n) of KV head kv_head as floats, (n, head_dim) into out. The
  // default decodes whole tokens (every head) and keeps one head's values.
  virtual void decode_head(const uint8_t* block, int n, int kv_head, float* out) const;
  // The bytes holding KV head `kv_head` of token `slot` (codes and their
  // metadata) when the layout keeps them apart from every other token and
  // head: copying them into another block of this codec moves that head's
  // token exactly, which eviction's compaction relies on. Writes at most two
  // spans to out and returns how many; 0 when metadata is shared across
  // tokens or heads (channel groups, groups spanning heads), where moving a
  // token means decoding and re-encoding its block.
  virtual int token_spans(int slot, int kv_head, ByteSpan* out) const { return 0; }

  // Attention scores of the n_q query heads that share KV head `kv_head`
  // against the first n keys of the block:
  //   scores[i * stride + t] = scale * dot(q + i * head_dim, key_t[kv_head])
  // q: (n_q, head_dim) floats; scores: (n_q, stride) floats, stride >= n.
  virtual void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                     float* scores, int stride) const = 0;
  // As score, with a separate query set per token (pre-RoPE keys: the query
  // rotated to each key's position): q is (n, n_q, head_dim) floats.
  virtual void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                            float* scores, int stride) const;
  // Pre-RoPE keys of a block whose token t sits at position first + t,
  // against queries already rotated back by `first` (rope.rotate_back): only
  // each key's offset t within the block remains, applied to the key in
  // registers with rope's rows 0 .. n-1, so all tokens share one query set:
  //   scores[i * stride + t] = scale * dot(q + i * head_dim, rope(key_t, t))
  // Returns false, writing nothing, where the codec has no such kernel;
  // callers then rotate the query per key and call score_tokens.
  virtual bool score_offsets(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                             const RopeTable& rope, float* scores, int stride) const {
    return false;
  }
  // As score, for tokens [begin, end) of the block only (scores elsewhere in
  // the rows are left alone): keys stored within RoPE spans
  // (KvCodecConfig::rope_span), one rotated query set per span. The default
  // scores the first `end` tokens into scratch and copies the range.
  virtual void score_span(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head,
                          float scale, float* scores, int stride) const;
  // Every span of the first n tokens at once: tokens [s * span, (s + 1) *
  // span) against query set s of q_spans ((n + span - 1) / span, n_q,
  // head_dim). The default calls score_span per span; channel codecs (on
  // AVX-512 builds) decode each token group's scales once for all its spans.
  virtual void score_spans(const float* q_spans, int n_q, const uint8_t* block, int n, int span, int kv_head,
                           float scale, float* scores, int stride) const;
  // Weighted sum of the first n values of the block:
  //   out[i * head_dim + d] += sum_t weights[i * stride + t] * value_t[kv_head][d]
  // Weights are >= 0 (softmax weights): the integer codecs fold them with the
  // tokens' scales against their largest value.
  virtual void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n,
                          int kv_head, float* out) const = 0;

 protected:
  KvCodec(KvCodecConfig config, KvBlockShape shape) : config_(std::move(config)), shape_(shape) {}
  KvCodecConfig config_;
  KvBlockShape shape_;
};

// Builds the codec; throws kvserve::Error naming an invalid combination
// (group not dividing the row or block, channel groups larger than the block,
// q4_0 with kv_dim not a multiple of 32, static ranges of the wrong size...).
std::unique_ptr<KvCodec> make_kv_codec(const KvCodecConfig& config, const KvBlockShape& shape);

// Scalar references for any codec, built on decode_token(); tests compare
// each codec's score/accumulate against these.
void score_reference(const KvCodec& codec, const float* q, int n_q, const uint8_t* block, int n,
                     int kv_head, float scale, float* scores, int stride);
void accumulate_reference(const KvCodec& codec, const float* weights, int n_q, int stride,
                          const uint8_t* block, int n, int kv_head, float* out);

}  // namespace kvserve
