#include "kv/int_codecs.h"

#include "kv/channel_codec.h"
#include "kv/int_codec_kernels.h"
#include "kv/scale8.h"
#include "kv/token_key_scores8.h"
#include "util/error.h"

#include <atomic>

namespace kvserve {
namespace int_codec {

// set_byte_value_weights: on by default.
std::atomic<bool> g_byte_value_weights{true};

// Whether TokenGroupCodec accumulates these values with 8-bit weights
// (accumulate_bytes): 4- or 2-bit dynamic codes with one group per head, head-major,
// in blocks of 32+ tokens (a multiple of 4), on AVX-512 VNNI + VBMI builds;
// of 16+ tokens on AVX2 builds.
// Heads of a multiple of 64 channels take the vector kernel; heads the
// vector float path cannot walk either (not a multiple of 32 channels:
// stories260K's 8) a scalar loop with the same numbers. The rest keep the
// float path, faster than that loop.
// With 16-token blocks (int4's former preset layout) the 8-bit fold's extra
// work ate the gain: 0.99-1.01x of the 16-bit layer time against 0.95x at 32 tokens
// (BM_ValueWeights, BENCHMARKS.md), as for the keys' 8-bit query.
// AVX2 builds (accumulate_bytes8) take the same numbers, with vpmaddubsw
// over token pairs; there 16-token blocks gain as well (int4 token groups,
// a 4K layer in cache on Zen 2: 903 -> 779 us against 16-bit weights).
static bool byte_weight_kernel(const KvCodecConfig& c, const KvBlockShape& s) {
#if (defined(__AVX512VBMI__) && defined(__AVX512VNNI__)) || \
    (!defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
  constexpr int kMinBlock = 32;
#else
  constexpr int kMinBlock = 16;
#endif
  // A head's codes must fill whole bytes: otherwise the block is stored
  // token by token (head_major_), not in the per-head runs these kernels read.
  const int bits = c.dtype == KvDType::INT4 ? 4 : 2;
  return g_byte_value_weights.load(std::memory_order_relaxed) && (c.dtype == KvDType::INT4 || c.dtype == KvDType::INT2) &&
         c.grouping == KvGrouping::Token && !c.is_static() && c.group_size == s.head_dim &&
         s.head_dim * bits % 8 == 0 && (s.head_dim % 64 == 0 || s.head_dim % 32 != 0) && s.head_dim % 2 == 0 &&
         s.block_size >= kMinBlock && s.block_size % 4 == 0;
#else
  (void)c, (void)s;
  return false;
#endif
}

// Whether TokenGroupCodec<B> scores keys in groups of `group` values as
// integer dot products (token_key_scores8.h; AVX2 builds): head slices of
// whole units (64 codes; 32 of 8 bits), and a whole head in one group or
// head-major groups (at most 8 a head) of whole lanes. Returns the query's
// rounding steps (key_query_steps), else 0.
template <int B>
int integer_key_steps(int group, const KvBlockShape& s) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  using L = simd8::KeyLanes<B>;
  const int hd = s.head_dim;
  if (hd % L::kCodes != 0) return 0;
  const bool fits = group >= hd || (hd % group == 0 && hd / group <= 8 && !simd8::key_lane_groups<L>(hd, group).empty());
  return fits ? simd8::key_query_steps<L>(hd) : 0;
#else
  (void)group, (void)s;
  return 0;
#endif
}

// The same for llama.cpp's q4_0 blocks (Q4_0Codec): heads of whole 64-value
// units, at most 8 blocks.
inline int q4_0_key_steps(const KvBlockShape& s) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  using L = simd8::KeyLanesQ4_0;
  const bool fits = s.head_dim % L::kCodes == 0 && s.head_dim / 32 <= 8 && !simd8::key_lane_groups<L>(s.head_dim, 32).empty();
  return fits ? simd8::key_query_steps<L>(s.head_dim) : 0;
#else
  (void)s;
  return 0;
#endif
}

// Score and accumulate for codecs whose tokens can be read one at a time.
// With AVX-512 or AVX2 and a head slice the vector kernels can walk
// (Derived::simd_ready()), Derived::with_source hands them a source that
// dequantizes in registers. Otherwise (and as the scalar reference beside
// them) the token's head slice is dequantized into a head_dim scratch that
// stays in L1, then dot/axpy run on it.
template <class Derived>
class SliceCodec : public KvCodec {
 public:
  using KvCodec::KvCodec;

  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    if (self().integer_score(q, n_q, block, n, kv_head, scale, scores, stride)) return;
#if defined(KVSERVE_TOKEN_SOURCES)
    if (self().simd_ready()) {
      self().with_source(block, kv_head,
                         [&](const auto& src) { source_kernels::score(src, q, n_q, false, n, scale, scores, stride); });
      return;
    }
#endif
    const int hd = shape_.head_dim;
    float* k = scratch(hd);
    for (int t = 0; t < n; ++t) {
      self().dequantize_head(block, t, kv_head, k);
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot(q + i * hd, k, hd);
    }
  }
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    if (self().integer_accumulate(weights, n_q, stride, block, n, kv_head, out)) return;
#if defined(KVSERVE_TOKEN_SOURCES)
    if (self().simd_ready()) {
      self().with_source(block, kv_head,
                         [&](const auto& src) { source_kernels::accumulate(src, weights, n_q, stride, n, out); });
      return;
    }
#endif
    const int hd = shape_.head_dim;
    float* v = scratch(hd);
    for (int t = 0; t < n; ++t) {
      self().dequantize_head(block, t, kv_head, v);
      for (int i = 0; i < n_q; ++i) axpy(weights[i * stride + t], v, out + i * hd, hd);
    }
  }
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
#if defined(KVSERVE_TOKEN_SOURCES)
    if (self().simd_ready()) {
      self().with_source(block, kv_head,
                         [&](const auto& src) { source_kernels::score(src, q, n_q, true, n, scale, scores, stride); });
      return;
    }
#endif
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

 protected:
  // A codec with a faster score or accumulate for some layouts hides these
  // and returns true where it ran.
  bool integer_score(const float*, int, const uint8_t*, int, int, float, float*, int) const { return false; }
  bool integer_accumulate(const float*, int, int, const uint8_t*, int, int, float*) const { return false; }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  static float* scratch(int n) {
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(n)) buf.resize(size_t(n));
    return buf.data();
  }
};

// Token groups: one fp16 (scale, min) pair per group of group_size values
// along the row. Head-major when groups stay inside a head (group_size
// divides head_dim) and a head's codes fill whole bytes: per KV head, codes
// (block_size, head_dim) then pairs (block_size, head_dim / group_size).
// Otherwise token-major: per token, packed codes of the row, then its pairs.
template <int B>
class TokenGroupCodec final : public SliceCodec<TokenGroupCodec<B>> {
  using Base = SliceCodec<TokenGroupCodec<B>>;
  using Base::shape_;

 public:
  TokenGroupCodec(const KvCodecConfig& c, const KvBlockShape& s)
      : Base(c, s),
        group_(c.group_size),
        code_bytes_(size_t(s.kv_dim()) * B / 8),
        token_bytes_(code_bytes_ + size_t(s.kv_dim() / group_) * 2 * sizeof(fp16_t)),
        head_major_(group_ <= s.head_dim && s.head_dim % group_ == 0 && s.head_dim * B % 8 == 0),
        head_code_bytes_(size_t(s.head_dim) * B / 8),
        head_groups_(s.head_dim / group_),
        head_bytes_(c.scale_bits == 8 ? size_t(s.block_size) * head_code_bytes_ +
                                            scale8::run_bytes(s.block_size * head_groups_)
                                      : size_t(s.block_size) * token_bytes_ / size_t(s.n_kv_heads)),
        compact_(c.scale_bits == 8) {
#if defined(__AVX512F__)
    using Order = simd::Lanes<B>;
    const int hd = s.head_dim;
    // Groups inside a head are looked up per lane from one vector of (at most
    // 16) group scales; finer groups take the scalar path.
    simd_ = hd % Order::kCodes == 0 && (group_ >= hd || hd / group_ <= 16);
#if defined(__AVX512BW__)
    pairs_ready_ = head_major_ && group_ == hd && B >= 4 && hd % kUnitChannels == 0;
#endif
    byte_weights_ = byte_weight_kernel(c, s);
    if (simd_ && group_ < hd)
      for (int p = 0; p < hd; ++p) {  // lane-order position p -> element of the head slice
        const int c = p / Order::kCodes, k = p % Order::kCodes / 16, j = p % 16;
        lane_group_.push_back((c * Order::kCodes + j * Order::kVecs + k) / group_);
      }
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
    pairs_ready_ = head_major_ && group_ == s.head_dim && B >= 4 && s.head_dim % 16 == 0;
    byte_weights_ = byte_weight_kernel(c, s);
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    integer_keys_ = integer_key_steps<B>(group_, s) > 0;
    if (integer_keys_ && group_ < s.head_dim) key_lane_groups_ = simd8::key_lane_groups<simd8::KeyLanes<B>>(s.head_dim, group_);
#endif
#if !defined(__AVX512F__) && defined(KVSERVE_TOKEN_SOURCES)
    using Order = simd8::Lanes8<B>;
    const int hd = s.head_dim;
    // Groups inside a head are looked up per lane from one vector of (at
    // most 8) group scales; finer groups take the scalar path.
    simd_ = hd % Order::kCodes == 0 && (group_ >= hd || (head_major_ && hd / group_ <= 8));
    if (simd_ && group_ < hd)
      for (int p = 0; p < hd; ++p) {  // lane-order position p -> element of the head slice
        const int c = p / Order::kCodes, k = p % Order::kCodes / 8, j = p % 8;
        lane_group_.push_back((c * Order::kCodes + j * Order::kVecs + k) / group_);
      }
#endif
  }

