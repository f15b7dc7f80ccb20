#include "kv/int_codecs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/vector_ops.h"
#include "util/half.h"

namespace kvserve {
namespace {

// Codes of B bits packed little-endian within each byte: code i of a row sits
// in byte i * B / 8 at bit (i * B) % 8.
template <int B>
inline int get_code(const uint8_t* row, int i) {
  if constexpr (B == 8) return row[i];
  else return (row[(i * B) >> 3] >> ((i * B) & 7)) & ((1 << B) - 1);
}

template <int B>
inline void set_code(uint8_t* row, int i, int c) {
  if constexpr (B == 8) {
    row[i] = uint8_t(c);
  } else {
    const int shift = (i * B) & 7;
    uint8_t& byte = row[(i * B) >> 3];
    byte = uint8_t((byte & ~(((1 << B) - 1) << shift)) | (c << shift));
  }
}

// The fp16-rounded (scale, min) of a group spanning [lo, hi]: codes are
// computed against the rounded values so decode reproduces them exactly.
struct Affine {
  float scale, min;
  fp16_t scale16, min16;
};

template <int B>
Affine fit_affine(float lo, float hi) {
  constexpr int kLevels = (1 << B) - 1;
  Affine a;
  a.min16 = fp32_to_fp16(lo);
  a.min = fp16_to_fp32(a.min16);
  a.scale16 = fp32_to_fp16((hi - a.min) / kLevels);
  a.scale = fp16_to_fp32(a.scale16);
  return a;
}

template <int B>
inline int quantize(float x, float min, float inv_scale) {
  constexpr int kLevels = (1 << B) - 1;
  const int c = int(std::lrintf((x - min) * inv_scale));
  return std::clamp(c, 0, kLevels);
}

inline float inverse(float s) { return s > 0 ? 1.0f / s : 0.0f; }

// Score and accumulate for codecs whose tokens can be read one at a time:
// the token's head slice is dequantized into a head_dim scratch that stays in
// L1 (never a copy of the cache), then SIMD dot/axpy run on it.
template <class Derived>
class SliceCodec : public KvCodec {
 public:
  using KvCodec::KvCodec;

  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    const int hd = shape_.head_dim;
    float* k = scratch(hd);
    for (int t = 0; t < n; ++t) {
      self().dequantize_head(block, t, kv_head, k);
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot(q + i * hd, k, hd);
    }
  }
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    const int hd = shape_.head_dim;
    float* v = scratch(hd);
    for (int t = 0; t < n; ++t) {
      self().dequantize_head(block, t, kv_head, v);
      for (int i = 0; i < n_q; ++i) axpy(weights[i * stride + t], v, out + i * hd, hd);
    }
  }
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
    const int hd = shape_.head_dim;
    float* k = scratch(hd);
    for (int t = 0; t < n; ++t) {
      self().dequantize_head(block, t, kv_head, k);
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot(q + (size_t(t) * n_q + i) * hd, k, hd);
    }
  }
  void decode_token(const uint8_t* block, int slot, float* out) const override {
    for (int h = 0; h < shape_.n_kv_heads; ++h) self().dequantize_head(block, slot, h, out + h * shape_.head_dim);
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  static float* scratch(int n) {
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(n)) buf.resize(size_t(n));
    return buf.data();
  }
};

// Token groups: per token, packed codes of the row, then one fp16 (scale,
// min) pair per group of group_size values along the row.
template <int B>
class TokenGroupCodec final : public SliceCodec<TokenGroupCodec<B>> {
  using Base = SliceCodec<TokenGroupCodec<B>>;
  using Base::shape_;

 public:
  TokenGroupCodec(const KvCodecConfig& c, const KvBlockShape& s)
      : Base(c, s),
        group_(c.group_size),
        code_bytes_(size_t(s.kv_dim()) * B / 8),
        token_bytes_(code_bytes_ + size_t(s.kv_dim() / group_) * 2 * sizeof(fp16_t)) {}

