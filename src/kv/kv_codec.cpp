#include "kv/kv_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kv/float_codecs.h"
#include "kv/int_codecs.h"
#include "kv/outlier_codec.h"
#include "util/error.h"

namespace kvserve {

std::string_view kv_dtype_name(KvDType t) {
  switch (t) {
    case KvDType::F32: return "fp32";
    case KvDType::F16: return "fp16";
    case KvDType::BF16: return "bf16";
    case KvDType::INT8: return "int8";
    case KvDType::INT4: return "int4";
    case KvDType::INT2: return "int2";
    case KvDType::Q4_0: return "q4_0";
    case KvDType::FP8: return "fp8";
    case KvDType::FP8_E5M2: return "fp8_e5m2";
  }
  return "?";
}

KvDType parse_kv_dtype(std::string_view name) {
  for (KvDType t : {KvDType::F32, KvDType::F16, KvDType::BF16, KvDType::FP8, KvDType::FP8_E5M2, KvDType::INT8,
                    KvDType::INT4, KvDType::INT2, KvDType::Q4_0})
    if (name == kv_dtype_name(t)) return t;
  if (name == "f32") return KvDType::F32;
  if (name == "f16") return KvDType::F16;
  if (name == "fp8_e4m3") return KvDType::FP8;  // vLLM's name
  fail("unknown KV dtype '{}' (expected fp32, fp16, bf16, fp8, fp8_e5m2, int8, int4, int2 or q4_0)", name);
}

std::string_view kv_grouping_name(KvGrouping g) { return g == KvGrouping::Token ? "token" : "channel"; }

KvGrouping parse_kv_grouping(std::string_view name) {
  if (name == "token") return KvGrouping::Token;
  if (name == "channel") return KvGrouping::Channel;
  fail("unknown KV grouping '{}' (expected token or channel)", name);
}

int kv_dtype_bits(KvDType t) {
  switch (t) {
    case KvDType::F32: return 32;
    case KvDType::F16: case KvDType::BF16: return 16;
    case KvDType::INT8: case KvDType::FP8: case KvDType::FP8_E5M2: return 8;
    case KvDType::INT4: case KvDType::Q4_0: return 4;
    case KvDType::INT2: return 2;
  }
  return 32;
}

bool kv_dtype_is_quantized(KvDType t) {
  return t == KvDType::INT8 || t == KvDType::INT4 || t == KvDType::INT2 || t == KvDType::Q4_0;
}

bool kv_dtype_is_affine(KvDType t) { return kv_dtype_is_quantized(t) && t != KvDType::Q4_0; }

void KvCodecConfig::retype(KvDType t) {
  dtype = t;
  if (kv_dtype_is_affine(t)) return;
  static_min.clear();
  static_max.clear();
  outliers = 0;
}

std::string KvCodecConfig::describe() const {
  std::string out;
  if (!kv_dtype_is_affine(dtype)) out = std::string(kv_dtype_name(dtype));
  else if (is_static()) out = fmt::format("{}/static", kv_dtype_name(dtype));
  else out = fmt::format("{}/{}/g{}", kv_dtype_name(dtype), kv_grouping_name(grouping), group_size);
  if (scale_bits == 8 && kv_dtype_is_affine(dtype) && !is_static()) out += "+s8";
  if (pre_rope) out += rope_span > 1 ? fmt::format("+prerope{}", rope_span) : std::string("+prerope");
  return outliers > 0 ? out + fmt::format("+o{}", outliers) : out;
}

void KvCodec::score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                           float* scores, int stride) const {
  const int hd = shape_.head_dim;
  std::vector<float> key(static_cast<size_t>(shape_.kv_dim()));
  for (int t = 0; t < n; ++t) {
    decode_token(block, t, key.data());
    const float* k = key.data() + size_t(kv_head) * hd;
    for (int i = 0; i < n_q; ++i) {
      const float* qi = q + (size_t(t) * n_q + i) * hd;
      float sum = 0;
      for (int d = 0; d < hd; ++d) sum += qi[d] * k[d];
      scores[i * stride + t] = scale * sum;
    }
  }
}