  size_t block_bytes() const override {
    return compact_ ? size_t(shape_.n_kv_heads) * head_bytes_ : size_t(shape_.block_size) * token_bytes_;
  }
  // 8-bit scales share a header per (block, head): a block is encoded whole.
  bool encodes_tokens() const override { return !compact_; }

  void encode_block(uint8_t* block, const float* x, int n) const override {
    if (!compact_) {
      KvCodec::encode_block(block, x, n);
      return;
    }
    std::memset(block, 0, block_bytes());
    const int hd = shape_.head_dim, kv_dim = shape_.kv_dim(), groups = shape_.block_size * head_groups_;
    std::vector<float> lo(static_cast<size_t>(groups), 0.0f), hi(lo.size(), 0.0f), sc(lo.size()), mn(lo.size());
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      for (int t = 0; t < n; ++t)
        for (int g = 0; g < head_groups_; ++g) {
          const float* xg = x + size_t(t) * kv_dim + h * hd + g * group_;
          const auto [l, u] = std::minmax_element(xg, xg + group_);
          lo[size_t(t * head_groups_ + g)] = *l;
          hi[size_t(t * head_groups_ + g)] = *u;
        }
      scale8::encode_run(lo.data(), hi.data(), groups, (1 << B) - 1, head_run(block, h), sc.data(), mn.data());
      for (int t = 0; t < n; ++t)
        for (int g = 0; g < head_groups_; ++g) {
          const size_t i = size_t(t * head_groups_ + g);
          const float inv = inverse(sc[i]);
          for (int d = g * group_; d < (g + 1) * group_; ++d)
            set_code<B>(code_row(block, t, h), d, quantize<B>(x[size_t(t) * kv_dim + h * hd + d], mn[i], inv));
        }
    }
  }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    if (compact_) fail("{} encodes whole blocks, not single tokens", this->config_.describe());
    if (head_major_)
      for (int h = 0; h < shape_.n_kv_heads; ++h) std::memset(code_row(block, slot, h), 0, head_code_bytes_);
    else
      std::memset(code_row(block, slot, 0), 0, code_bytes_);
    for (int g = 0; g * group_ < shape_.kv_dim(); ++g) {
      const float* xg = x + g * group_;
      const auto [lo, hi] = std::minmax_element(xg, xg + group_);
      const Affine a = fit_affine<B>(*lo, *hi);
      const fp16_t sm[2] = {a.scale16, a.min16};
      std::memcpy(pair(block, slot, g), sm, sizeof sm);  // token rows of odd length leave pairs unaligned
      const float inv = inverse(a.scale);
      for (int d = 0; d < group_; ++d) {
        const int e = g * group_ + d;
        set_code<B>(code_row(block, slot, e / shape_.head_dim), index(e), quantize<B>(xg[d], a.min, inv));
      }
    }
  }

  int token_spans(int slot, int kv_head, ByteSpan* out) const override {
    if (!head_major_ || compact_) return 0;
    const size_t head = size_t(kv_head) * head_bytes_, pairs = size_t(head_groups_) * 2 * sizeof(fp16_t);
    out[0] = {head + size_t(slot) * head_code_bytes_, head_code_bytes_};
    out[1] = {head + size_t(shape_.block_size) * head_code_bytes_ + size_t(slot) * pairs, pairs};
    return 2;
  }

  void dequantize_head(const uint8_t* block, int slot, int kv_head, float* out) const {
    const uint8_t* row = code_row(block, slot, kv_head);
    const int hd = shape_.head_dim, first = kv_head * hd;
    if (head_major_) {  // the head's groups lie within it: one (scale, min) per group_ codes
      for (int g = 0; g < head_groups_; ++g) {
        float scale, min;
        if (compact_) {
          scale8::decode_one(head_run(block, kv_head), shape_.block_size * head_groups_, slot * head_groups_ + g,
                             &scale, &min);
        } else {
          fp16_t sm[2];
          std::memcpy(sm, pair(block, slot, first / group_ + g), sizeof sm);
          scale = fp16_to_fp32(sm[0]);
          min = fp16_to_fp32(sm[1]);
        }
        int d = g * group_;
#if defined(__AVX2__) && defined(__FMA__)
        // 8 bytes at a time: 8 codes (B = 8) or 16 (B = 4: low nibbles are
        // the even elements, high nibbles the odd ones, interleaved back).
        if constexpr (B == 8 || B == 4) {
          const __m256 sv = _mm256_set1_ps(scale), mv = _mm256_set1_ps(min);
          constexpr int kStep = 64 / B;
          for (; d + kStep <= (g + 1) * group_ && (d * B) % 8 == 0; d += kStep) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d * B / 8)));
            if constexpr (B == 8) {
              _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), sv, mv));
            } else {
              const __m256i nib = _mm256_set1_epi32(15);
              const __m256 even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, nib)), sv, mv);
              const __m256 odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sv, mv);
              const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
              _mm256_storeu_ps(out + d, _mm256_permute2f128_ps(lo, hi, 0x20));
              _mm256_storeu_ps(out + d + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
          }
        }
#endif
        for (; d < (g + 1) * group_; ++d) out[d] = min + scale * float(get_code<B>(row, d));
      }
      return;
    }
    for (int d = 0; d < hd; ++d) {
      const int e = first + d;
      fp16_t sm[2];
      std::memcpy(sm, pair(block, slot, e / group_), sizeof sm);
      out[d] = fp16_to_fp32(sm[1]) + fp16_to_fp32(sm[0]) * float(get_code<B>(row, index(e)));
    }
  }

#if defined(KVSERVE_TOKEN_SOURCES)
  bool simd_ready() const { return simd_; }
