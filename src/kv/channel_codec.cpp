// Channel-grouped integer codes (KIVI keys) and static per-channel scales.
#include "kv/channel_codec.h"

#include "kv/int_codec_kernels.h"
#include "kv/scale8.h"

namespace kvserve {
namespace int_codec {

// Whether ChannelCodec scores these keys against an 8-bit query
// (score_tiles_bytes): 4-bit dynamic post-RoPE channel groups, on AVX-512
// VNNI builds, heads of whole octets (the octet layout below), and
// only where a fold serves 32 tokens or more: with
// 16-token groups the 8-bit fold's extra rounding work outweighs the halved
// dot products (a 16K layer of int4 in 16-token blocks on one thread: 1.79
// vs 1.60-1.69 ms; BENCHMARKS.md). AVX2 builds take the same numbers
// through vpmaddubsw (score_tile8_bytes).
static bool byte_query_kernel(const KvCodecConfig& c, const KvBlockShape& s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || \
    (!defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__))
  const int group = c.group_size > 0 ? c.group_size : s.block_size;
  const int fold_tokens = c.pre_rope ? std::min(group, c.rope_span) : group;  // tokens one query fold serves
  return c.dtype == KvDType::INT4 && c.grouping == KvGrouping::Channel && !c.is_static() && s.head_dim % 8 == 0 &&
         fold_tokens >= 32;
#else
  (void)c, (void)s;
  return false;
#endif
}

// Channel groups (KIVI keys) and static per-channel scales. Dynamic: per
// group of group_size tokens an fp16 (scale, min) pair per channel, fitted
// over those tokens. Static: codes only; the fixed per-channel ranges live in
// the codec. Head-major when a head's codes fill whole bytes: per KV head,
// codes then pairs (token group, head_dim). Otherwise codes (block_size,
// kv_dim) rows, then pairs (token group, kv_dim).
//
// A head's codes are channel-major for dynamic post-RoPE groups: byte
// (c / (8 / B), t) holds channels c .. c + 8 / B - 1 of token t, so one byte
// row covers every token of the block for those channels. Scoring then runs
// with tokens in SIMD lanes: the group's scale folds into the query once, and
// the codes meet it as integers in dot products (no float dequantization, no
// per-token horizontal sums). So are keys in RoPE spans (rope_span > 1: one
// query set per span, score_span). Static scales and keys exactly before
// RoPE (a query per token) keep token rows (block_size, head_dim).
//
// 4-bit channel-major heads of whole octets (head_dim % 8 == 0) interleave
// instead: per octet o of channels 8o .. 8o + 7, four bytes per token,
// (octet, token, byte j), byte j holding channel 8o + j in its low nibble and
// 8o + j + 4 in its high one. A 64-byte load is then 16 tokens' codes of the
// octet, and one AND (channels 8o .. 8o + 3) or one shift and AND
// (8o + 4 .. 8o + 7) gives the four-codes-per-lane vector vpdpbusd takes:
// half the instructions of unpacking two byte rows with a permute and a
// multishift (BENCHMARKS.md, "The instruction floor, and the octet layout
// for 4-bit keys").
template <int B>
class ChannelCodec final : public KvCodec {
 public:
  ChannelCodec(const KvCodecConfig& c, const KvBlockShape& s)
      : KvCodec(c, s),
        static_(c.is_static()),
        compact_(c.scale_bits == 8),
        group_(static_ ? s.block_size : c.group_size),
        code_bytes_(size_t(s.kv_dim()) * B / 8),
        head_major_(s.head_dim * B % 8 == 0),
        channel_major_(head_major_ && !static_ && (!c.pre_rope || c.rope_span > 1)),
        octets_(B == 4 && channel_major_ && s.head_dim % 8 == 0),
        head_code_bytes_(size_t(s.head_dim) * B / 8),
        head_bytes_(size_t(s.block_size) * head_code_bytes_ +
                    (static_ ? 0 : size_t(s.block_size / group_) * head_run_bytes(c, s))) {
    if (static_) {
      for (int d = 0; d < s.kv_dim(); ++d) {
        const Affine a = fit_affine<B>(c.static_min[size_t(d)], std::max(c.static_max[size_t(d)], c.static_min[size_t(d)]));
        static_scale_.push_back(a.scale);
        static_min_.push_back(a.min);
        static_max_.push_back(std::max(c.static_max[size_t(d)], a.min));
      }
    }
#if defined(KVSERVE_TOKEN_SOURCES)
#if defined(__AVX512F__)
    using Order = simd::Lanes<B>;
#else
    using Order = simd8::Lanes8<B>;
#endif
    simd_ = s.head_dim % Order::kCodes == 0;
    if (simd_ && static_) {
      // Head slices start on chunk boundaries, so the row in lane order is
      // every head's slice in lane order.
      static_scale_lanes_.resize(size_t(s.kv_dim()));
      static_min_lanes_.resize(size_t(s.kv_dim()));
      for (int d = 0; d < s.kv_dim(); d += Order::kCodes) {
        Order::to_lanes(static_scale_.data() + d, static_scale_lanes_.data() + d);
        Order::to_lanes(static_min_.data() + d, static_min_lanes_.data() + d);
      }
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    channel_major_simd_ = channel_major_ && s.head_dim % 2 == 0;
#endif
#if defined(__AVX512BW__)
    byte_dots_ = channel_major_simd_ && byte_query_kernel(c, s);
#else
    byte_dots_ = octets_ && byte_query_kernel(c, s);  // score_channel_pairs' 8-bit path
#endif
  }

  size_t block_bytes() const override {
    const size_t meta = static_ ? 0 : size_t(shape_.block_size / group_) * size_t(shape_.n_kv_heads) * head_run_bytes(config_, shape_);
    return size_t(shape_.block_size) * code_bytes_ + meta;
  }
  bool encodes_tokens() const override { return static_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    // Static scales only: values are clamped into the calibrated range.
    if (head_major_)
      for (int h = 0; h < shape_.n_kv_heads; ++h) std::memset(code_row(block, slot, h), 0, head_code_bytes_);
    else
      std::memset(code_row(block, slot, 0), 0, code_bytes_);
    for (int d = 0; d < shape_.kv_dim(); ++d) {
      const float v = std::clamp(x[d], static_min_[size_t(d)], static_max_[size_t(d)]);
      set_code<B>(code_row(block, slot, d / shape_.head_dim), index(d),
                  quantize<B>(v, static_min_[size_t(d)], inverse(static_scale_[size_t(d)])));
    }
  }

  void encode_block(uint8_t* block, const float* x, int n) const override {
    if (static_) {
      KvCodec::encode_block(block, x, n);
      return;
    }
    const int kv_dim = shape_.kv_dim(), hd = shape_.head_dim;
    std::memset(block, 0, block_bytes());
    std::vector<float> lo(static_cast<size_t>(kv_dim)), hi(lo.size()), sc(lo.size()), mn(lo.size());
    for (int tg = 0; tg * group_ < n; ++tg) {
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      for (int d = 0; d < kv_dim; ++d) {
        lo[size_t(d)] = hi[size_t(d)] = x[size_t(t0) * kv_dim + d];
        for (int t = t0 + 1; t < t1; ++t) {
          lo[size_t(d)] = std::min(lo[size_t(d)], x[size_t(t) * kv_dim + d]);
          hi[size_t(d)] = std::max(hi[size_t(d)], x[size_t(t) * kv_dim + d]);
        }
      }
      for (int h = 0; h < shape_.n_kv_heads; ++h) {  // the pairs the codes will mean
        const size_t f = size_t(h) * hd;
        if (compact_) {
          scale8::encode_run(&lo[f], &hi[f], hd, (1 << B) - 1, run(block, tg, h), &sc[f], &mn[f]);
          continue;
        }
        for (int d = int(f); d < int(f) + hd; ++d) {
          const Affine a = fit_affine<B>(lo[size_t(d)], hi[size_t(d)]);
          fp16_t* meta = pair(block, tg, d);
          meta[0] = a.scale16;
          meta[1] = a.min16;
          sc[size_t(d)] = a.scale;
          mn[size_t(d)] = a.min;
        }
      }
      for (int d = 0; d < kv_dim; ++d) {
        const float inv = inverse(sc[size_t(d)]);
        for (int t = t0; t < t1; ++t) put(block, t, d, quantize<B>(x[size_t(t) * kv_dim + d], mn[size_t(d)], inv));
      }
    }
  }

  // Static scales keep no per-token metadata, so a head's codes move alone.
  int token_spans(int slot, int kv_head, ByteSpan* out) const override {
    if (!static_ || !head_major_) return 0;
    out[0] = {size_t(kv_head) * head_bytes_ + size_t(slot) * head_code_bytes_, head_code_bytes_};
    return 1;
  }

  void decode_token(const uint8_t* block, int slot, float* out) const override {
    const int kv_dim = shape_.kv_dim();
    std::vector<float> scale(static_cast<size_t>(kv_dim)), min(static_cast<size_t>(kv_dim));
    load_affine(block, slot / group_, 0, kv_dim, scale.data(), min.data());
    for (int d = 0; d < kv_dim; ++d)
      out[d] = min[size_t(d)] +
               scale[size_t(d)] * float(get(block, slot, d));
  }

  // q·k_t = sum_d (q_d * scale_d) * code_td + sum_d q_d * min_d: one scaled
  // query per token group, then integer codes against it.
  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    score_span(q, n_q, block, 0, n, kv_head, scale, scores, stride);
  }
  void score_spans(const float* q_spans, int n_q, const uint8_t* block, int n, int span, int kv_head, float scale,
                   float* scores, int stride) const override {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (channel_major_simd_) {  // each token group's scales decoded once for its spans
      score_channel_major(q_spans, n_q, block, 0, n, kv_head, scale, scores, stride, span);
      return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (channel_major_ && shape_.head_dim % 8 == 0) {  // the same on AVX2
      score_channel_pairs(q_spans, n_q, block, 0, n, kv_head, scale, scores, stride, span);
      return;
    }
#endif
    KvCodec::score_spans(q_spans, n_q, block, n, span, kv_head, scale, scores, stride);
  }
  // Tokens [begin, end): the token groups they touch are folded as for
  // score, and only the range is scored (keys in RoPE spans, one query set
  // per span).
  void score_span(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head, float scale,
                  float* scores, int stride) const override {
    if (begin >= end) return;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (channel_major_simd_) {
      score_channel_major(q, n_q, block, begin, end, kv_head, scale, scores, stride);
      return;
    }
#endif
#if defined(KVSERVE_TOKEN_SOURCES)
    if (simd_ && !channel_major_ && begin == 0) {
      source_kernels::score(source(block, end, kv_head), q, n_q, false, end, scale, scores, stride);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd;
    if (channel_major_) {
      score_channels(q, n_q, block, begin, end, kv_head, scale, scores, stride);
      return;
    }
    float* s = scratch(4 * size_t(hd));
    float *sc = s, *mn = s + hd, *qs = s + 2 * hd, *codes = s + 3 * hd;
    for (int tg = begin / group_; tg * group_ < end; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = std::max(begin, tg * group_), t1 = std::min(end, (tg + 1) * group_);
      for (int i = 0; i < n_q; ++i) {
        const float* qi = q + i * hd;
        for (int d = 0; d < hd; ++d) qs[d] = qi[d] * sc[d];
        const float bias = dot(qi, mn, hd);
        for (int t = t0; t < t1; ++t) {
          unpack(block, t, kv_head, codes);
          scores[i * stride + t] = scale * (dot(qs, codes, hd) + bias);
        }
      }
    }
  }

  // Per-thread scratch of the folding score kernels: the head's scales and
  // mins, each query's step and bias, the folded queries (n_q, hd) as int16
  // and the same bytes read as (n_q, hd / 2) channel pairs.
  struct FoldScratch {
    float *sc, *mn, *step, *bias;
    int16_t* q16;
    const int32_t* pairs;
  };
  static FoldScratch fold_scratch(int hd, int n_q) {
    thread_local std::vector<float> fbuf;
    thread_local std::vector<int32_t> qbuf;
    if (fbuf.size() < size_t(2 * hd + 2 * n_q)) fbuf.resize(size_t(2 * hd + 2 * n_q));
    if (qbuf.size() < size_t(n_q * hd / 2)) qbuf.resize(size_t(n_q * hd / 2));
    float* sc = fbuf.data();
    return {sc, sc + hd, sc + 2 * hd, sc + 2 * hd + n_q, reinterpret_cast<int16_t*>(qbuf.data()), qbuf.data()};
  }

  // Channel-major without the integer kernels: tokens run innermost, so each
  // channel's byte row is read in order and the sums over channels are
  // per-token vectors (8 tokens per AVX2 step) instead of horizontal sums.
  void score_channels(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head, float scale,
                      float* scores, int stride) const {
#if defined(__AVX2__) && defined(__FMA__)
    if (shape_.head_dim % 8 == 0) {
      score_channel_pairs(q, n_q, block, begin, end, kv_head, scale, scores, stride);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(2 * size_t(hd) + size_t(group_));
    float *sc = s, *mn = s + hd, *acc = s + 2 * hd;
    for (int tg = begin / group_; tg * group_ < end; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = std::max(begin, tg * group_), nt = std::min(end, (tg + 1) * group_) - t0;
      for (int i = 0; i < n_q; ++i) {
        const float* qi = q + size_t(i) * hd;
        std::fill(acc, acc + nt, dot(qi, mn, hd));
        for (int c = 0; c < hd; ++c) {
          // Token t's byte for channel c: row[t * step].
          const uint8_t* row = channel_byte(block, t0, first + c);
          const size_t step = octets_ ? 4 : 1;
          const int shift = channel_shift(c);
          const float qc = qi[c] * sc[c];
          int t = 0;
#if defined(__AVX2__) && defined(__FMA__)
          const __m256 qv = _mm256_set1_ps(qc);
          const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
          // (Octet heads take score_channel_pairs on AVX2 builds.)
          for (; !octets_ && t + 8 <= nt; t += 8) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + t)));
            const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(bytes, shift), mask);
            _mm256_storeu_ps(acc + t, _mm256_fmadd_ps(qv, _mm256_cvtepi32_ps(codes), _mm256_loadu_ps(acc + t)));
          }
#endif
          for (; t < nt; ++t) acc[t] += qc * float((row[size_t(t) * step] >> shift) & ((1 << B) - 1));
        }
        for (int t = 0; t < nt; ++t) scores[size_t(i) * stride + t0 + t] = scale * acc[t];
      }
    }
  }