  size_t block_bytes() const override { return size_t(shape_.block_size) * token_bytes_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    uint8_t* row = block + size_t(slot) * token_bytes_;
    fp16_t* meta = reinterpret_cast<fp16_t*>(row + code_bytes_);
    std::memset(row, 0, code_bytes_);
    for (int g = 0; g * group_ < shape_.kv_dim(); ++g) {
      const float* xg = x + g * group_;
      const auto [lo, hi] = std::minmax_element(xg, xg + group_);
      const Affine a = fit_affine<B>(*lo, *hi);
      meta[2 * g] = a.scale16;
      meta[2 * g + 1] = a.min16;
      const float inv = inverse(a.scale);
      for (int d = 0; d < group_; ++d) set_code<B>(row, g * group_ + d, quantize<B>(xg[d], a.min, inv));
    }
  }

  void dequantize_head(const uint8_t* block, int slot, int kv_head, float* out) const {
    const uint8_t* row = block + size_t(slot) * token_bytes_;
    const fp16_t* meta = reinterpret_cast<const fp16_t*>(row + code_bytes_);
    const int hd = shape_.head_dim, first = kv_head * hd;
    for (int d = 0; d < hd; ++d) {
      const int e = first + d, g = e / group_;
      out[d] = fp16_to_fp32(meta[2 * g + 1]) + fp16_to_fp32(meta[2 * g]) * float(get_code<B>(row, e));
    }
  }

 private:
  int group_;
  size_t code_bytes_;   // packed codes of one token row
  size_t token_bytes_;  // codes + metadata of one token
};

// Channel groups (KIVI keys) and static per-channel scales. Dynamic: the block
// holds packed codes (block_size rows), then per group of group_size tokens an
// fp16 (scale, min) pair per channel, fitted over those tokens. Static: codes
// only; the fixed per-channel ranges live in the codec.
template <int B>
class ChannelCodec final : public KvCodec {
 public:
  ChannelCodec(const KvCodecConfig& c, const KvBlockShape& s)
      : KvCodec(c, s),
        static_(c.is_static()),
        group_(static_ ? s.block_size : c.group_size),
        code_bytes_(size_t(s.kv_dim()) * B / 8) {
    if (static_) {
      for (int d = 0; d < s.kv_dim(); ++d) {
        const Affine a = fit_affine<B>(c.static_min[size_t(d)], std::max(c.static_max[size_t(d)], c.static_min[size_t(d)]));
        static_scale_.push_back(a.scale);
        static_min_.push_back(a.min);
        static_max_.push_back(std::max(c.static_max[size_t(d)], a.min));
      }
    }
  }

  size_t block_bytes() const override {
    const size_t meta = static_ ? 0 : size_t(shape_.block_size / group_) * size_t(shape_.kv_dim()) * 2 * sizeof(fp16_t);
    return size_t(shape_.block_size) * code_bytes_ + meta;
  }
  bool encodes_tokens() const override { return static_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    // Static scales only: values are clamped into the calibrated range.
    uint8_t* row = block + size_t(slot) * code_bytes_;
    std::memset(row, 0, code_bytes_);
    for (int d = 0; d < shape_.kv_dim(); ++d) {
      const float v = std::clamp(x[d], static_min_[size_t(d)], static_max_[size_t(d)]);
      set_code<B>(row, d, quantize<B>(v, static_min_[size_t(d)], inverse(static_scale_[size_t(d)])));
    }
  }

  void encode_block(uint8_t* block, const float* x, int n) const override {
    if (static_) {
      KvCodec::encode_block(block, x, n);
      return;
    }
    const int kv_dim = shape_.kv_dim();
    std::memset(block, 0, block_bytes());
    for (int tg = 0; tg * group_ < n; ++tg) {
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      fp16_t* meta = group_meta(block, tg);
      for (int d = 0; d < kv_dim; ++d) {
        float lo = x[size_t(t0) * kv_dim + d], hi = lo;
        for (int t = t0 + 1; t < t1; ++t) {
          lo = std::min(lo, x[size_t(t) * kv_dim + d]);
          hi = std::max(hi, x[size_t(t) * kv_dim + d]);
        }
        const Affine a = fit_affine<B>(lo, hi);
        meta[2 * d] = a.scale16;
        meta[2 * d + 1] = a.min16;
        const float inv = inverse(a.scale);
        for (int t = t0; t < t1; ++t)
          set_code<B>(block + size_t(t) * code_bytes_, d, quantize<B>(x[size_t(t) * kv_dim + d], a.min, inv));
      }
    }
  }