#endif

  // Keys as integer dot products against the query rounded once per call
  // (token_key_scores8.h), on AVX2 builds: head slices of whole units
  // (64 codes; 32 of 8 bits) and groups of whole lanes, at most 8 a head.
  bool integer_score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
                     int stride) const {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (!integer_keys_ || n <= 0) return false;
    using L = simd8::KeyLanes<B>;
    const int hd = shape_.head_dim, units = hd / L::kCodes;
    const uint8_t* codes = head_major_ ? code_row(block, 0, kv_head) : block + size_t(kv_head * hd) * B / 8;
    const size_t code_stride = head_major_ ? head_code_bytes_ : token_bytes_;
    const int groups = group_ >= hd ? 1 : head_groups_;
    thread_local std::vector<float> affines;
    const size_t per = (size_t(shape_.block_size) * groups + 7) / 8 * 8;  // past n: read, never stored
    affines.resize(2 * per);
    float *sc = affines.data(), *mn = sc + per;
    head_affines(block, kv_head, n, sc, mn);
    const simd8::KeyQueries kq = simd8::round_queries<L>(q, n_q, hd, group_, scale);
    simd::prefetch_rows(codes, code_stride, n, size_t(hd) * B / 8);
    simd8::with_units(units, [&](auto u) {
      simd::by_query_passes<3>(n_q, [&](auto m, int i) {
        if (groups == 1)
          simd8::score_head_group<L, m, u>(codes, code_stride, units, kq, i, sc, mn, n, scores, stride);
        else
          simd8::score_sub_groups<L, m, u>(codes, code_stride, units, kq, i, simd8::ArrayAffines(sc, mn, groups),
                                           key_lane_groups_.data(), n, scores, stride);
      });
    });
    return true;
#else
    (void)q, (void)n_q, (void)block, (void)n, (void)kv_head, (void)scale, (void)scores, (void)stride;
    return false;
#endif
  }
  // The first n tokens' (scale, min) of every group of KV head kv_head as
  // floats: sc, mn (n, groups in the head; one where a group spans heads).
  void head_affines(const uint8_t* block, int kv_head, int n, float* sc, float* mn) const {
    if (compact_) {
      scale8::decode_run(head_run(block, kv_head), shape_.block_size * head_groups_, sc, mn);
    } else if (head_major_) {
      split_pair_run(reinterpret_cast<const fp16_t*>(head_run(block, kv_head)), n * head_groups_, sc, mn);
    } else {
      for (int t = 0; t < n; ++t) {
        fp16_t sm[2];
        std::memcpy(sm, pair(block, t, kv_head * shape_.head_dim / group_), sizeof sm);
        sc[t] = fp16_to_fp32(sm[0]);
        mn[t] = fp16_to_fp32(sm[1]);
      }
    }
  }

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
  // Values with one group per head (head-major, 8- or 4-bit codes):
  //   out_i += sum_t w_it (min_t + scale_t code_t)
  //          = sum_t w_it min_t + sum_t u_it code_t,  u_it = w_it scale_t,
  // with u rounded to 16 bits, one step per (query, call). Two tokens' codes
  // interleave as 16-bit pairs per channel and meet (u_t, u_t+1) in pairwise
  // integer dot products: no float dequantization, two tokens per
  // instruction. The interleave permutes channels within 128-bit lanes; that
  // is undone once per call.
  // AVX2 machines run the same with 8 lanes, 16 channels per unit (16 bytes
  // of 8-bit codes, 8 of 4-bit) and vpmaddwd.
  bool integer_accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                          float* out) const {
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    if constexpr (B == 4 || B == 2)
      if (byte_weights_ && n > 0) {
        accumulate_bytes(weights, n_q, stride, block, n, kv_head, out);
        return true;
      }
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
    if constexpr (B == 4 || B == 2)
      if (byte_weights_ && n > 0) {
        accumulate_bytes8(weights, n_q, stride, block, n, kv_head, out);
        return true;
      }
#endif
    if (!pairs_ready_ || n <= 0) return false;
    const int hd = shape_.head_dim, n2 = (n + 1) / 2 * 2;  // tokens, padded to whole pairs
    const uint8_t* codes = head_codes(block, kv_head);
#if defined(__AVX512BW__)
    const uint8_t* meta = head_pairs(block, kv_head);
    simd::prefetch_rows(codes, head_bytes_, 1, head_bytes_);
    const float qmax = folded_qmax<B>(n2);
    const int ns = (n2 + 15) / 16 * 16;  // floats of u per query
    const WeightScratch f = weight_scratch(n_q, ns, size_t(n_q) * n2 / 2);
    int16_t* u16 = reinterpret_cast<int16_t*>(f.words);  // (n_q, n2)
    by_query_groups(n_q, [&](auto nq, int i) {
      fold_weights<nq.value>(weights + size_t(i) * stride, stride, meta, n, n2, ns, qmax, f.u, f.step + i,
                             f.bias + i, u16 + size_t(i) * n2);
      accumulate_pairs<nq.value>(codes, f.words + size_t(i) * n2 / 2, n2 / 2, n, f.step + i, f.bias + i,
                                 out + size_t(i) * hd);
    });
#else
    const FoldScratch8 f = fold_scratch8(block, kv_head, n, n_q, size_t(n_q) * n2 * sizeof(int16_t));
    int16_t* u16 = reinterpret_cast<int16_t*>(f.folded);  // (n_q, n2)
    for (int i = 0; i < n_q; ++i)
      fold_weights8<int16_t>(weights + size_t(i) * stride, f.sc, f.mn, n, n2, folded_qmax<B>(n2), f.u, f.step + i,
                             f.bias + i, u16 + size_t(i) * n2);
    for (int unit = 0; unit < hd; unit += 16)
      by_query_groups(n_q, [&](auto nq, int i) {
        accumulate_pairs8<nq.value>(codes, reinterpret_cast<const int32_t*>(u16 + size_t(i) * n2), n2 / 2, n, unit,
                                    f.step + i, f.bias + i, out + size_t(i) * hd);
      });
#endif
    return true;
  }
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
  // accumulate_bytes on AVX2, the same numbers: u8_t = round(w_t scale_t /
  // step), step = max_t w_t scale_t / 127 per (query, block), the rounding
  // residual's midpoint part in the bias (fold_weights8). vpmaddubsw
  // multiplies two tokens' code bytes (unsigned) by their two weights per
  // 16-bit lane (accumulate_pairs_bytes8); heads that are not a multiple of
  // 64 channels take the scalar loop accumulate_bytes runs for them.
  void accumulate_bytes8(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                         float* out) const {
    const int hd = shape_.head_dim, n2 = (n + 1) / 2 * 2;  // tokens, padded to whole pairs (block_size % 4 == 0)
    const uint8_t* codes = head_codes(block, kv_head);
    const FoldScratch8 f = fold_scratch8(block, kv_head, n, n_q, size_t(n_q) * n2);
    const float *step = f.step, *bias = f.bias;
    int8_t* u8 = reinterpret_cast<int8_t*>(f.folded);  // (n_q, n2)
    for (int i = 0; i < n_q; ++i)
      fold_weights8<int8_t>(weights + size_t(i) * stride, f.sc, f.mn, n, n2, 127.0f, f.u, f.step + i, f.bias + i,
                            u8 + size_t(i) * n2);
    if (hd % 64 == 0) {
      simd::by_query_passes<3>(n_q, [&](auto nq, int i) {
        if constexpr (B == 2)
          accumulate_pairs_bytes8_2bit<nq.value>(codes, u8 + size_t(i) * n2, n2, step + i, bias + i, out + size_t(i) * hd);
        else
          accumulate_pairs_bytes8<nq.value>(codes, u8 + size_t(i) * n2, n2, step + i, bias + i, out + size_t(i) * hd);
      });
      return;
    }
    for (int k = 0; k < n_q; ++k)
      for (int d = 0; d < hd; ++d) {
        int32_t acc = 0;
        for (int t = 0; t < n; ++t) acc += int32_t(u8[size_t(k) * n2 + t]) * get_code<B>(codes + size_t(t) * head_code_bytes_, d);
        out[size_t(k) * hd + d] += float(acc) * step[k] + bias[k];
      }
  }
  // Per-thread scratch of the AVX2 value folds, with the head's tokens'
  // (scale, min) as floats (whole heads are one group): sc, mn and u
  // (block_size rounded up to 8 each; 8-bit runs decode the whole block),
  // step and bias (n_q each), and `folded_bytes` of folded weights.
  struct FoldScratch8 {
    float *sc, *mn, *u, *step, *bias;
    void* folded;
  };
  FoldScratch8 fold_scratch8(const uint8_t* block, int kv_head, int n, int n_q, size_t folded_bytes) const {
    const size_t ns = size_t(shape_.block_size + 7) / 8 * 8;
    thread_local std::vector<float> fbuf;
    thread_local std::vector<int32_t> words;
    if (fbuf.size() < 3 * ns + 2 * size_t(n_q)) fbuf.resize(3 * ns + 2 * size_t(n_q));
    if (words.size() * sizeof(int32_t) < folded_bytes) words.resize((folded_bytes + 3) / 4);
    float* sc = fbuf.data();
    const FoldScratch8 f{sc, sc + ns, sc + 2 * ns, sc + 3 * ns, sc + 3 * ns + n_q, words.data()};
    if (compact_) scale8::decode_run(head_run(block, kv_head), shape_.block_size, f.sc, f.mn);
    else split_pair_run(reinterpret_cast<const fp16_t*>(head_run(block, kv_head)), n, f.sc, f.mn);
    return f;
  }
  // fold_weights<NQ, Out> on 8 lanes for one query: w (n), the tokens'
  // scales and mins sc, mn (n); u: scratch of n2 rounded up to 8 floats.
  // Out = int8_t (qmax 127) adds the midpoint term; int16_t (16-bit pairs)
  // takes the bias without it.
  template <class Out>
  static void fold_weights8(const float* w, const float* sc, const float* mn, int n, int n2, float qmax, float* u,
                            float* step, float* bias, Out* folded) {
    constexpr bool kBytes = sizeof(Out) == 1;
    __m256 top = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int t = 0; t < n2; t += 8) {
      // Tokens past n weigh nothing (their weights and metadata are not read).
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), lane);
      const __m256 s = _mm256_maskload_ps(sc + t, live);
      __m256 m = _mm256_maskload_ps(mn + t, live);
      if constexpr (kBytes) m = _mm256_fmadd_ps(s, _mm256_set1_ps(kMid), m);  // the midpoint term
      const __m256 wt = _mm256_maskload_ps(w + t, live);
      const __m256 ut = _mm256_mul_ps(wt, s);
      top = _mm256_max_ps(top, ut);
      b = _mm256_fmadd_ps(wt, m, b);
      _mm256_storeu_ps(u + t, ut);
    }
    const float mx = kvserve::simd::hmax8(top);
    *step = mx * (1.0f / qmax);
    const __m256 inv = _mm256_set1_ps(mx > qmax / std::numeric_limits<float>::max() ? qmax / mx : 0.0f);
    __m256i rounded_sum = _mm256_setzero_si256();
    for (int t = 0; t < n2; t += 8) {
      const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(u + t), inv));
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      const __m128i packed = kBytes ? _mm_packs_epi16(w16, w16) : w16;
      if (t + 8 <= n2) {  // whole: stored without a call to memcpy
        if constexpr (kBytes) _mm_storel_epi64(reinterpret_cast<__m128i*>(folded + t), packed);
        else _mm_storeu_si128(reinterpret_cast<__m128i*>(folded + t), packed);
      } else {
        alignas(16) Out vals[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(vals), packed);
        std::memcpy(folded + t, vals, sizeof(Out) * size_t(n2 - t));
      }
      if constexpr (kBytes) rounded_sum = _mm256_add_epi32(rounded_sum, r);
    }
    *bias = kvserve::simd::hsum8(b);
    if constexpr (kBytes) {
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), rounded_sum);
      int32_t total = 0;
      for (int k = 0; k < 8; ++k) total += sums[k];
      // As fold_weights: the bias took kMid step sum_t x_t, the codes' midpoint
      // meets kMid step sum_t round(x_t).
      *bias -= kMid * *step * float(total);
    }
  }
  // The byte kernels' 16-bit sums: (query, K vectors).
  template <int NQ, int K>
  static void zero_parts(__m256i (&part)[NQ][K]) {
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i)
      #pragma GCC unroll 4
      for (int k = 0; k < K; ++k) part[i][k] = _mm256_setzero_si256();
  }
  // part[i][k] += each 16-bit lane's two codes (x[k]: tokens t and t + 1)
  // times query i's weights of those tokens, u8 (NQ, n2).
  template <int NQ, int K>
  static void add_pair_products(__m256i (&part)[NQ][K], const __m256i* x, const int8_t* u8, int n2, int t) {
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      int16_t pair;
      std::memcpy(&pair, u8 + size_t(i) * n2 + t, sizeof pair);
      const __m256i w = _mm256_set1_epi16(pair);
      #pragma GCC unroll 4
      for (int k = 0; k < K; ++k) part[i][k] = _mm256_add_epi16(part[i][k], _mm256_maddubs_epi16(x[k], w));
    }
  }
  // NQ (1 to 3) queries' 8-bit weights u8 (NQ, n2) against 4-bit codes, 64
  // channels (a 32-byte row) per unit. unpacklo/hi_epi8 of two tokens' rows
  // pair their bytes; the low nibbles then hold (channel 2p of token t, of
  // t + 1) and the high nibbles channel 2p + 1, and vpmaddubsw against the
  // (u_t, u_t+1) pair gives each channel's two products in one 16-bit lane.
  // Sixteen pairs stay in 16 bits before they are widened into the int32
  // sums, as unsigned sums: weights are >= 0 (KvCodec::accumulate), so every
  // product is, and 32 products of at most 15 x 127 (60960) fit below 2^16.
  // (Signed, only 16 would: widening half as often made int4-small's layer
  // ~2.5% faster on Zen 2.) The unpacklo half and the
  // unpackhi half take a pass over the tokens each: both at once kept twelve
  // sums for three queries, more than AVX2's sixteen registers hold beside
  // the codes, and the spills cost a fifth of the kernel on Zen 2.
  template <int NQ>
  void accumulate_pairs_bytes8(const uint8_t* codes, const int8_t* u8, int n2, const float* step, const float* bias,
                               float* out) const {
    const int hd = shape_.head_dim;
    const size_t row = head_code_bytes_;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int unit = 0; unit * 64 < hd; ++unit) {
      // acc[i][v]: v = even/odd nibbles of unpacklo (bytes 0-7 | 16-23), then of unpackhi (8-15 | 24-31).
      alignas(32) int32_t acc[NQ][4][16] = {};
      const uint8_t* base = codes + size_t(unit) * 32;
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        for (int t0 = 0; t0 < n2; t0 += 32) {
          __m256i part[NQ][2];
          zero_parts(part);
          const int t_end = std::min(n2, t0 + 32);
          for (int t = t0; t < t_end; t += 2) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + size_t(t) * row));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + size_t(t + 1) * row));
            const __m256i y = h == 0 ? _mm256_unpacklo_epi8(a, b) : _mm256_unpackhi_epi8(a, b);
            const __m256i x[2] = {_mm256_and_si256(y, nib), _mm256_and_si256(_mm256_srli_epi16(y, 4), nib)};
            add_pair_products(part, x, u8, n2, t);
          }
          #pragma GCC unroll 4
          for (int i = 0; i < NQ; ++i)
            #pragma GCC unroll 2
            for (int v = 0; v < 2; ++v) {
              __m256i* dst = reinterpret_cast<__m256i*>(acc[i][2 * h + v]);
              dst[0] = _mm256_add_epi32(dst[0], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(part[i][v])));
              dst[1] = _mm256_add_epi32(dst[1], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(part[i][v], 1)));
            }
        }
      // Word k of even/odd vector v is channel 2p / 2p + 1 with p = k (v = 0,
      // 1) or 8 + k (v = 2, 3) for k < 8, and p + 8 for k >= 8 (the upper
      // 128-bit lane): each 8 words of an even and an odd vector interleave
      // into 16 consecutive channels.
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int h = 0; h < 2; ++h)      // h = 0: unpacklo, channels 0-15 and 32-47; 1: unpackhi, 16-31 and 48-63
          #pragma GCC unroll 4
          for (int half = 0; half < 2; ++half) {
            const __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc[i][2 * h] + 8 * half));
            const __m256i o = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc[i][2 * h + 1] + 8 * half));
            const __m256i l = _mm256_unpacklo_epi32(e, o), r = _mm256_unpackhi_epi32(e, o);
            float* dst = out + size_t(i) * hd + unit * 64 + 32 * half + 16 * h;
            // Both immediates spelled out: a debug build (-O0/-O1) does not fold q.
            const __m256i halves[2] = {_mm256_permute2x128_si256(l, r, 0x20), _mm256_permute2x128_si256(l, r, 0x31)};
            #pragma GCC unroll 4
            for (int q = 0; q < 2; ++q) {
              const __m256i v = halves[q];
              _mm256_storeu_ps(dst + 8 * q, _mm256_add_ps(_mm256_loadu_ps(dst + 8 * q),
                                                          _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(step[i]),
                                                                          _mm256_set1_ps(bias[i]))));
            }
          }
    }
  }
  // accumulate_pairs_bytes8 for 2-bit codes: a unit's 64 channels are 16
  // bytes per token (byte p: channels 4p .. 4p + 3), so two tokens' paired
  // bytes fill one vector, and shifts by 2k with an AND give channel 4p + k's
  // pair of codes in 16-bit lane p. Sums of 32 pairs stay in 16 bits (64
  // products of at most 3 x 127: 24384).
  template <int NQ>
  void accumulate_pairs_bytes8_2bit(const uint8_t* codes, const int8_t* u8, int n2, const float* step,
                                    const float* bias, float* out) const {
    const int hd = shape_.head_dim;
    const size_t row = head_code_bytes_;
    const __m256i low2 = _mm256_set1_epi8(0x03);
    for (int unit = 0; unit * 64 < hd; ++unit) {
      alignas(32) int32_t acc[NQ][64] = {};  // channel order
      const uint8_t* base = codes + size_t(unit) * 16;
      for (int t0 = 0; t0 < n2; t0 += 64) {
        // Codes 0-1 of each byte in one pass over the tokens, 2-3 in a second
        // (as the 4-bit kernel's halves: four sums per query spilled).
        __m256i part[NQ][4];
        const int t_end = std::min(n2, t0 + 64);
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i half[NQ][2];
          zero_parts(half);
          for (int t = t0; t < t_end; t += 2) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + size_t(t) * row));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + size_t(t + 1) * row));
            const __m256i x = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));  // lane p: (a_p, b_p)
            const __m256i c[2] = {_mm256_and_si256(_mm256_srli_epi16(x, 4 * h), low2),
                                  _mm256_and_si256(_mm256_srli_epi16(x, 4 * h + 2), low2)};
            add_pair_products(half, c, u8, n2, t);
          }
          #pragma GCC unroll 4
          for (int i = 0; i < NQ; ++i) part[i][2 * h] = half[i][0], part[i][2 * h + 1] = half[i][1];
        }
        // Word p of part k is channel 4p + k: a 4 x 16 transpose puts the
        // channels in order (word lanes 0-7 hold p 0..7, lanes 8-15 p 8..15).
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          const __m256i a_lo = _mm256_unpacklo_epi16(part[i][0], part[i][1]), a_hi = _mm256_unpackhi_epi16(part[i][0], part[i][1]);
          const __m256i b_lo = _mm256_unpacklo_epi16(part[i][2], part[i][3]), b_hi = _mm256_unpackhi_epi16(part[i][2], part[i][3]);
          const __m256i q[4] = {_mm256_unpacklo_epi32(a_lo, b_lo), _mm256_unpackhi_epi32(a_lo, b_lo),
                                _mm256_unpacklo_epi32(a_hi, b_hi), _mm256_unpackhi_epi32(a_hi, b_hi)};
          #pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {  // q[j]: channels 8j .. 8j + 7, then 32 + 8j .. 32 + 8j + 7
            __m256i* lo = reinterpret_cast<__m256i*>(acc[i] + 8 * j);
            __m256i* hi = reinterpret_cast<__m256i*>(acc[i] + 32 + 8 * j);
            *lo = _mm256_add_epi32(*lo, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(q[j])));
            *hi = _mm256_add_epi32(*hi, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(q[j], 1)));
          }
        }
      }
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < 64; c += 8) {
          float* dst = out + size_t(i) * hd + unit * 64 + c;
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc[i] + c)));
          _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_fmadd_ps(sum, _mm256_set1_ps(step[i]),
                                                                                     _mm256_set1_ps(bias[i]))));
        }
    }
  }
  // Channels [c0, c0 + 16) of token t as 16-bit words in natural order.
  __m256i words16(const uint8_t* codes, int t, int c0) const {
    const uint8_t* p = codes + size_t(t) * head_code_bytes_ + size_t(c0) * B / 8;
    if constexpr (B == 8) return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), nib = _mm_set1_epi8(0x0F);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib)));
  }
  template <int NQ>
  void accumulate_pairs8(const uint8_t* codes, const int32_t* u, int upairs, int n, int c0, const float* step,
                         const float* bias, float* out) const {
    __m256i acc[NQ][2];
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < n; t += 2) {
      const __m256i a = words16(codes, t, c0), b = t + 1 < n ? words16(codes, t + 1, c0) : _mm256_setzero_si256();
      // Lane 4L + j of unpacklo holds word 8L + j, of unpackhi word 8L + 4 + j.
      const __m256i p0 = _mm256_unpacklo_epi16(a, b), p1 = _mm256_unpackhi_epi16(a, b);
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) {
        const __m256i ut = _mm256_set1_epi32(u[size_t(i) * upairs + t / 2]);
#if defined(__AVXVNNI__)
        acc[i][0] = _mm256_dpwssd_avx_epi32(acc[i][0], p0, ut);  // vpmaddwd and the add in one
        acc[i][1] = _mm256_dpwssd_avx_epi32(acc[i][1], p1, ut);
#else
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ut));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ut));
#endif
      }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      // Both immediates spelled out: a debug build (-O0/-O1) does not fold h.
      const __m256i halves[2] = {_mm256_permute2x128_si256(acc[i][0], acc[i][1], 0x20),
                                 _mm256_permute2x128_si256(acc[i][0], acc[i][1], 0x31)};
      #pragma GCC unroll 4
      for (int h = 0; h < 2; ++h) {  // channels c0 + 8h .. c0 + 8h + 7
        const __m256i v = halves[h];
        float* o = out + size_t(i) * shape_.head_dim + c0 + 8 * h;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_fmadd_ps(_mm256_cvtepi32_ps(v),
                                                                                _mm256_set1_ps(step[i]),
                                                                                _mm256_set1_ps(bias[i]))));
      }
    }
  }