#if defined(__AVX2__) && defined(__FMA__)
  // AVX2 version of score_channel_major: 8 tokens per vector, the folded
  // query as 16-bit pairs against the codes' pairs (vpmaddwd).
  static __m256i load_pairs8(const uint8_t* head, int bs, int r, int t0, int nt) {
    const uint8_t* p = head + size_t(r) * bs + t0;
    __m128i bytes;
    if (t0 + 8 <= bs) {
      bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    } else {
      uint8_t tmp[8] = {};
      std::memcpy(tmp, p, size_t(nt));
      bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp));
    }
    return _mm256_cvtepu8_epi32(bytes);
  }
  // Octet layout: tokens [t0, t0 + nt) of octet o, one 32-bit lane each.
  static __m256i load_octet8(const uint8_t* head, int bs, int o, int t0, int nt) {
    const uint8_t* p = head + (size_t(o) * bs + size_t(t0)) * 4;
    if (t0 + 8 <= bs) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    alignas(32) uint8_t tmp[32] = {};
    std::memcpy(tmp, p, size_t(nt) * 4);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
  }
  // Tokens [t0, t0 + nt) of NQ queries' integer sums: score = scale * (step
  // * sum + bias).
  template <int NQ>
  static void store_scores8(const __m256i* acc, const float* step, const float* bias, float scale, float* scores,
                            int stride, int t0, int nt) {
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      const __m256 s = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]),
                                                                           _mm256_set1_ps(step[i]),
                                                                           _mm256_set1_ps(bias[i])));
      float* dst = scores + size_t(i) * stride + t0;
      if (nt == 8) {  // a whole tile: no call to memcpy (a tenth of the key scores' time on Zen 2)
        _mm256_storeu_ps(dst, s);
        continue;
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, s);
      std::memcpy(dst, out, sizeof(float) * size_t(nt));
    }
  }
  // q16 in pair_channels(p, oct) order.
  template <int NQ>
  static void score_tile8(const uint8_t* head, int bs, int pairs, int t0, int nt, const int32_t* q16,
                          const float* step, const float* bias, float scale, float* scores, int stride, bool oct) {
    __m256i acc[NQ];
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_si256();
    auto add = [&](__m256i x, int p) {
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
#if defined(__AVXVNNI__)
        acc[i] = _mm256_dpwssd_avx_epi32(acc[i], x, _mm256_set1_epi32(q16[i * pairs + p]));  // vpmaddwd and the add
#else
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(x, _mm256_set1_epi32(q16[i * pairs + p])));
#endif
    };
    if (B == 4 && oct) {
      for (int p = 0; p < pairs; p += 4) {
        const __m256i v = load_octet8(head, bs, p / 4, t0, nt);
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {  // byte j: low nibble in bits 0-3, high nibble to bits 16-19
          const __m256i b = _mm256_srli_epi32(v, 8 * j);
          add(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0xF)),
                              _mm256_and_si256(_mm256_slli_epi32(b, 12), _mm256_set1_epi32(0xF0000))), p + j);
        }
      }
    } else {  // the byte-row layouts
      for (int p = 0; p < pairs; p += B == 2 ? 2 : 1) {
        if constexpr (B == 8) {
          add(_mm256_or_si256(load_pairs8(head, bs, 2 * p, t0, nt),
                              _mm256_slli_epi32(load_pairs8(head, bs, 2 * p + 1, t0, nt), 16)), p);
        } else if constexpr (B == 4) {
          const __m256i b = load_pairs8(head, bs, p, t0, nt);
          add(_mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)), _mm256_set1_epi32(0x000F000F)), p);
        } else {
          const __m256i b = load_pairs8(head, bs, p / 2, t0, nt), m = _mm256_set1_epi32(0x00030003);
          add(_mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 14)), m), p);
          add(_mm256_and_si256(_mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_slli_epi32(b, 10)), m), p + 1);
        }
      }
    }
    store_scores8<NQ>(acc, step, bias, scale, scores, stride, t0, nt);
  }
  // The folds' first pass on 8 lanes: returns max_c |q_c scale_c|, and b
  // := the lanes of sum_c q_c min_c.
  static float fold_first_pass8(const float* q, int hd, const float* sc, const float* mn, __m256& b) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    b = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      top = _mm256_max_ps(top, _mm256_and_ps(sign, _mm256_mul_ps(x, _mm256_loadu_ps(sc + d))));
      b = _mm256_fmadd_ps(x, _mm256_loadu_ps(mn + d), b);
    }
    return kvserve::simd::hmax8(top);
  }