  void decode_token(const uint8_t* block, int slot, float* out) const override {
    const int kv_dim = shape_.kv_dim();
    std::vector<float> scale(static_cast<size_t>(kv_dim)), min(static_cast<size_t>(kv_dim));
    load_affine(block, slot / group_, 0, kv_dim, scale.data(), min.data());
    const uint8_t* row = block + size_t(slot) * code_bytes_;
    for (int d = 0; d < kv_dim; ++d) out[d] = min[size_t(d)] + scale[size_t(d)] * float(get_code<B>(row, d));
  }

  // q·k_t = sum_d (q_d * scale_d) * code_td + sum_d q_d * min_d: one scaled
  // query per token group, then integer codes against it.
  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(4 * size_t(hd));
    float *sc = s, *mn = s + hd, *qs = s + 2 * hd, *codes = s + 3 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      for (int i = 0; i < n_q; ++i) {
        const float* qi = q + i * hd;
        for (int d = 0; d < hd; ++d) qs[d] = qi[d] * sc[d];
        const float bias = dot(qi, mn, hd);
        for (int t = t0; t < t1; ++t) {
          unpack(block + size_t(t) * code_bytes_, first, hd, codes);
          scores[i * stride + t] = scale * (dot(qs, codes, hd) + bias);
        }
      }
    }
  }

  // Pre-RoPE keys: a query per token, so the scaled query is per token too.
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(4 * size_t(hd));
    float *sc = s, *mn = s + hd, *qs = s + 2 * hd, *codes = s + 3 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      for (int t = tg * group_; t < std::min(n, (tg + 1) * group_); ++t) {
        unpack(block + size_t(t) * code_bytes_, first, hd, codes);
        for (int i = 0; i < n_q; ++i) {
          const float* qi = q + (size_t(t) * n_q + i) * hd;
          for (int d = 0; d < hd; ++d) qs[d] = qi[d] * sc[d];
          scores[i * stride + t] = scale * (dot(qs, codes, hd) + dot(qi, mn, hd));
        }
      }
    }
  }

  // out_d += scale_d * sum_t w_t code_td + min_d * sum_t w_t, per token group.
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(3 * size_t(hd) + size_t(n_q) * hd);
    float *sc = s, *mn = s + hd, *codes = s + 2 * hd, *acc = s + 3 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      std::fill(acc, acc + size_t(n_q) * hd, 0.0f);
      std::vector<float> wsum(static_cast<size_t>(n_q), 0.0f);
      for (int t = t0; t < t1; ++t) {
        unpack(block + size_t(t) * code_bytes_, first, hd, codes);
        for (int i = 0; i < n_q; ++i) {
          const float w = weights[i * stride + t];
          wsum[size_t(i)] += w;
          axpy(w, codes, acc + i * hd, hd);
        }
      }
      for (int i = 0; i < n_q; ++i)
        for (int d = 0; d < hd; ++d) out[i * hd + d] += sc[d] * acc[i * hd + d] + mn[d] * wsum[size_t(i)];
    }
  }

 private:
  fp16_t* group_meta(uint8_t* block, int tg) const {
    return reinterpret_cast<fp16_t*>(block + size_t(shape_.block_size) * code_bytes_) + size_t(tg) * shape_.kv_dim() * 2;
  }
  const fp16_t* group_meta(const uint8_t* block, int tg) const {
    return reinterpret_cast<const fp16_t*>(block + size_t(shape_.block_size) * code_bytes_) +
           size_t(tg) * shape_.kv_dim() * 2;
  }
  // scale/min of channels [first, first + count) for token group tg.
  void load_affine(const uint8_t* block, int tg, int first, int count, float* scale, float* min) const {
    if (static_) {
      std::copy_n(static_scale_.begin() + first, count, scale);
      std::copy_n(static_min_.begin() + first, count, min);
      return;
    }
    const fp16_t* meta = group_meta(block, tg);
    for (int d = 0; d < count; ++d) {
      scale[d] = fp16_to_fp32(meta[2 * (first + d)]);
      min[d] = fp16_to_fp32(meta[2 * (first + d) + 1]);
    }
  }
  static void unpack(const uint8_t* row, int first, int count, float* out) {
    for (int d = 0; d < count; ++d) out[d] = float(get_code<B>(row, first + d));
  }
  static float* scratch(size_t n) {
    thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }

  bool static_;
  int group_;          // tokens per (scale, min) group
  size_t code_bytes_;  // packed codes of one token row
  std::vector<float> static_scale_, static_min_, static_max_;  // (kv_dim) when static
};