#endif

#if defined(__AVX512F__)
  // One (scale, min) for the whole head slice (groups of head_dim or more).
  struct HeadSource {
    using Order = simd::Lanes<B>;
    const uint8_t* block;
    size_t code_off, code_stride;  // in bytes
    const uint8_t* meta;           // token 0's (scale, min) pairs
    size_t meta_stride;            // in bytes
    int head_dim;
    struct Cursor {
      const uint8_t* codes;
      __m512 scale, min;
      void chunk(int c, __m512* x) const {
        Order::unpack(codes + 16 * c, x);
        #pragma GCC unroll 16
        for (int k = 0; k < Order::kVecs; ++k) x[k] = _mm512_fmadd_ps(x[k], scale, min);
      }
    };
    void prefetch(int n) const {
      simd::prefetch_rows(block + code_off, code_stride, n, size_t(head_dim) * B / 8);
      simd::prefetch_rows(meta, meta_stride, n, 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      fp16_t sm[2];
      std::memcpy(sm, meta + size_t(t) * meta_stride, sizeof sm);
      return {block + code_off + size_t(t) * code_stride, _mm512_set1_ps(fp16_to_fp32(sm[0])),
              _mm512_set1_ps(fp16_to_fp32(sm[1]))};
    }
  };
  // Up to 16 groups inside the head slice: per-lane scale and min.
  struct GroupSource {
    using Order = simd::Lanes<B>;
    const uint8_t* block;
    size_t code_off, code_stride;  // in bytes
    const uint8_t* meta;           // token 0's (scale, min) pairs
    size_t meta_stride;            // in bytes
    int head_dim;
    __mmask16 group_mask;      // one bit per group of the head
    const int32_t* lane_group;  // (head_dim) group of each lane-order position
    struct Cursor {
      const uint8_t* codes;
      __m512 scale, min;  // lane g: group g of the head
      const int32_t* lane_group;
      void chunk(int c, __m512* x) const {
        Order::unpack(codes + 16 * c, x);
        #pragma GCC unroll 16
        for (int k = 0; k < Order::kVecs; ++k) {
          const __m512i g = _mm512_loadu_si512(lane_group + (c * Order::kVecs + k) * 16);
          x[k] = _mm512_fmadd_ps(x[k], _mm512_permutexvar_ps(g, scale), _mm512_permutexvar_ps(g, min));
        }
      }
    };
    void prefetch(int n) const {
      simd::prefetch_rows(block + code_off, code_stride, n, size_t(head_dim) * B / 8);
      const size_t groups = size_t(__builtin_popcount(unsigned(group_mask)));
      simd::prefetch_rows(meta, meta_stride, n, groups * 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      Cursor cur{block + code_off + size_t(t) * code_stride, {}, {}, lane_group};
      simd::split_pairs(_mm512_maskz_loadu_epi32(group_mask, meta + size_t(t) * meta_stride), cur.scale,
                        cur.min);
      return cur;
    }
  };
  template <class F>
  void with_source(const uint8_t* block, int kv_head, F&& f) const {
    const int hd = shape_.head_dim;
    const HeadRuns r = head_runs(block, kv_head);
    const size_t code_off = size_t(r.codes - block);
    if (group_ >= hd) {
      f(HeadSource{block, code_off, r.code_stride, r.meta, r.meta_stride, hd});
    } else {
      const __mmask16 mask = __mmask16((1u << (hd / group_)) - 1);
      f(GroupSource{block, code_off, r.code_stride, r.meta, r.meta_stride, hd, mask, lane_group_.data()});
    }
  }
#elif defined(KVSERVE_TOKEN_SOURCES)
  // The same two sources on 8 lanes (source_kernels8.h).
  struct HeadSource {
    using Order = simd8::Lanes8<B>;
    const uint8_t* codes;  // token 0's
    size_t code_stride;
    const uint8_t* meta;  // token 0's (scale, min) pair
    size_t meta_stride;   // in bytes
    int head_dim;
    struct Cursor {
      const uint8_t* codes;
      __m256 scale, min;
      void chunk(int c, __m256* x) const {
        Order::unpack(codes + 8 * c, x);
        #pragma GCC unroll 4
        for (int k = 0; k < Order::kVecs; ++k) x[k] = _mm256_fmadd_ps(x[k], scale, min);
      }
    };
    void prefetch(int n) const {
      simd::prefetch_rows(codes, code_stride, n, size_t(head_dim) * B / 8);
      simd::prefetch_rows(meta, meta_stride, n, 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      fp16_t sm[2];
      std::memcpy(sm, meta + size_t(t) * meta_stride, sizeof sm);
      return {codes + size_t(t) * code_stride, _mm256_set1_ps(fp16_to_fp32(sm[0])), _mm256_set1_ps(fp16_to_fp32(sm[1]))};
    }
  };
  // kChunkGroups: each chunk lies in one group (groups of a multiple of
  // Order::kCodes values), so one lookup serves the chunk's vectors.
  template <bool kChunkGroups>
  struct GroupSource {
    using Order = simd8::Lanes8<B>;
    const uint8_t* codes;
    size_t code_stride;
    const uint8_t* meta;
    size_t meta_stride;
    int head_dim, groups;       // groups of the head: at most 8
    __m256i group_mask;         // their lanes
    const int32_t* lane_group;  // (head_dim) group of each lane-order position
    struct Cursor {
      const uint8_t* codes;
      __m256 scale, min;  // lane g: group g of the head
      const int32_t* lane_group;
      void chunk(int c, __m256* x) const {
        Order::unpack(codes + 8 * c, x);
        if constexpr (kChunkGroups) {
          const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_group + c * Order::kCodes));
          const __m256 s = _mm256_permutevar8x32_ps(scale, g), m = _mm256_permutevar8x32_ps(min, g);
          #pragma GCC unroll 4
          for (int k = 0; k < Order::kVecs; ++k) x[k] = _mm256_fmadd_ps(x[k], s, m);
          return;
        }
        #pragma GCC unroll 4
        for (int k = 0; k < Order::kVecs; ++k) {
          const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_group + (c * Order::kVecs + k) * 8));
          x[k] = _mm256_fmadd_ps(x[k], _mm256_permutevar8x32_ps(scale, g), _mm256_permutevar8x32_ps(min, g));
        }
      }
    };
    void prefetch(int n) const {
      simd::prefetch_rows(codes, code_stride, n, size_t(head_dim) * B / 8);
      simd::prefetch_rows(meta, meta_stride, n, size_t(groups) * 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      // (scale, min) words: scales in the low halves, mins in the high ones.
      const __m256i w = _mm256_maskload_epi32(reinterpret_cast<const int*>(meta + size_t(t) * meta_stride), group_mask);
      auto halves = [](__m256i x) {
        return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
      };
      return {codes + size_t(t) * code_stride, halves(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF))),
              halves(_mm256_srli_epi32(w, 16)), lane_group};
    }
  };
  template <class F>
  void with_source(const uint8_t* block, int kv_head, F&& f) const {
    const int hd = shape_.head_dim;
    const HeadRuns r = head_runs(block, kv_head);
    if (group_ >= hd) {
      f(HeadSource{r.codes, r.code_stride, r.meta, r.meta_stride, hd});
    } else {
      const int groups = hd / group_;
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(groups), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      if (group_ % simd8::Lanes8<B>::kCodes == 0)
        f(GroupSource<true>{r.codes, r.code_stride, r.meta, r.meta_stride, hd, groups, mask, lane_group_.data()});
      else
        f(GroupSource<false>{r.codes, r.code_stride, r.meta, r.meta_stride, hd, groups, mask, lane_group_.data()});
    }
  }