#if !defined(__AVX512BW__)
  // fold_queries' 8-bit fold on 8 lanes, the same numbers: folded =
  // round(q_c scale_c / step), step = max_c |q_c scale_c| / 127, and the
  // rounding residual's part at the codes' midpoint joins the bias.
  static void fold_query_bytes8(const float* q, int hd, const float* sc, const float* mn, float* step, float* bias,
                                int8_t* folded) {
    __m256 b;
    const float mx = fold_first_pass8(q, hd, sc, mn, b);
    *step = mx * (1.0f / 127.0f);
    const __m256 inv = _mm256_set1_ps(mx > 127.0f / std::numeric_limits<float>::max() ? 127.0f / mx : 0.0f);
    const __m256 mid = _mm256_set1_ps(*step * 0.5f * float((1 << B) - 1));
    for (int d = 0; d < hd; d += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(sc + d)), inv);
      const __m256 rounded = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i v = _mm256_cvtps_epi32(rounded);
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(folded + d), _mm_packs_epi16(w, w));
      b = _mm256_fmadd_ps(_mm256_sub_ps(x, rounded), mid, b);
    }
    *bias = kvserve::simd::hsum8(b);
  }
  // score_tile8 for 4-bit octets against 8-bit queries (q8: (NQ, quads)
  // four-channel words in channel order, as score_tiles_bytes reads them).
  // vpmaddubsw multiplies the 32-bit lane's four code bytes (one token's
  // channels 8o .. 8o + 3, or 8o + 4 .. 8o + 7) by the query's four bytes
  // into two 16-bit sums. Four octets' sums stay in 16 bits (16 products of
  // at most 15 x 127: 30480), then vpmaddwd adds each token's two halves.
  // With AVX-VNNI, vpdpbusd adds the four products into 32 bits directly:
  // half the instructions, the same sums. Without it, V tiles of 8 tokens
  // (V = 2: 16 whole tokens) share each broadcast query word (the
  // stand-alone tile took 15% less time on Zen 2 for three queries).
#if defined(__AVXVNNI__)
  template <int NQ>
  static void score_tile8_bytes(const uint8_t* head, int bs, int quads, int t0, int nt, const int32_t* q8,
                                const float* step, const float* bias, float scale, float* scores, int stride) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256i acc[NQ], acc_hi[NQ];  // two chains per query: vpdpbusd's latency
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) acc[i] = acc_hi[i] = _mm256_setzero_si256();
    for (int g = 0; g < quads; g += 2) {  // quads is even: whole octets
      const __m256i v = load_octet8(head, bs, g / 2, t0, nt);
      const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) {
        acc[i] = _mm256_dpbusd_avx_epi32(acc[i], lo, _mm256_set1_epi32(q8[i * quads + g]));
        acc_hi[i] = _mm256_dpbusd_avx_epi32(acc_hi[i], hi, _mm256_set1_epi32(q8[i * quads + g + 1]));
      }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_add_epi32(acc[i], acc_hi[i]);
    store_scores8<NQ>(acc, step, bias, scale, scores, stride, t0, nt);
  }
#else
  template <int NQ, int V = 1>
  static void score_tile8_bytes(const uint8_t* head, int bs, int quads, int t0, int nt, const int32_t* q8,
                                const float* step, const float* bias, float scale, float* scores, int stride) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i acc[V][NQ];
    #pragma GCC unroll 4
    for (int j = 0; j < V; ++j)
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) acc[j][i] = _mm256_setzero_si256();
    for (int g0 = 0; g0 < quads; g0 += 8) {
      __m256i part[V][NQ];
      #pragma GCC unroll 4
      for (int j = 0; j < V; ++j)
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) part[j][i] = _mm256_setzero_si256();
      const int g_end = std::min(quads, g0 + 8);
      for (int g = g0; g < g_end; g += 2) {  // quads is even: whole octets
        __m256i lo[V], hi[V];
        #pragma GCC unroll 2
        for (int j = 0; j < V; ++j) {  // V > 1 only for whole tiles (nt = 8 V): plain loads
          const __m256i v = V == 1 ? load_octet8(head, bs, g / 2, t0, nt)
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                         head + (size_t(g / 2) * bs + size_t(t0 + 8 * j)) * 4));
          lo[j] = _mm256_and_si256(v, nib), hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          const __m256i qa = _mm256_set1_epi32(q8[i * quads + g]), qb = _mm256_set1_epi32(q8[i * quads + g + 1]);
          #pragma GCC unroll 2
          for (int j = 0; j < V; ++j)
            part[j][i] = _mm256_add_epi16(part[j][i], _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], qa),
                                                                       _mm256_maddubs_epi16(hi[j], qb)));
        }
      }
      #pragma GCC unroll 4
      for (int j = 0; j < V; ++j)
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) acc[j][i] = _mm256_add_epi32(acc[j][i], _mm256_madd_epi16(part[j][i], ones));
    }
    #pragma GCC unroll 2
    for (int j = 0; j < V; ++j)
      store_scores8<NQ>(acc[j], step, bias, scale, scores, stride, t0 + 8 * j, std::min(8, nt - 8 * j));
  }