// llama.cpp's q4_0: per token, blocks of 32 consecutive values with one fp16
// scale d = (value of largest magnitude) / -8 and codes q = x / d + 8 in 0..15;
// element j < 16 in the low nibble of byte j, element j + 16 in the high one.
class Q4_0Codec final : public SliceCodec<Q4_0Codec> {
 public:
  static constexpr int kBlock = 32;
  static constexpr size_t kBlockBytes = sizeof(fp16_t) + kBlock / 2;

  Q4_0Codec(const KvCodecConfig& c, const KvBlockShape& s)
      : SliceCodec(c, s), token_bytes_(size_t(s.kv_dim() / kBlock) * kBlockBytes) {}

  size_t block_bytes() const override { return size_t(shape_.block_size) * token_bytes_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    uint8_t* row = block + size_t(slot) * token_bytes_;
    for (int b = 0; b * kBlock < shape_.kv_dim(); ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0, max = 0;
      for (int j = 0; j < kBlock; ++j)
        if (std::fabs(xb[j]) > amax) amax = std::fabs(xb[j]), max = xb[j];
      const fp16_t d16 = fp32_to_fp16(max / -8.0f);
      const float d = fp16_to_fp32(d16), id = d != 0 ? 1.0f / d : 0.0f;
      uint8_t* out = row + size_t(b) * kBlockBytes;
      std::memcpy(out, &d16, sizeof d16);
      for (int j = 0; j < kBlock / 2; ++j) {
        const int lo = std::min(15, int(xb[j] * id + 8.5f));
        const int hi = std::min(15, int(xb[j + kBlock / 2] * id + 8.5f));
        out[sizeof(fp16_t) + j] = uint8_t(std::max(lo, 0) | (std::max(hi, 0) << 4));
      }
    }
  }

  void dequantize_head(const uint8_t* block, int slot, int kv_head, float* out) const {
    const uint8_t* row = block + size_t(slot) * token_bytes_;
    const int hd = shape_.head_dim, first = kv_head * hd;
    for (int i = 0; i < hd; ++i) {
      const int e = first + i, b = e / kBlock, j = e % kBlock;
      const uint8_t* blk = row + size_t(b) * kBlockBytes;
      fp16_t d16;
      std::memcpy(&d16, blk, sizeof d16);
      const uint8_t byte = blk[sizeof(fp16_t) + (j % (kBlock / 2))];
      const int q = j < kBlock / 2 ? (byte & 15) : (byte >> 4);
      out[i] = fp16_to_fp32(d16) * float(q - 8);
    }
  }

 private:
  size_t token_bytes_;
};

template <int B>
std::unique_ptr<KvCodec> make_int(const KvCodecConfig& c, const KvBlockShape& s) {
  if (c.grouping == KvGrouping::Channel || c.is_static()) return std::make_unique<ChannelCodec<B>>(c, s);
  return std::make_unique<TokenGroupCodec<B>>(c, s);
}

}  // namespace

std::unique_ptr<KvCodec> make_int_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  switch (config.dtype) {
    case KvDType::INT8: return make_int<8>(config, shape);
    case KvDType::INT4: return make_int<4>(config, shape);
    default: return make_int<2>(config, shape);
  }
}

std::unique_ptr<KvCodec> make_q4_0_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  return std::make_unique<Q4_0Codec>(config, shape);
}

}  // namespace kvserve