#endif
#if defined(KVSERVE_TOKEN_SOURCES)
  // Where the sources read KV head kv_head: token 0's codes and (scale, min)
  // pairs, and the bytes from one token's to the next's (with 8-bit scales
  // the pairs are decoded into per-thread scratch, head_pairs).
  struct HeadRuns {
    const uint8_t* codes;
    size_t code_stride;
    const uint8_t* meta;
    size_t meta_stride;
  };
  HeadRuns head_runs(const uint8_t* block, int kv_head) const {
    const int hd = shape_.head_dim;
    if (head_major_)
      return {code_row(block, 0, kv_head), head_code_bytes_, head_pairs(block, kv_head),
              size_t(head_groups_) * 2 * sizeof(fp16_t)};
    return {block + size_t(kv_head * hd) * B / 8, token_bytes_,
            reinterpret_cast<const uint8_t*>(pair(block, 0, kv_head * hd / group_)), token_bytes_};
  }
#endif

 private:
  // Codes of token slot, starting at kv_head's first value (head-major; in
  // token-major blocks the whole row, whatever kv_head is). Element e of the
  // row is code index(e) there.
  template <class P>
  P* code_row(P* block, int slot, int kv_head) const {
    if (head_major_) return block + size_t(kv_head) * head_bytes_ + size_t(slot) * head_code_bytes_;
    return block + size_t(slot) * token_bytes_;
  }
  int index(int e) const { return head_major_ ? e % shape_.head_dim : e; }
  // Head-major: the first byte of KV head kv_head's codes (its metadata follows them).
  const uint8_t* head_codes(const uint8_t* block, int kv_head) const { return block + size_t(kv_head) * head_bytes_; }
  // 8-bit scales: the run of head kv_head's (token, group) pairs.
  template <class P>
  P* head_run(P* block, int kv_head) const {
    return block + size_t(kv_head) * head_bytes_ + size_t(shape_.block_size) * head_code_bytes_;
  }
  // Head-major: the head's (token, group) pairs as fp16 (scale, min): in the
  // block, or with 8-bit scales decoded into per-thread scratch (valid until
  // this thread's next call).
  const uint8_t* head_pairs(const uint8_t* block, int kv_head) const {
    if (!compact_) return head_run(block, kv_head);
    thread_local std::vector<fp16_t> pairs;
    const int groups = shape_.block_size * head_groups_;
    pairs.resize(2 * size_t(groups));
    scale8::decode_run_pairs(head_run(block, kv_head), groups, pairs.data());
    return reinterpret_cast<const uint8_t*>(pairs.data());
  }
  // The (scale, min) pair of group g of the row of token slot.
  template <class P>
  auto* pair(P* block, int slot, int g) const {
    using F = std::conditional_t<std::is_const_v<P>, const fp16_t, fp16_t>;
    if (head_major_) {
      P* meta = block + size_t(g / head_groups_) * head_bytes_ + size_t(shape_.block_size) * head_code_bytes_;
      return reinterpret_cast<F*>(meta) + 2 * (size_t(slot) * head_groups_ + size_t(g % head_groups_));
    }
    return reinterpret_cast<F*>(block + size_t(slot) * token_bytes_ + code_bytes_) + 2 * size_t(g);
  }

  int group_;
  size_t code_bytes_;   // packed codes of one token row
  size_t token_bytes_;  // codes + metadata of one token
  bool head_major_;
  size_t head_code_bytes_;  // packed codes of one head of one token (head-major)
  int head_groups_;         // groups per head (head-major)
  size_t head_bytes_;       // codes + metadata of one head for the whole block (head-major)
  bool compact_;            // 8-bit scales (kv/scale8.h): one run per (block, head)
  bool simd_ = false;
  bool pairs_ready_ = false;         // integer_accumulate applies
  [[maybe_unused]] bool byte_weights_ = false;  // ... with 8-bit weights (accumulate_bytes)
  static constexpr float kMid = 0.5f * float((1 << B) - 1);  // the codes' midpoint (8-bit weight folds)
  std::vector<int32_t> lane_group_;  // (head_dim) when groups are finer than a head
  bool integer_keys_ = false;              // integer_score applies
  std::vector<int32_t> key_lane_groups_;  // its lanes' groups (simd8::key_lane_groups)