#endif
#endif
  // Tokens [begin, end); with span > 0 (keys in RoPE spans) token t meets
  // query set t / span of q, (sets, n_q, head_dim): each token group's
  // scales are decoded once, each span's queries folded once.
  void score_channel_pairs(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head,
                           float scale, float* scores, int stride, int span = 0) const {
    const int hd = shape_.head_dim, bs = shape_.block_size, pairs = hd / 2;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    const float qmax = folded_qmax<B>(hd);
    const FoldScratch f = fold_scratch(hd, n_q);
    float *sc = f.sc, *mn = f.mn, *step = f.step, *bias = f.bias;
    int16_t* q16 = f.q16;
    for (int tg = begin / group_; tg * group_ < end; ++tg) {
      load_affine(block, tg, kv_head * hd, hd, sc, mn);
      const int g_end = std::min(end, (tg + 1) * group_);
      for (int t_lo = std::max(begin, tg * group_), t1; t_lo < g_end; t_lo = t1) {
        t1 = span > 0 ? std::min(g_end, (t_lo / span + 1) * span) : g_end;  // one query set
        const float* qs = span > 0 ? q + size_t(t_lo / span) * size_t(n_q) * size_t(hd) : q;
#if !defined(__AVX512BW__)
        if (byte_dots_) {
          int8_t* q8 = reinterpret_cast<int8_t*>(q16);  // (n_q, hd), read as (n_q, hd / 4) words
          for (int i = 0; i < n_q; ++i)
            fold_query_bytes8(qs + size_t(i) * hd, hd, sc, mn, step + i, bias + i, q8 + size_t(i) * hd);
          int t0 = t_lo;
#if !defined(__AVXVNNI__)
          for (; t0 + 16 <= t1; t0 += 16)
            by_query_groups(n_q, [&](auto nq, int i) {
              score_tile8_bytes<nq.value, 2>(head, bs, hd / 4, t0, 16, f.pairs + size_t(i) * hd / 4, step + i,
                                             bias + i, scale, scores + size_t(i) * stride, stride);
            });
#endif
          for (; t0 < t1; t0 += 8) {
            const int nt = std::min(8, t1 - t0);
            by_query_groups(n_q, [&](auto nq, int i) {
              score_tile8_bytes<nq.value>(head, bs, hd / 4, t0, nt, f.pairs + size_t(i) * hd / 4, step + i, bias + i,
                                          scale, scores + size_t(i) * stride, stride);
            });
          }
          continue;
        }
#endif
        for (int i = 0; i < n_q; ++i) {  // fold: q16 = round(q_c scale_c / step)
          const float* qi = qs + size_t(i) * hd;
          __m256 b;
          const float mx = fold_first_pass8(qi, hd, sc, mn, b);
          bias[i] = kvserve::simd::hsum8(b);
          step[i] = mx / qmax;
          const __m256 inv = _mm256_set1_ps(mx > 0 ? qmax / mx : 0.0f);
          for (int d = 0; d < hd; d += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(sc + d)), inv));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q16 + size_t(i) * hd + d),
                             _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
          }
        }
        if (octets_) order_pairs(q16, n_q, hd);
        for (int t0 = t_lo; t0 < t1; t0 += 8) {
          const int nt = std::min(8, t1 - t0);
          by_query_groups(n_q, [&](auto nq, int i) {
            score_tile8<nq.value>(head, bs, pairs, t0, nt, f.pairs + size_t(i) * pairs, step + i, bias + i, scale,
                                  scores + size_t(i) * stride, stride, octets_);
          });
        }
      }
    }
  }