void KvCodec::score_span(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head,
                         float scale, float* scores, int stride) const {
  thread_local std::vector<float> all;
  all.resize(size_t(n_q) * size_t(end));
  score(q, n_q, block, end, kv_head, scale, all.data(), end);
  for (int i = 0; i < n_q; ++i)
    std::copy(all.begin() + ptrdiff_t(i) * end + begin, all.begin() + ptrdiff_t(i + 1) * end,
              scores + size_t(i) * stride + begin);
}

void KvCodec::score_spans(const float* q_spans, int n_q, const uint8_t* block, int n, int span, int kv_head,
                          float scale, float* scores, int stride) const {
  const size_t set = size_t(n_q) * size_t(shape_.head_dim);
  for (int s0 = 0; s0 < n; s0 += span)
    score_span(q_spans + size_t(s0 / span) * set, n_q, block, s0, std::min(n, s0 + span), kv_head, scale, scores,
               stride);
}

void KvCodec::encode_block(uint8_t* block, const float* x, int n) const {
  std::vector<uint8_t> zero(block_bytes(), 0);
  std::copy(zero.begin(), zero.end(), block);
  for (int t = 0; t < n; ++t) encode_token(block, t, x + size_t(t) * shape_.kv_dim());
}

std::unique_ptr<KvCodec> make_kv_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  if (shape.block_size <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0)
    fail("KV block shape must be positive (block {}, heads {}, head dim {})", shape.block_size, shape.n_kv_heads,
         shape.head_dim);
  const int kv_dim = shape.kv_dim();
  if (config.rope_span < 1) fail("the keys' RoPE span must be at least 1 token (got {})", config.rope_span);
  if (config.rope_span > 1 && !config.pre_rope)
    fail("a RoPE span of {} tokens applies to keys stored before RoPE (--kv-k-pre-rope)", config.rope_span);
  if (shape.block_size % config.rope_span != 0)
    fail("the keys' RoPE span of {} tokens must divide the block size {}", config.rope_span, shape.block_size);
  if (config.outliers != 0) {
    if (!kv_dtype_is_affine(config.dtype))
      fail("KV outliers apply to int8, int4 and int2, not {}", kv_dtype_name(config.dtype));
    if (config.outliers < 0 || config.outliers > kv_dim || kv_dim > 65536)
      fail("KV outliers per token must be in 1..{} (got {})", std::min(kv_dim, 65536), config.outliers);
    KvCodecConfig inner = config;
    inner.outliers = 0;
    std::unique_ptr<KvCodec> inner_codec = make_kv_codec(inner, shape);
    KvCodecConfig outer = config;
    outer.group_size = inner_codec->config().group_size;  // resolved (0 = the default), as describe() shows it
    return make_outlier_codec(outer, shape, std::move(inner_codec));
  }
  KvCodecConfig c = config;
  if (c.scale_bits != 16 && c.scale_bits != 8) fail("KV scale bits must be 16 or 8 (got {})", c.scale_bits);
  // Only dynamic integer groups store scales; elsewhere the setting has nothing to apply to.
  if (!kv_dtype_is_affine(c.dtype) || c.is_static()) c.scale_bits = 16;
  if (!kv_dtype_is_quantized(c.dtype)) {
    if (c.is_static()) fail("static scales apply to integer KV types, not {}", kv_dtype_name(c.dtype));
    return make_float_codec(c, shape);
  }
  if (c.dtype == KvDType::Q4_0) {
    if (kv_dim % 32 != 0)
      fail("q4_0 needs the KV row ({} values) to be a multiple of 32", kv_dim);
    c.group_size = 32;
    c.grouping = KvGrouping::Token;
    return make_q4_0_codec(c, shape);
  }
  if ((kv_dim * kv_dtype_bits(c.dtype)) % 8 != 0)
    fail("{} needs kv_dim * bits to fill whole bytes (kv_dim {})", kv_dtype_name(c.dtype), kv_dim);
  if (c.is_static()) {
    if (c.static_min.size() != size_t(kv_dim) || c.static_max.size() != size_t(kv_dim))
      fail("static KV ranges have {} / {} channels, expected {}", c.static_min.size(), c.static_max.size(), kv_dim);
    // The codec keeps each channel's min and step in fp16: a range that is
    // not finite, reversed or past fp16's largest value would encode garbage.
    constexpr float kFp16Max = 65504.0f;
    for (int d = 0; d < kv_dim; ++d) {
      const float lo = c.static_min[size_t(d)], hi = c.static_max[size_t(d)];
      if (!(lo <= hi) || !(lo >= -kFp16Max) || !(hi <= kFp16Max))
        fail("static KV range of channel {} is [{}, {}]: ranges must be ordered and within fp16's +-65504", d, lo, hi);
    }
    return make_int_codec(c, shape);
  }
  if (c.group_size < 0) fail("--kv-group must be positive (got {})", c.group_size);
  if (c.grouping == KvGrouping::Token) {
    if (c.group_size == 0) c.group_size = shape.head_dim;
    const bool within_head = shape.head_dim % c.group_size == 0;
    const bool across_heads = c.group_size % shape.head_dim == 0 && kv_dim % c.group_size == 0;
    if (!within_head && !across_heads)
      fail("token group of {} values must divide the head dimension {} or be a multiple of it dividing the "
           "KV row {}", c.group_size, shape.head_dim, kv_dim);
  } else {
    if (c.group_size == 0) c.group_size = shape.block_size;
    if (c.group_size > shape.block_size)
      fail("channel group of {} tokens is larger than the block of {} tokens", c.group_size, shape.block_size);
    if (shape.block_size % c.group_size != 0)
      fail("channel group of {} tokens must divide the block size {}", c.group_size, shape.block_size);
  }
  if (c.scale_bits == 8) {
    const bool head_major = shape.head_dim * kv_dtype_bits(c.dtype) % 8 == 0 &&
                            (c.grouping == KvGrouping::Channel || shape.head_dim % c.group_size == 0);
    if (!head_major)
      fail("8-bit KV scales need head-major blocks: token groups within a head and head_dim * bits filling whole "
           "bytes ({} with head_dim {})", c.describe(), shape.head_dim);
  }
  return make_int_codec(c, shape);
}