#if defined(__AVX512BW__)
  // 32 bytes of a token's codes as 16-bit words: B = 8, one vector of
  // channels 0..31; B = 4, two vectors: channels 0-15 and 32-47, then 16-31
  // and 48-63 (nibbles interleave within 128-bit lanes).
  static constexpr int kUnitChannels = 256 / B, kWords = B == 8 ? 1 : 2;
  static void words(const uint8_t* p, __m512i* x) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (B == 8) {
      x[0] = _mm512_cvtepu8_epi16(b);
    } else {
      const __m256i nib = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
      x[0] = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(lo, hi));
      x[1] = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(lo, hi));
    }
  }
  // Per-thread scratch of the value folds: u (n_q, ns) floats, then step and
  // bias (n_q each), and `count` int32 words of folded weights.
  struct WeightScratch {
    float *u, *step, *bias;
    int32_t* words;
  };
  static WeightScratch weight_scratch(int n_q, int ns, size_t count) {
    thread_local std::vector<float> fbuf;
    thread_local std::vector<int32_t> ubuf;
    if (fbuf.size() < size_t(n_q) * (ns + 2)) fbuf.resize(size_t(n_q) * (ns + 2));
    if (ubuf.size() < count) ubuf.resize(count);
    float* u = fbuf.data();
    return {u, u + size_t(n_q) * ns, u + size_t(n_q) * ns + n_q, ubuf.data()};
  }
  // NQ queries' weights (NQ, stride) folded with the tokens' scales: u16 (NQ,
  // n2) = round(w_t scale_t / step) (zero past n), step = max_t w_t scale_t /
  // qmax, bias = sum_t w_t min_t. meta: the head's (scale, min) per token.
  // u: scratch of (NQ, ns) floats.
  // Out = int8_t (qmax 127): as the 8-bit query fold in channel_codec.cpp,
  // the rounding residual's part at the codes' midpoint joins the bias.
  template <int NQ, class Out = int16_t>
  static void fold_weights(const float* w, int stride, const uint8_t* meta, int n, int n2, int ns, float qmax,
                           float* u, float* step, float* bias, Out* u16) {
    __m512 top[NQ], b[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) top[i] = b[i] = _mm512_setzero_ps();
    for (int t = 0; t < n2; t += 16) {
      const __mmask16 m = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(0, n - t)) - 1);
      __m512 sc, mn;
      simd::split_pairs(_mm512_maskz_loadu_epi32(m, meta + size_t(t) * 4), sc, mn);
      if constexpr (sizeof(Out) == 1) mn = _mm512_fmadd_ps(sc, _mm512_set1_ps(kMid), mn);  // the midpoint term
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 wt = _mm512_maskz_loadu_ps(m, w + size_t(i) * stride + t);
        const __m512 ut = _mm512_mul_ps(wt, sc);
        top[i] = _mm512_max_ps(top[i], ut);
        b[i] = _mm512_fmadd_ps(wt, mn, b[i]);
        _mm512_storeu_ps(u + size_t(i) * ns + t, ut);
      }
    }
    alignas(16) float invs[4];
    simd::fold_steps(top, NQ, qmax, step, invs);
    _mm_mask_storeu_ps(bias, __mmask8((1u << NQ) - 1), kvserve::simd::reduce4<false>(b, NQ));
    __m512i rounded_sum[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) rounded_sum[i] = _mm512_setzero_si512();
    for (int t = 0; t < n2; t += 16) {
      const __mmask16 m = n2 - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n2 - t)) - 1);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 ut = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, u + size_t(i) * ns + t), _mm512_set1_ps(invs[i]));
        const __m512i rounded = _mm512_cvtps_epi32(ut);
        if constexpr (sizeof(Out) == 1) {
          _mm_mask_storeu_epi8(u16 + size_t(i) * n2 + t, m, _mm512_cvtepi32_epi8(rounded));
          rounded_sum[i] = _mm512_add_epi32(rounded_sum[i], rounded);
        } else {
          _mm256_mask_storeu_epi16(u16 + size_t(i) * n2 + t, m, _mm512_cvtepi32_epi16(rounded));
        }
      }
    }
    // The bias took sum_t w_t kMid scale_t = kMid step sum_t x_t (x_t =
    // u_t / step, unrounded); what the codes' midpoint meets in the dot
    // products is kMid step sum_t round(x_t). The difference is the residual's
    // midpoint part, which stays in the bias.
    if constexpr (sizeof(Out) == 1)
      for (int i = 0; i < NQ; ++i) bias[i] -= kMid * step[i] * float(_mm512_reduce_add_epi32(rounded_sum[i]));
  }
  // First channel of natural vector m (0, 1) of word vector w.
  static int first_channel(int w, int m) { return B == 8 ? 16 * m : 16 * w + 32 * m; }

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
  // Values with one group per head, 4-bit codes, weights (>= 0: softmax
  // weights, as for the 16-bit path) rounded to 8 bits:
  // u8_t = round(w_t scale_t / step), step = max_t w_t scale_t / 127 per
  // (query, block). vpdpbusd multiplies four code bytes (unsigned) by four
  // weight bytes (0..127) per lane: lanes are channels and each lane's four
  // bytes are four tokens, so one instruction covers 16 channels of 4 tokens,
  // twice the tokens of the 16-bit pairs. The weights' rounding adds an error
  // of at most half a step per token; its part at the codes' midpoint is
  // added back to the bias (fold_weights). Heads that are not a multiple of
  // 64 channels (stories260K's 8) take a scalar loop with the same numbers.
  void accumulate_bytes(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                        float* out) const {
    const int hd = shape_.head_dim, n4 = (n + 3) / 4 * 4;  // tokens, padded to whole quads (block_size % 4 == 0)
    const int ns = (n4 + 15) / 16 * 16;                   // floats of u per query
    const uint8_t* codes = head_codes(block, kv_head);
    const uint8_t* meta = head_pairs(block, kv_head);
    simd::prefetch_rows(codes, head_bytes_, 1, head_bytes_);
    const WeightScratch f = weight_scratch(n_q, ns, size_t(n_q) * n4 / 4);
    float *step = f.step, *bias = f.bias;
    int8_t* u8 = reinterpret_cast<int8_t*>(f.words);  // (n_q, n4)
    by_query_groups(n_q, [&](auto nq, int i) {
      fold_weights<nq.value, int8_t>(weights + size_t(i) * stride, stride, meta, n, n4, ns, 127.0f, f.u, step + i,
                                     bias + i, u8 + size_t(i) * n4);
      if (hd % 64 == 0) {
        if constexpr (B == 2)
          accumulate_quads2<nq.value>(codes, f.words + size_t(i) * n4 / 4, n4 / 4, n4, step + i, bias + i,
                                      out + size_t(i) * hd);
        else
          accumulate_quads<nq.value>(codes, f.words + size_t(i) * n4 / 4, n4 / 4, n4, step + i, bias + i,
                                     out + size_t(i) * hd);
        return;
      }
      for (int k = i; k < i + nq.value; ++k)
        for (int d = 0; d < hd; ++d) {
          int32_t acc = 0;
          for (int t = 0; t < n; ++t) acc += int32_t(u8[size_t(k) * n4 + t]) * get_code<B>(codes + size_t(t) * head_code_bytes_, d);
          out[size_t(k) * hd + d] += float(acc) * step[k] + bias[k];
        }
    });
  }
  // The byte kernels' accumulators: (query, four vectors of 16 lanes).
  template <int NQ>
  static void zero_accumulators(__m512i (&acc)[NQ][4]) {
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i)
      #pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_setzero_si512();
  }
  // o[0..16) += sum * step + bias, sum an accumulator's 16 integer lanes.
  static void add_scaled(float* o, __m512i sum, float step, float bias) {
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(step),
                                                                        _mm512_set1_ps(bias))));
  }
  // accumulate_quads for 2-bit codes. A unit of 64 channels is 16 bytes per
  // token (byte p: channels 4p .. 4p + 3, two bits each from bit 0), so four
  // tokens' bytes fill one vector. Output vector v (channels 16v .. 16v + 15)
  // takes in lane l the four tokens' byte 4v + l / 4 (vpermb); shifting each
  // lane by 2 (l mod 4) puts channel 16v + l's codes in the low two bits of
  // its four bytes (a shift of at most 6 keeps each byte's own bits), and an
  // AND leaves the four codes vpdpbusd multiplies by the four weights. The
  // lanes come out in channel order.
  template <int NQ>
  void accumulate_quads2(const uint8_t* codes, const int32_t* u, int uquads, int n4, const float* step,
                         const float* bias, float* out) const {
    const int hd = shape_.head_dim;
    const size_t row = head_code_bytes_;
    alignas(64) static constexpr auto kIdx = [] {
      struct { uint8_t idx[4][64]; } t{};
      for (int v = 0; v < 4; ++v)
        for (int l = 0; l < 16; ++l)
          for (int j = 0; j < 4; ++j) t.idx[v][4 * l + j] = uint8_t(16 * j + 4 * v + l / 4);  // token j's byte
      return t;
    }();
    const __m512i shifts = _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0);
    const __m512i low2 = _mm512_set1_epi8(0x03);
    for (int unit = 0; unit * 64 < hd; ++unit) {
      __m512i acc[NQ][4];
      zero_accumulators<NQ>(acc);
      const uint8_t* base = codes + size_t(unit) * 16;
      for (int t = 0; t < n4; t += 4) {
        const uint8_t* p = base + size_t(t) * row;
        __m512i x;
        if (row == 16) {
          x = _mm512_loadu_si512(p);  // four whole rows
        } else {
          x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + row)), 1);
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * row)), 2);
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * row)), 3);
        }
        #pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m512i c = _mm512_and_si512(
              _mm512_srlv_epi32(_mm512_permutexvar_epi8(_mm512_load_si512(kIdx.idx[v]), x), shifts), low2);
          #pragma GCC unroll 8
          for (int i = 0; i < NQ; ++i)
            acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], c, _mm512_set1_epi32(u[size_t(i) * uquads + t / 4]));
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) add_scaled(out + size_t(i) * hd + unit * 64 + 16 * v, acc[i][v], step[i], bias[i]);
    }
  }
  // NQ queries; u: (NQ, uquads) int32 = four 8-bit weights of tokens 4j ..
  // 4j + 3 (zero past n). Tokens [t, t + 4): two loads of two 32-byte rows
  // (a unit's 64 channels per token; byte p holds channels 2p and 2p + 1)
  // and one vpermi2b per 16 bytes put byte p of each token in lane p; the
  // low nibbles are then channel 2p's four codes, the high ones 2p + 1's.
  template <int NQ>
  void accumulate_quads(const uint8_t* codes, const int32_t* u, int uquads, int n4, const float* step,
                        const float* bias, float* out) const {
    const int hd = shape_.head_dim;
    const size_t row = head_code_bytes_;
    alignas(64) static constexpr auto kIdx = [] {
      struct { uint8_t idx[2][64]; } t{};
      for (int h = 0; h < 2; ++h)  // bytes 16h .. 16h + 15 of tokens 0..3 (32 bytes apart)
        for (int l = 0; l < 16; ++l)
          for (int j = 0; j < 4; ++j) t.idx[h][4 * l + j] = uint8_t(32 * j + 16 * h + l);
      return t;
    }();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    // acc[i][2h + k] holds channel 32h + 2l + k in lane l: natural order
    // interleaves lanes 0-7 (then 8-15) of the even and odd vectors.
    const __m512i order[2] = {_mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
                              _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8)};
    // Two consecutive tokens' 32 bytes. When the rows are 32 bytes (head dim
    // 64) they are one 64-byte run: one load instead of two and an insert.
    auto rows = [&](const uint8_t* p) {
      if (row == 32) return _mm512_loadu_si512(p);
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + row)), 1);
    };
    for (int unit = 0; unit * 64 < hd; ++unit) {
      __m512i acc[NQ][4];
      zero_accumulators<NQ>(acc);
      const uint8_t* base = codes + size_t(unit) * 32;
      for (int t = 0; t < n4; t += 4) {
        const __m512i a = rows(base + size_t(t) * row), b = rows(base + size_t(t + 2) * row);
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_permutex2var_epi8(a, _mm512_load_si512(kIdx.idx[h]), b);
          const __m512i even = _mm512_and_si512(v, nib), odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          #pragma GCC unroll 8
          for (int i = 0; i < NQ; ++i) {
            const __m512i ut = _mm512_set1_epi32(u[size_t(i) * uquads + t / 4]);
            acc[i][2 * h] = _mm512_dpbusd_epi32(acc[i][2 * h], even, ut);
            acc[i][2 * h + 1] = _mm512_dpbusd_epi32(acc[i][2 * h + 1], odd, ut);
          }
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          #pragma GCC unroll 2
          for (int m = 0; m < 2; ++m) {
            add_scaled(out + size_t(i) * hd + unit * 64 + 32 * h + 16 * m,
                       _mm512_permutex2var_epi32(acc[i][2 * h], order[m], acc[i][2 * h + 1]), step[i], bias[i]);
          }
    }
  }