#endif

  // Pre-RoPE keys: a query per token, so the scaled query is per token too.
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
#if defined(KVSERVE_TOKEN_SOURCES)
    if (simd_ && !channel_major_) {
      source_kernels::score(source(block, n, kv_head), q, n_q, true, n, scale, scores, stride);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(4 * size_t(hd));
    float *sc = s, *mn = s + hd, *qs = s + 2 * hd, *codes = s + 3 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      for (int t = tg * group_; t < std::min(n, (tg + 1) * group_); ++t) {
        unpack(block, t, kv_head, codes);
        for (int i = 0; i < n_q; ++i) {
          const float* qi = q + (size_t(t) * n_q + i) * hd;
          for (int d = 0; d < hd; ++d) qs[d] = qi[d] * sc[d];
          scores[i * stride + t] = scale * (dot(qs, codes, hd) + dot(qi, mn, hd));
        }
      }
    }
  }

  // Pre-RoPE keys (token rows): each key rotated by its offset in registers
  // after dequantization, against the block's one query set.
  bool score_offsets(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                     const RopeTable& rope, float* scores, int stride) const override {
#if defined(KVSERVE_TOKEN_SOURCES)
    if (!simd_ || channel_major_ || rope.head_dim() != shape_.head_dim || rope.rows() < shape_.block_size)
      return false;
    const float* rot = rope_rows_.get(rope, shape_.block_size);
    if (rot == nullptr) return false;
    source_kernels::score(source(block, n, kv_head), q, n_q, false, n, scale, scores, stride, rot);
    return true;
#else
    return false;
#endif
  }

  // out_d += scale_d * sum_t w_t code_td + min_d * sum_t w_t, per token group.
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (channel_major_simd_) {
      accumulate_channel_major(weights, n_q, stride, block, n, kv_head, out);
      return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (channel_major_ && shape_.head_dim % 8 == 0) {
      accumulate_channel_major8(weights, n_q, stride, block, n, kv_head, out);
      return;
    }
#endif
#if defined(KVSERVE_TOKEN_SOURCES)
    if (simd_ && !channel_major_) {
      source_kernels::accumulate(source(block, n, kv_head), weights, n_q, stride, n, out);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd;
    float* s = scratch(3 * size_t(hd) + size_t(n_q) * hd);
    float *sc = s, *mn = s + hd, *codes = s + 2 * hd, *acc = s + 3 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      std::fill(acc, acc + size_t(n_q) * hd, 0.0f);
      std::vector<float> wsum(static_cast<size_t>(n_q), 0.0f);
      for (int t = t0; t < t1; ++t) {
        unpack(block, t, kv_head, codes);
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


#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Channel-major kernels. A "pair vector" holds, for 16 tokens (lanes), the
  // codes of channels 2p and 2p + 1 as two 16-bit integers.
  // Pair vectors p .. p + kPairsPerLoad - 1 of tokens [t0, t0 + 16) (lanes of
  // mask m; the others are zero).
  static constexpr int kPairsPerLoad = B == 2 ? 2 : 1;
  // oct: the octet layout, pairs in pair_channels order.
  static void load_pairs(const uint8_t* head, int bs, int p, int t0, __mmask16 m, __m512i* x, bool oct) {
    if constexpr (B == 4) {
      if (oct) {  // lane t: token t0 + t's four bytes of octet p / 4; its byte p % 4 to bits 0-3 and 16-19
        const __m512i v = _mm512_maskz_loadu_epi32(m, head + (size_t(p / 4) * bs + size_t(t0)) * 4);
        const __m512i b = _mm512_srli_epi32(v, unsigned(8 * (p % 4)));
        x[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), _mm512_slli_epi32(b, 12),
                                         _mm512_set1_epi32(0xF0000), 0xF8);  // a | (b & c)
        return;
      }
    }
    auto row = [&](int r) { return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, head + size_t(r) * bs + t0)); };
    // (a | b) & c as one ternary-logic instruction.
    auto or_and = [](__m512i a, __m512i b, int c) { return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(c), 0xA8); };
    if constexpr (B == 8) {
      x[0] = _mm512_or_si512(row(2 * p), _mm512_slli_epi32(row(2 * p + 1), 16));
    } else if constexpr (B == 4) {  // byte p: channel 2p low nibble, 2p + 1 high nibble
      const __m512i b = row(p);
      x[0] = or_and(b, _mm512_slli_epi32(b, 12), 0x000F000F);
    } else {  // byte p / 2: channels 2p .. 2p + 3 in bit pairs
      const __m512i b = row(p / 2);
      x[0] = or_and(b, _mm512_slli_epi32(b, 14), 0x00030003);
      x[1] = or_and(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(b, 10), 0x00030003);
    }
  }
  static __mmask16 lanes(int count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }
  // The (scale, min) of the head's channels for token group tg, as floats.
  void head_affine(const uint8_t* block, int tg, int kv_head, float* scale, float* min) const {
    const int hd = shape_.head_dim;
    if (compact_) {
      scale8::decode_run(run(block, tg, kv_head), hd, scale, min);
      return;
    }
    const fp16_t* meta = pair(block, tg, kv_head * hd);
    for (int d = 0; d < hd; d += 16) {
      __m512 sc, mn;
      simd::split_pairs(_mm512_maskz_loadu_epi32(lanes(hd - d), meta + 2 * d), sc, mn);
      _mm512_mask_storeu_ps(scale + d, lanes(hd - d), sc);
      _mm512_mask_storeu_ps(min + d, lanes(hd - d), mn);
    }
  }

  // NQ queries (NQ, hd) folded with the channel scales: folded = round(q_c
  // scale_c / step), step = max_c |q_c scale_c| / qmax, and bias = sum_c q_c
  // min_c. The queries go side by side so that their reductions overlap.
  // Out: int16_t (score_tile) or int8_t (score_tiles_bytes).
  template <int NQ, class Out>
  static void fold_queries(const float* q, int hd, const float* sc, const float* mn, float qmax, float* step,
                           float* bias, Out* folded) {
    __m512 amax[NQ], b[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) amax[i] = b[i] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) {
      const __mmask16 m = lanes(hd - d);
      const __m512 s = _mm512_maskz_loadu_ps(m, sc + d), mi = _mm512_maskz_loadu_ps(m, mn + d);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 x = _mm512_maskz_loadu_ps(m, q + size_t(i) * hd + d);
        amax[i] = _mm512_max_ps(amax[i], _mm512_abs_ps(_mm512_mul_ps(x, s)));
        b[i] = _mm512_fmadd_ps(x, mi, b[i]);
      }
    }
    alignas(16) float invs[4];
    simd::fold_steps(amax, NQ, qmax, step, invs);
    // 8 bits leave a rounding residual r_c (in steps) per channel that
    // matters: the score misses step sum_c r_c code_c. Its part at the codes'
    // midpoint, step (2^B - 1) / 2 sum_c r_c, is the same for every token and
    // joins the bias's sum; what remains varies with code_c - 7.5 only:
    // about a quarter of the error's variance for codes spread over 0..15
    // (21.25 / 77.5).
    __m512 inv[NQ], mid[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) inv[i] = _mm512_set1_ps(invs[i]), mid[i] = _mm512_set1_ps(step[i] * 0.5f * float((1 << B) - 1));
    for (int d = 0; d < hd; d += 16) {
      const __mmask16 m = lanes(hd - d);
      const __m512 s = _mm512_maskz_loadu_ps(m, sc + d);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + size_t(i) * hd + d), s), inv[i]);
        if constexpr (sizeof(Out) == 1) {
          const __m512 rounded = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          _mm_mask_storeu_epi8(folded + size_t(i) * hd + d, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded)));
          b[i] = _mm512_fmadd_ps(_mm512_sub_ps(x, rounded), mid[i], b[i]);
        } else {
          _mm256_mask_storeu_epi16(folded + size_t(i) * hd + d, m, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x)));
        }
      }
    }
    _mm_mask_storeu_ps(bias, __mmask8((1u << NQ) - 1), kvserve::simd::reduce4<false>(b, NQ));
  }

  // Scores of NQ queries against tokens [t0, t0 + 16) (lanes of m): q16 is
  // (NQ, head_dim) int16, read as (NQ, head_dim / 2) channel pairs;
  // score = scale * (step * dot + bias) per query.
  template <int NQ>
  static void score_tile(const uint8_t* head, int bs, int pairs, int t0, __mmask16 m, const int32_t* q16,
                         const float* step, const float* bias, float scale, float* scores, int stride, bool oct) {
    // Two sums per query (even and odd pairs): the dot products' latency, not
    // their throughput, would bound a single chain.
    __m512i acc[2][NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_si512();
    int p = 0;
    for (; p + 2 <= pairs; p += 2) {
      __m512i x[2];
      load_pairs(head, bs, p, t0, m, x, oct);
      if constexpr (kPairsPerLoad == 1) load_pairs(head, bs, p + 1, t0, m, x + 1, oct);
      #pragma GCC unroll 8
      for (int k = 0; k < 2; ++k)
        #pragma GCC unroll 8
        for (int i = 0; i < NQ; ++i) acc[k][i] = kvserve::simd::dot_pairs(acc[k][i], x[k], _mm512_set1_epi32(q16[i * pairs + p + k]));
    }
    if (p < pairs) {  // an odd pair count (B = 8 or 4)
      __m512i x[kPairsPerLoad];
      load_pairs(head, bs, p, t0, m, x, oct);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) acc[0][i] = kvserve::simd::dot_pairs(acc[0][i], x[0], _mm512_set1_epi32(q16[i * pairs + p]));
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][i], acc[1][i]));
      const __m512 dot = _mm512_fmadd_ps(sum, _mm512_set1_ps(step[i]), _mm512_set1_ps(bias[i]));
      _mm512_mask_storeu_ps(scores + size_t(i) * stride + t0, m, _mm512_mul_ps(_mm512_set1_ps(scale), dot));
    }
  }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // 4-bit keys against a query folded to 8 bits: vpdpbusd multiplies four
  // unsigned code bytes by four signed query bytes per 32-bit lane, so one
  // instruction covers 4 channels of 16 tokens per query, twice the
  // channels of the 16-bit pairs in score_tile. In the octet layout a
  // 64-byte load holds 16 tokens' codes of eight channels, and their low
  // nibbles (channels 8o .. 8o + 3) and high nibbles (8o + 4 .. 8o + 7) are
  // already four codes per lane in channel order.
  // Octet o of tokens [t0, t0 + 16 T) (bits of m; the others are zero) as T
  // vectors of channels 8o .. 8o + 3 (lo) and T of 8o + 4 .. 8o + 7 (hi).
  // full: all 16 T bits of m are set. Whole tiles then load without a mask:
  // the masked loads made int4-small's layer 2-7% slower on the AVX-512 host
  // (BENCHMARKS.md, sixteenth session).
  template <int T>
  static void load_octet(const uint8_t* head, int bs, int o, int t0, __mmask64 m, bool full, __m512i* lo,
                         __m512i* hi) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    #pragma GCC unroll 4
    for (int v = 0; v < T; ++v) {
      const uint8_t* p = head + (size_t(o) * bs + size_t(t0 + 16 * v)) * 4;
      const __m512i x = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(__mmask16(m >> (16 * v)), p);
      lo[v] = _mm512_and_si512(x, nib);
      hi[v] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
    }
  }
  // score_tile with 8-bit queries, over T tiles of 16 tokens from t0 (bits
  // of m): q8 is (NQ, head_dim) int8, read as (NQ, quads) four-channel words.
  // Up to four tiles (64 tokens) share each query broadcast.
  template <int NQ, int T>
  static void score_tiles_bytes(const uint8_t* head, int bs, int quads, int t0, __mmask64 m, const int32_t* q8,
                                const float* step, const float* bias, float scale, float* scores, int stride) {
    // Separate sums for even and odd quads (an octet's low and high nibbles)
    // while there are fewer than four tiles: fewer chains would be bound by
    // the dot products' latency. Four tiles have twelve chains for three
    // queries, and no registers for twice as many.
    constexpr int K = T >= 4 ? 1 : 2;
    __m512i acc[K][T][NQ];
    #pragma GCC unroll 8
    for (int k = 0; k < K; ++k)
      #pragma GCC unroll 8
      for (int v = 0; v < T; ++v)
        #pragma GCC unroll 8
        for (int i = 0; i < NQ; ++i) acc[k][v][i] = _mm512_setzero_si512();
    const bool full = m == (T == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * T)) - 1);
    for (int g = 0; g < quads; g += 2) {  // quads is even: whole octets
      __m512i x[2][T];
      load_octet<T>(head, bs, g / 2, t0, m, full, x[0], x[1]);
      #pragma GCC unroll 2
      for (int k = 0; k < 2; ++k)
        #pragma GCC unroll 8
        for (int i = 0; i < NQ; ++i) {
          const __m512i qi = _mm512_set1_epi32(q8[i * quads + g + k]);
          #pragma GCC unroll 4
          for (int v = 0; v < T; ++v) acc[k % K][v][i] = _mm512_dpbusd_epi32(acc[k % K][v][i], x[k][v], qi);
        }
    }
    #pragma GCC unroll 4
    for (int v = 0; v < T; ++v) {
      const __mmask16 lanes = __mmask16(m >> (16 * v));
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        __m512i total = acc[0][v][i];
        if constexpr (K == 2) total = _mm512_add_epi32(total, acc[1][v][i]);
        const __m512 sum = _mm512_cvtepi32_ps(total);
        const __m512 dot = _mm512_fmadd_ps(sum, _mm512_set1_ps(step[i]), _mm512_set1_ps(bias[i]));
        _mm512_mask_storeu_ps(scores + size_t(i) * stride + t0 + 16 * v, lanes, _mm512_mul_ps(_mm512_set1_ps(scale), dot));
      }
    }
  }