void KvCodec::decode_head(const uint8_t* block, int n, int kv_head, float* out) const {
  const int hd = shape_.head_dim;
  std::vector<float> row(static_cast<size_t>(shape_.kv_dim()));
  for (int t = 0; t < n; ++t) {
    decode_token(block, t, row.data());
    std::copy(row.begin() + kv_head * hd, row.begin() + (kv_head + 1) * hd, out + size_t(t) * hd);
  }
}

void score_reference(const KvCodec& codec, const float* q, int n_q, const uint8_t* block, int n, int kv_head,
                     float scale, float* scores, int stride) {
  const int hd = codec.shape().head_dim;
  std::vector<float> key(static_cast<size_t>(codec.shape().kv_dim()));
  for (int t = 0; t < n; ++t) {
    codec.decode_token(block, t, key.data());
    for (int i = 0; i < n_q; ++i) {
      double sum = 0;
      for (int d = 0; d < hd; ++d) sum += double(q[i * hd + d]) * key[size_t(kv_head * hd + d)];
      scores[i * stride + t] = float(scale * sum);
    }
  }
}

void accumulate_reference(const KvCodec& codec, const float* weights, int n_q, int stride, const uint8_t* block,
                          int n, int kv_head, float* out) {
  const int hd = codec.shape().head_dim;
  std::vector<float> value(static_cast<size_t>(codec.shape().kv_dim()));
  for (int t = 0; t < n; ++t) {
    codec.decode_token(block, t, value.data());
    for (int i = 0; i < n_q; ++i)
      for (int d = 0; d < hd; ++d) out[i * hd + d] += weights[i * stride + t] * value[size_t(kv_head * hd + d)];
  }
}

}  // namespace kvserve