#endif

  // NQ queries; u: (NQ, upairs) int32 = (u_t, u_t+1) 16-bit pairs.
  template <int NQ>
  void accumulate_pairs(const uint8_t* codes, const int32_t* u, int upairs, int n, const float* step,
                        const float* bias, float* out) const {
    const int hd = shape_.head_dim;
    const size_t row = head_code_bytes_;
    // Lane 4L + j of unpacklo holds word 8L + j, of unpackhi word 8L + 4 + j.
    const __m512i idx[2] = {_mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0),
                            _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8)};
    for (int unit = 0; unit * kUnitChannels < hd; ++unit) {
      __m512i acc[NQ][2 * kWords];
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int k = 0; k < 2 * kWords; ++k) acc[i][k] = _mm512_setzero_si512();
      const uint8_t* base = codes + size_t(unit) * 32;
      for (int t = 0; t < n; t += 2) {
        __m512i a[kWords], b[kWords];
        words(base + size_t(t) * row, a);
        if (t + 1 < n) {
          words(base + size_t(t + 1) * row, b);
        } else {
          #pragma GCC unroll 2
          for (int w = 0; w < kWords; ++w) b[w] = _mm512_setzero_si512();
        }
        #pragma GCC unroll 2
        for (int w = 0; w < kWords; ++w) {
          const __m512i p0 = _mm512_unpacklo_epi16(a[w], b[w]), p1 = _mm512_unpackhi_epi16(a[w], b[w]);
          #pragma GCC unroll 8
          for (int i = 0; i < NQ; ++i) {
            const __m512i ut = _mm512_set1_epi32(u[size_t(i) * upairs + t / 2]);
            acc[i][2 * w] = kvserve::simd::dot_pairs(acc[i][2 * w], p0, ut);
            acc[i][2 * w + 1] = kvserve::simd::dot_pairs(acc[i][2 * w + 1], p1, ut);
          }
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 2
        for (int w = 0; w < kWords; ++w)
          #pragma GCC unroll 2
          for (int m = 0; m < 2; ++m) {
            const __m512i v = _mm512_permutex2var_epi32(acc[i][2 * w], idx[m], acc[i][2 * w + 1]);
            float* o = out + size_t(i) * hd + unit * kUnitChannels + first_channel(w, m);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_fmadd_ps(_mm512_cvtepi32_ps(v),
                                                                                   _mm512_set1_ps(step[i]),
                                                                                   _mm512_set1_ps(bias[i]))));
          }
    }
  }
#endif
};

// llama.cpp's q4_0: per token, blocks of 32 consecutive values with one fp16
// scale d = (value of largest magnitude) / -8 and codes q = x / d + 8 in 0..15;
// element j < 16 in the low nibble of byte j, element j + 16 in the high one.
// Head-major when head_dim is a multiple of 32 (no block spans heads): per
// KV head, (block_size, head_dim / 32) blocks; otherwise per token the row's
// kv_dim / 32 blocks.
class Q4_0Codec final : public SliceCodec<Q4_0Codec> {
 public:
  static constexpr int kBlock = 32;
  static constexpr size_t kBlockBytes = sizeof(fp16_t) + kBlock / 2;