#endif

  // q·k_t = sum_c (q_c scale_c) code_tc + sum_c q_c min_c. The folded query is
  // rounded to 16 bits with one step per (query, token group): at most
  // 32767 steps across its largest channel, fewer where int32 sums of
  // head_dim products could overflow. Tokens [begin, end); with span > 0
  // (keys in RoPE spans) token t meets query set t / span of q, (sets, n_q,
  // head_dim), each folded once per span.
  void score_channel_major(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head,
                           float scale, float* scores, int stride, int span = 0) const {
    const int hd = shape_.head_dim, bs = shape_.block_size, pairs = hd / 2;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    if (begin == 0) simd::prefetch_rows(head, head_bytes_, 1, head_bytes_);  // once per block, not per span
    const FoldScratch f = fold_scratch(hd, n_q);
    float *sc = f.sc, *mn = f.mn, *step = f.step, *bias = f.bias;
    const bool bytes = byte_dots_;  // 8-bit queries (score_tiles_bytes), else 16-bit (score_tile)
    const float qmax = bytes ? 127.0f : folded_qmax<B>(hd);
    for (int tg = begin / group_; tg * group_ < end; ++tg) {
      head_affine(block, tg, kv_head, sc, mn);
      const int g_end = std::min(end, (tg + 1) * group_);
      for (int t_lo = std::max(begin, tg * group_), t1; t_lo < g_end; t_lo = t1) {
        t1 = span > 0 ? std::min(g_end, (t_lo / span + 1) * span) : g_end;  // one query set
        const float* qs = span > 0 ? q + size_t(t_lo / span) * size_t(n_q) * size_t(hd) : q;
        by_query_groups(n_q, [&](auto nq, int i) {
          if (bytes)
            fold_queries<nq.value>(qs + size_t(i) * hd, hd, sc, mn, qmax, step + i, bias + i,
                                   reinterpret_cast<int8_t*>(f.q16) + size_t(i) * hd);
          else
            fold_queries<nq.value>(qs + size_t(i) * hd, hd, sc, mn, qmax, step + i, bias + i,
                                   f.q16 + size_t(i) * hd);
        });
        if (!bytes && octets_) order_pairs(f.q16, n_q, hd);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (bytes) {
          const int quads = hd / 4;
          for (int t0 = t_lo; t0 < t1; t0 += 64) {
            const int nt = std::min(64, t1 - t0);
            const __mmask64 m = nt >= 64 ? ~__mmask64(0) : (__mmask64(1) << nt) - 1;
            by_query_groups(n_q, [&](auto nq, int i) {
              auto tiles = [&](auto kernel) {
                kernel(head, bs, quads, t0, m, f.pairs + size_t(i) * quads, step + i, bias + i, scale,
                       scores + size_t(i) * stride, stride);
              };
              if (nt > 48) tiles(score_tiles_bytes<nq.value, 4>);
              else if (nt > 32) tiles(score_tiles_bytes<nq.value, 3>);
              else if (nt > 16) tiles(score_tiles_bytes<nq.value, 2>);
              else tiles(score_tiles_bytes<nq.value, 1>);
            });
          }
          continue;
        }
#endif
        for (int t0 = t_lo; t0 < t1; t0 += 16) {
          const __mmask16 m = lanes(t1 - t0);
          by_query_groups(n_q, [&](auto nq, int i) {
            score_tile<nq.value>(head, bs, pairs, t0, m, f.pairs + size_t(i) * pairs, step + i, bias + i, scale,
                                 scores + size_t(i) * stride, stride, octets_);
          });
        }
      }
    }
  }

  // out_c += scale_c sum_t w_t code_tc + min_c sum_t w_t per token group;
  // the sums over tokens (lanes) are reduced 16 channels at a time.
  void accumulate_channel_major(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                                float* out) const {
    const int hd = shape_.head_dim, bs = shape_.block_size, pairs = hd / 2;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    simd::prefetch_rows(head, head_bytes_, 1, head_bytes_);
    const int tiles = (hd + 15) / 16;
    thread_local std::vector<float> fbuf;
    const size_t need = size_t(2 * hd) + size_t(n_q) * (size_t(tiles) * 16 + 1) + size_t(tiles) * 16 * 16;
    if (fbuf.size() < need) fbuf.resize(need);
    float *sc = fbuf.data(), *mn = sc + hd, *acc = mn + hd, *wsum = acc + size_t(n_q) * tiles * 16;
    float* codes = wsum + n_q;  // (tiles * 16 channels, 16 token lanes)
    for (int tg = 0; tg * group_ < n; ++tg) {
      head_affine(block, tg, kv_head, sc, mn);
      std::fill(acc, acc + size_t(n_q) * tiles * 16 + size_t(n_q), 0.0f);  // acc and wsum
      std::fill(codes, codes + size_t(tiles) * 256, 0.0f);
      const int t1 = std::min(n, (tg + 1) * group_);
      for (int t0 = tg * group_; t0 < t1; t0 += 16) {
        const __mmask16 m = lanes(t1 - t0);
        for (int p = 0; p < pairs; p += kPairsPerLoad) {
          __m512i x[kPairsPerLoad];
          load_pairs(head, bs, p, t0, m, x, octets_);
          for (int k = 0; k < kPairsPerLoad; ++k) {
            const auto [c0, c1] = pair_channels(p + k, octets_);
            _mm512_storeu_ps(codes + size_t(c0) * 16, _mm512_cvtepi32_ps(_mm512_and_si512(x[k], _mm512_set1_epi32(0xFFFF))));
            _mm512_storeu_ps(codes + size_t(c1) * 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(x[k], 16)));
          }
        }
        for (int i = 0; i < n_q; ++i) {
          const __m512 w = _mm512_maskz_loadu_ps(m, weights + size_t(i) * stride + t0);
          wsum[i] += _mm512_reduce_add_ps(w);
          for (int tile = 0; tile < tiles; ++tile) {
            __m512 prod[16];
            #pragma GCC unroll 16
            for (int c = 0; c < 16; ++c) prod[c] = _mm512_mul_ps(w, _mm512_loadu_ps(codes + size_t(tile * 16 + c) * 16));
            float* a = acc + (size_t(i) * tiles + tile) * 16;
            _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), simd::hsum16(prod)));
          }
        }
      }
      for (int i = 0; i < n_q; ++i)
        for (int d = 0; d < hd; d += 16) {
          const __mmask16 m = lanes(hd - d);
          float* o = out + size_t(i) * hd + d;
          const __m512 sum = _mm512_loadu_ps(acc + size_t(i) * tiles * 16 + d);
          const __m512 add = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, sc + d), sum,
                                             _mm512_mul_ps(_mm512_maskz_loadu_ps(m, mn + d), _mm512_set1_ps(wsum[i])));
          _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), add));
        }
    }
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // Channel-major values on AVX2: a tile is 8 channels of 8 tokens, one
  // vector per channel with the tokens in its lanes (load_tile8); each query
  // multiplies them by its 8 weights and one transpose-and-add turns the 8
  // products into the 8 channels' sums. Scales and mins apply once per token
  // group, as in the scalar loop.
  // Channels c0 .. c0 + 7 (c0 a multiple of 8) of tokens t0 .. t0 + 7 (those
  // at or past the block's end read as 0) as floats.
  void load_tile8(const uint8_t* head, int c0, int t0, __m256* x) const {
    const int bs = shape_.block_size, live = std::min(8, bs - t0);
    auto bytes8 = [&](const uint8_t* p) {  // 8 bytes, none past the row's end
      if (live == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      alignas(8) uint8_t tail[8] = {};
      std::memcpy(tail, p, size_t(live));
      return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tail)));
    };
    const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
    if (octets_) {  // lane t: token t0 + t's 4 bytes of the octet; channel c0 + j in byte j % 4, nibble j / 4
      const uint8_t* p = head + (size_t(c0 / 8) * size_t(bs) + size_t(t0)) * 4;
      __m256i v;
      if (live == 8) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      } else {
        alignas(32) uint8_t tail[32] = {};
        std::memcpy(tail, p, size_t(live) * 4);
        v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      }
      #pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        x[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * (j % 4) + 4 * (j / 4)), mask));
      return;
    }
    constexpr int kPerByte = 8 / B;
    #pragma GCC unroll 8
    for (int r = 0; r < 8 / kPerByte; ++r) {  // byte rows of the tile
      const __m256i b = bytes8(head + size_t(c0 / kPerByte + r) * size_t(bs) + size_t(t0));
      #pragma GCC unroll 4
      for (int k = 0; k < kPerByte; ++k)
        x[r * kPerByte + k] = _mm256_cvtepi32_ps(B == 8 ? b : _mm256_and_si256(_mm256_srli_epi32(b, k * B), mask));
    }
  }
  void accumulate_channel_major8(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                                 float* out) const {
    const int hd = shape_.head_dim;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    simd::prefetch_rows(head, head_bytes_, 1, head_bytes_);
    float* s = scratch(2 * size_t(hd) + size_t(n_q) * (size_t(hd) + 1));
    float *sc = s, *mn = s + hd, *acc = s + 2 * hd, *wsum = acc + size_t(n_q) * hd;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, kv_head * hd, hd, sc, mn);
      std::fill(acc, acc + size_t(n_q) * (size_t(hd) + 1), 0.0f);  // acc and wsum
      const int t1 = std::min(n, (tg + 1) * group_);
      for (int t0 = tg * group_; t0 < t1; t0 += 8) {
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(t1 - t0), lane);  // weights past t1 read as 0
        for (int i = 0; i < n_q; ++i)
          wsum[i] += kvserve::simd::hsum8(_mm256_maskload_ps(weights + size_t(i) * stride + t0, live));
        for (int c0 = 0; c0 < hd; c0 += 8) {
          __m256 x[8];
          load_tile8(head, c0, t0, x);
          for (int i = 0; i < n_q; ++i) {
            const __m256 w = _mm256_maskload_ps(weights + size_t(i) * stride + t0, live);
            __m256 p[8];
            #pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) p[j] = _mm256_mul_ps(w, x[j]);
            const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
            const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
            float* o = acc + size_t(i) * hd + c0;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), sums));
          }
        }
      }
      for (int i = 0; i < n_q; ++i)
        for (int d = 0; d < hd; d += 8) {
          float* o = out + size_t(i) * hd + d;
          const __m256 add = _mm256_fmadd_ps(_mm256_loadu_ps(sc + d), _mm256_loadu_ps(acc + size_t(i) * hd + d),
                                             _mm256_mul_ps(_mm256_loadu_ps(mn + d), _mm256_set1_ps(wsum[i])));
          _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), add));
        }
    }
  }
#endif
#if defined(__AVX512F__)
  // Per-channel scale and min of each token group, in lane order.
  struct Source {
    using Order = simd::Lanes<B>;
    const uint8_t* block;
    size_t code_stride, code_off;  // in bytes
    int head_dim, group;
    const float *scale, *min;  // (token group, head_dim) lane order
    struct Cursor {
      const uint8_t* codes;
      const float *scale, *min;  // (head_dim) lane order
      void chunk(int c, __m512* x) const {
        Order::unpack(codes + 16 * c, x);
        #pragma GCC unroll 16
        for (int k = 0; k < Order::kVecs; ++k) {
          const int v = (c * Order::kVecs + k) * 16;
          x[k] = _mm512_fmadd_ps(x[k], _mm512_loadu_ps(scale + v), _mm512_loadu_ps(min + v));
        }
      }
    };
    void prefetch(int n) const { simd::prefetch_rows(block + code_off, code_stride, n, size_t(head_dim) * B / 8); }
    Cursor token(int t) const {
      const size_t g = size_t(t / group) * head_dim;
      return {block + size_t(t) * code_stride + code_off, scale + g, min + g};
    }
  };
  // REQUIRES: simd_. The head's scales and mins from lane_affine.
  Source source(const uint8_t* block, int n, int kv_head) const {
    const int hd = shape_.head_dim, first = kv_head * hd;
    const size_t code_off = head_major_ ? size_t(code_row(block, 0, kv_head) - block) : size_t(first) * B / 8;
    const LaneAffine a = lane_affine<simd::Lanes<B>>(block, n, kv_head);
    return {block, head_major_ ? head_code_bytes_ : code_bytes_, code_off, hd, group_, a.scale, a.min};
  }
#elif defined(KVSERVE_TOKEN_SOURCES)
  // The same on 8 lanes (source_kernels8.h).
  struct Source {
    using Order = simd8::Lanes8<B>;
    const uint8_t* codes;  // token 0's
    size_t code_stride;
    int head_dim, group;
    const float *scale, *min;  // (token group, head_dim) lane order
    struct Cursor {
      const uint8_t* codes;
      const float *scale, *min;  // (head_dim) lane order
      void chunk(int c, __m256* x) const {
        Order::unpack(codes + 8 * c, x);
        #pragma GCC unroll 4
        for (int k = 0; k < Order::kVecs; ++k) {
          const int v = (c * Order::kVecs + k) * 8;
          x[k] = _mm256_fmadd_ps(x[k], _mm256_loadu_ps(scale + v), _mm256_loadu_ps(min + v));
        }
      }
    };
    void prefetch(int n) const { simd::prefetch_rows(codes, code_stride, n, size_t(head_dim) * B / 8); }
    Cursor token(int t) const {
      const size_t g = size_t(t / group) * head_dim;
      return {codes + size_t(t) * code_stride, scale + g, min + g};
    }
  };
  Source source(const uint8_t* block, int n, int kv_head) const {
    const int hd = shape_.head_dim, first = kv_head * hd;
    const uint8_t* codes = head_major_ ? code_row(block, 0, kv_head) : block + size_t(first) * B / 8;
    const LaneAffine a = lane_affine<simd8::Lanes8<B>>(block, n, kv_head);
    return {codes, head_major_ ? head_code_bytes_ : code_bytes_, hd, group_, a.scale, a.min};
  }
#endif
#if defined(KVSERVE_TOKEN_SOURCES)
  // The head's per-channel scales and mins, (token group, head_dim) in
  // Order's lane order, for the token groups holding the first n tokens:
  // the calibrated ones as kept (static), else converted once per call into
  // per-thread scratch, for every token of the call.
  struct LaneAffine {
    const float *scale, *min;
  };
  template <class Order>
  LaneAffine lane_affine(const uint8_t* block, int n, int kv_head) const {
    const int hd = shape_.head_dim, first = kv_head * hd;
    if (static_) return {static_scale_lanes_.data() + first, static_min_lanes_.data() + first};
    const int groups = (n + group_ - 1) / group_;
    float* buf = int_codec::scratch(1, (size_t(groups) * 2 + 2) * size_t(hd));
    float *sc = buf, *mn = buf + size_t(groups) * hd, *nat_s = mn + size_t(groups) * hd, *nat_m = nat_s + hd;
    for (int tg = 0; tg < groups; ++tg) {
      load_affine(block, tg, first, hd, nat_s, nat_m);
      for (int d = 0; d < hd; d += Order::kCodes) {
        Order::to_lanes(nat_s + d, sc + size_t(tg) * hd + d);
        Order::to_lanes(nat_m + d, mn + size_t(tg) * hd + d);
      }
    }
    return {sc, mn};
  }