  Q4_0Codec(const KvCodecConfig& c, const KvBlockShape& s)
      : SliceCodec(c, s),
        token_bytes_(size_t(s.kv_dim() / kBlock) * kBlockBytes),
        head_major_(s.head_dim % kBlock == 0),
        head_blocks_(s.head_dim / kBlock) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    integer_keys_ = q4_0_key_steps(s) > 0;
    if (integer_keys_) key_lane_groups_ = simd8::key_lane_groups<simd8::KeyLanesQ4_0>(s.head_dim, kBlock);
#endif
  }

  size_t block_bytes() const override { return size_t(shape_.block_size) * token_bytes_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    for (int b = 0; b * kBlock < shape_.kv_dim(); ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0, max = 0;
      for (int j = 0; j < kBlock; ++j)
        if (std::fabs(xb[j]) > amax) amax = std::fabs(xb[j]), max = xb[j];
      const fp16_t d16 = fp32_to_fp16(max / -8.0f);
      const float d = fp16_to_fp32(d16), id = d != 0 ? 1.0f / d : 0.0f;
      uint8_t* out = at(block, slot, b);
      std::memcpy(out, &d16, sizeof d16);
      for (int j = 0; j < kBlock / 2; ++j) {
        const int lo = std::min(15, int(xb[j] * id + 8.5f));
        const int hi = std::min(15, int(xb[j + kBlock / 2] * id + 8.5f));
        out[sizeof(fp16_t) + j] = uint8_t(std::max(lo, 0) | (std::max(hi, 0) << 4));
      }
    }
  }

  int token_spans(int slot, int kv_head, ByteSpan* out) const override {
    if (!head_major_) return 0;
    out[0] = {(size_t(kv_head) * shape_.block_size + size_t(slot)) * head_blocks_ * kBlockBytes,
              size_t(head_blocks_) * kBlockBytes};
    return 1;
  }

  void dequantize_head(const uint8_t* block, int slot, int kv_head, float* out) const {
    const int hd = shape_.head_dim, first = kv_head * hd;
    if (head_major_) {  // whole q4_0 blocks: one scale each, no index arithmetic per value
      for (int b = 0; b < head_blocks_; ++b) {
        const uint8_t* blk = at(block, slot, kv_head * head_blocks_ + b);
        fp16_t d16;
        std::memcpy(&d16, blk, sizeof d16);
        const float d = fp16_to_fp32(d16);
        float* o = out + b * kBlock;
        for (int j = 0; j < kBlock / 2; ++j) {
          const uint8_t byte = blk[sizeof(fp16_t) + j];
          o[j] = d * float((byte & 15) - 8);
          o[j + kBlock / 2] = d * float((byte >> 4) - 8);
        }
      }
      return;
    }
    for (int i = 0; i < hd; ++i) {
      const int e = first + i, b = e / kBlock, j = e % kBlock;
      const uint8_t* blk = at(block, slot, b);
      fp16_t d16;
      std::memcpy(&d16, blk, sizeof d16);
      const uint8_t byte = blk[sizeof(fp16_t) + (j % (kBlock / 2))];
      const int q = j < kBlock / 2 ? (byte & 15) : (byte >> 4);
      out[i] = fp16_to_fp32(d16) * float(q - 8);
    }
  }

#if defined(KVSERVE_TOKEN_SOURCES)
  bool simd_ready() const { return shape_.head_dim % kBlock == 0; }
#endif

  // Keys as integer dot products on AVX2 builds (token_key_scores8.h), each
  // q4_0 block a group: scale d, min -8 d.
  bool integer_score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
                     int stride) const {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (!integer_keys_ || n <= 0) return false;
    using L = simd8::KeyLanesQ4_0;
    const int hd = shape_.head_dim, units = hd / L::kCodes, groups = head_blocks_;
    const uint8_t* codes = at(block, 0, kv_head * head_blocks_);
    const size_t code_stride = size_t(head_blocks_) * kBlockBytes;
    const simd8::KeyQueries kq = simd8::round_queries<L>(q, n_q, hd, kBlock, scale);
    simd::prefetch_rows(codes, code_stride, n, code_stride);
    const BlockScales scales{codes, code_stride, groups};
    simd8::with_units(units, [&](auto u) {
      simd::by_query_passes<3>(n_q, [&](auto m, int i) {
        simd8::score_sub_groups<L, m, u>(codes, code_stride, units, kq, i, scales, key_lane_groups_.data(), n, scores,
                                         stride);
      });
    });
    return true;
#else
    (void)q, (void)n_q, (void)block, (void)n, (void)kv_head, (void)scale, (void)scores, (void)stride;
    return false;
#endif
  }
#if defined(__AVX512F__)

  // A chunk is one q4_0 block: its low nibbles are values 0..15, its high
  // nibbles 16..31, so the lanes come out in natural order.
  struct Source {
    using Order = simd::Natural<2>;
    const uint8_t* block;
    size_t token_bytes, head_off;  // in bytes
    int head_dim;
    struct Cursor {
      const uint8_t* blocks;
      void chunk(int c, __m512* x) const {
        const uint8_t* b = blocks + size_t(c) * kBlockBytes;
        fp16_t d16;
        std::memcpy(&d16, b, sizeof d16);
        const __m512 d = _mm512_set1_ps(fp16_to_fp32(d16)), bias = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + sizeof(fp16_t))));
        x[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, bias);
        x[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, bias);
      }
    };
    void prefetch(int n) const {
      simd::prefetch_rows(block + head_off, token_bytes, n, size_t(head_dim / kBlock) * kBlockBytes);
    }
    Cursor token(int t) const { return {block + size_t(t) * token_bytes + head_off}; }
  };
  template <class F>
  void with_source(const uint8_t* block, int kv_head, F&& f) const {
    // simd_ready() implies head-major: a head's blocks for token t lie
    // head_blocks_ * kBlockBytes apart.
    f(Source{block, size_t(head_blocks_) * kBlockBytes, size_t(at(block, 0, kv_head * head_blocks_) - block),
             shape_.head_dim});
  }
#elif defined(KVSERVE_TOKEN_SOURCES)
  // The same on 8 lanes: a block's low nibbles are two vectors (values 0..7,
  // 8..15), its high nibbles two more (16..23, 24..31).
  struct Source {
    using Order = simd8::Natural8<4>;
    const uint8_t* blocks;  // token 0's first q4_0 block of the head
    size_t token_bytes;
    int head_dim;
    struct Cursor {
      const uint8_t* blocks;
      void chunk(int c, __m256* x) const {
        const uint8_t* b = blocks + size_t(c) * kBlockBytes;
        fp16_t d16;
        std::memcpy(&d16, b, sizeof d16);
        const __m256 d = _mm256_set1_ps(fp16_to_fp32(d16)), bias = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        const __m256i nib = _mm256_set1_epi32(15);
        const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + sizeof(fp16_t))));
        const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + sizeof(fp16_t) + 8)));
        x[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, nib)), d, bias);
        x[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, nib)), d, bias);
        x[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d, bias);
        x[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d, bias);
      }
    };
    void prefetch(int n) const { simd::prefetch_rows(blocks, token_bytes, n, size_t(head_dim / kBlock) * kBlockBytes); }
    Cursor token(int t) const { return {blocks + size_t(t) * token_bytes}; }
  };
  template <class F>
  void with_source(const uint8_t* block, int kv_head, F&& f) const {
    f(Source{at(block, 0, kv_head * head_blocks_), size_t(head_blocks_) * kBlockBytes, shape_.head_dim});
  }
#endif

 private:
  // q4_0 block b (of the row's kv_dim / 32) of token slot.
  template <class P>
  P* at(P* block, int slot, int b) const {
    if (!head_major_) return block + size_t(slot) * token_bytes_ + size_t(b) * kBlockBytes;
    const int h = b / head_blocks_;
    return block + ((size_t(h) * shape_.block_size + size_t(slot)) * head_blocks_ + size_t(b % head_blocks_)) * kBlockBytes;
  }

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // Token t's block scales d (at the start of each block's bytes; at most 8)
  // and the mins -8 d, for score_sub_groups: read where they lie.
  struct BlockScales {
    const uint8_t* codes;
    size_t stride;
    int blocks;
    void operator()(int t, __m256& scale, __m256& min) const {
      const uint8_t* p = codes + size_t(t) * stride;
      auto d = [&](int b) {
        uint16_t h;
        std::memcpy(&h, p + size_t(b) * kBlockBytes, sizeof h);
        return uint64_t(h);
      };
      __m128i words;
      if (blocks == 2) {  // head_dim 64
        words = _mm_cvtsi32_si128(int(d(0) | d(1) << 16));
      } else {
        uint64_t halves[2] = {0, 0};
        for (int b = 0; b < blocks; ++b) halves[b / 4] |= d(b) << (16 * (b % 4));
        words = _mm_set_epi64x(int64_t(halves[1]), int64_t(halves[0]));
      }
      scale = _mm256_cvtph_ps(words);
      min = _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
    }
  };
#endif

  size_t token_bytes_;
  bool head_major_;
  int head_blocks_;  // q4_0 blocks per head (head-major)
  bool integer_keys_ = false;              // integer_score applies
  std::vector<int32_t> key_lane_groups_;  // its lanes' blocks (simd8::key_lane_groups)
};

template <int B>
std::unique_ptr<KvCodec> make_int(const KvCodecConfig& c, const KvBlockShape& s) {
  if (c.grouping == KvGrouping::Channel || c.is_static()) return make_channel_codec(c, s);
  return std::make_unique<TokenGroupCodec<B>>(c, s);
}

}  // namespace int_codec

std::unique_ptr<KvCodec> make_int_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  switch (config.dtype) {
    case KvDType::INT8: return int_codec::make_int<8>(config, shape);
    case KvDType::INT4: return int_codec::make_int<4>(config, shape);
    default: return int_codec::make_int<2>(config, shape);
  }
}

int token_weight_steps(const KvCodecConfig& config, const KvBlockShape& shape) {
  return int_codec::byte_weight_kernel(config, shape) ? 127 : 0;
}

int token_query_steps(const KvCodecConfig& config, const KvBlockShape& shape) {
  if (config.dtype == KvDType::Q4_0) return int_codec::q4_0_key_steps(shape);
  if (config.grouping != KvGrouping::Token || config.is_static() || !kv_dtype_is_quantized(config.dtype)) return 0;
  const int group = config.group_size > 0 ? config.group_size : shape.head_dim;  // 0: the default, a head
  switch (config.dtype) {
    case KvDType::INT8: return int_codec::integer_key_steps<8>(group, shape);
    case KvDType::INT4: return int_codec::integer_key_steps<4>(group, shape);
    default: return int_codec::integer_key_steps<2>(group, shape);
  }
}

void set_byte_value_weights(bool enabled) { int_codec::g_byte_value_weights.store(enabled); }

std::unique_ptr<KvCodec> make_q4_0_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  return std::make_unique<int_codec::Q4_0Codec>(config, shape);
}

}  // namespace kvserve