#endif

 private:
  // Codes of token slot, starting at kv_head's first channel (head-major; in
  // token-major blocks the whole row, whatever kv_head is). Channel d of the
  // row is code index(d) there.
  template <class P>
  P* code_row(P* block, int slot, int kv_head) const {
    if (head_major_) return block + size_t(kv_head) * head_bytes_ + size_t(slot) * head_code_bytes_;
    return block + size_t(slot) * code_bytes_;
  }
  int index(int d) const { return head_major_ ? d % shape_.head_dim : d; }
  // The code of row channel d of token slot, wherever the layout keeps it.
  int get(const uint8_t* block, int slot, int d) const {
    if (!channel_major_) return get_code<B>(code_row(block, slot, d / shape_.head_dim), index(d));
    return (*channel_byte(block, slot, d) >> channel_shift(d % shape_.head_dim)) & ((1 << B) - 1);
  }
  void put(uint8_t* block, int slot, int d, int code) const {
    if (!channel_major_) return set_code<B>(code_row(block, slot, d / shape_.head_dim), index(d), code);
    const int shift = channel_shift(d % shape_.head_dim);
    uint8_t& byte = *channel_byte(block, slot, d);
    byte = uint8_t((byte & ~(((1 << B) - 1) << shift)) | (code << shift));
  }
  // Channel-major: the byte holding row channel d of token slot, and where
  // head channel c sits in its byte.
  template <class P>
  P* channel_byte(P* block, int slot, int d) const {
    const int hd = shape_.head_dim, c = d % hd;
    P* head = block + size_t(d / hd) * head_bytes_;
    if (octets_) return head + (size_t(c / 8) * size_t(shape_.block_size) + size_t(slot)) * 4 + size_t(c % 4);
    return head + size_t(c / (8 / B)) * size_t(shape_.block_size) + size_t(slot);
  }
  int channel_shift(int c) const { return octets_ ? (c % 8) / 4 * 4 : (c % (8 / B)) * B; }
  // The two channels of a 16-bit pair vector p (load_pairs): 2p and 2p + 1,
  // or, in the octet layout, the low and high nibble of byte p % 4 of octet p / 4.
  static std::pair<int, int> pair_channels(int p, bool oct) {
    if (!oct) return {2 * p, 2 * p + 1};
    const int c = 8 * (p / 4) + p % 4;
    return {c, c + 4};
  }
  // Folded queries (n_q, hd) int16 put in pair_channels order for the octet layout.
  static void order_pairs(int16_t* q16, int n_q, int hd) {
    for (int i = 0; i < n_q; ++i)
      for (int o = 0; o < hd; o += 8) {
        int16_t* x = q16 + size_t(i) * hd + o;
        int16_t nat[8];
        std::copy_n(x, 8, nat);
        for (int j = 0; j < 4; ++j) x[2 * j] = nat[j], x[2 * j + 1] = nat[j + 4];
      }
  }
  // The (scale, min) pair of channel d for token group tg; the pairs of one
  // head's channels are contiguous.
  template <class P>
  auto* pair(P* block, int tg, int d) const {
    using F = std::conditional_t<std::is_const_v<P>, const fp16_t, fp16_t>;
    const int hd = shape_.head_dim;
    if (head_major_) {
      P* meta = block + size_t(d / hd) * head_bytes_ + size_t(shape_.block_size) * head_code_bytes_;
      return reinterpret_cast<F*>(meta) + 2 * (size_t(tg) * hd + size_t(d % hd));
    }
    return reinterpret_cast<F*>(block + size_t(shape_.block_size) * code_bytes_) +
           2 * (size_t(tg) * shape_.kv_dim() + size_t(d));
  }
  // 8-bit scales: the run of KV head kv_head's channels for token group tg
  // (head-major), after the head's codes.
  template <class P>
  P* run(P* block, int tg, int kv_head) const {
    return block + size_t(kv_head) * head_bytes_ + size_t(shape_.block_size) * head_code_bytes_ +
           size_t(tg) * scale8::run_bytes(shape_.head_dim);
  }
  // Metadata bytes of one head for one token group.
  static size_t head_run_bytes(const KvCodecConfig& c, const KvBlockShape& s) {
    return c.scale_bits == 8 ? scale8::run_bytes(s.head_dim) : size_t(s.head_dim) * 2 * sizeof(fp16_t);
  }
  // scale/min of channels [first, first + count) for token group tg; with
  // 8-bit scales whole heads (every caller asks for one head or the row).
  void load_affine(const uint8_t* block, int tg, int first, int count, float* scale, float* min) const {
    if (static_) {
      std::copy_n(static_scale_.begin() + first, count, scale);
      std::copy_n(static_min_.begin() + first, count, min);
      return;
    }
    if (compact_) {
      const int hd = shape_.head_dim;
      for (int d = 0; d < count; d += hd) scale8::decode_run(run(block, tg, (first + d) / hd), hd, scale + d, min + d);
      return;
    }
    const int hd = shape_.head_dim;
    for (int d = 0, run; d < count; d += run) {  // pairs run contiguously within a head (head-major) or a row
      run = head_major_ ? std::min(count - d, hd - (first + d) % hd) : count - d;
      split_pair_run(pair(block, tg, first + d), run, scale + d, min + d);
    }
  }
  // The head_dim codes of kv_head for token t, as floats.
  void unpack(const uint8_t* block, int t, int kv_head, float* out) const {
    const int hd = shape_.head_dim;
    for (int d = 0; d < hd; ++d) out[d] = float(get(block, t, kv_head * hd + d));
  }
  static float* scratch(size_t n) {
    thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }

  bool static_;
  bool compact_;  // 8-bit scales (kv/scale8.h), one run per (token group, head)
  int group_;          // tokens per (scale, min) group
  size_t code_bytes_;  // packed codes of one token row
  bool head_major_;
  bool channel_major_;  // head-major codes stored (channel byte, token)
  bool octets_;         // ... 4-bit, as (octet, token, byte): the octet layout
  size_t head_code_bytes_;  // packed codes of one head of one token (head-major)
  size_t head_bytes_;       // codes + metadata of one head for the whole block (head-major)
  std::vector<float> static_scale_, static_min_, static_max_;  // (kv_dim) when static
  bool simd_ = false;
  bool channel_major_simd_ = false;  // channel_major_ with the integer kernels below
  bool byte_dots_ = false;           // ... scoring with 8-bit queries (score_tiles_bytes)
  std::vector<float> static_scale_lanes_, static_min_lanes_;  // (kv_dim) lane order, when static and simd_
#if defined(__AVX512F__)
  LaneRopeRows<simd::Lanes<B>> rope_rows_;  // score_offsets' rotations
#elif defined(KVSERVE_TOKEN_SOURCES)
  LaneRopeRows<simd8::Lanes8<B>> rope_rows_;
#endif
};

}  // namespace int_codec

int channel_query_steps(const KvCodecConfig& config, const KvBlockShape& shape) {
  return int_codec::byte_query_kernel(config, shape) ? 127 : 32767;
}

std::unique_ptr<KvCodec> make_channel_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  switch (config.dtype) {
    case KvDType::INT8: return std::make_unique<int_codec::ChannelCodec<8>>(config, shape);
    case KvDType::INT4: return std::make_unique<int_codec::ChannelCodec<4>>(config, shape);
    default: return std::make_unique<int_codec::ChannelCodec<2>>(config, shape);
  }
}

}  // namespace kvserve
