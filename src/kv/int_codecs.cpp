#include "kv/int_codecs.h"

#include "kv/attention_simd.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/vector_ops.h"
#include "util/half.h"

namespace kvserve {
namespace {

// The largest magnitude a 16-bit folded operand may take when int32 sums of
// `terms` products with B-bit codes must not overflow.
template <int B>
float folded_qmax(int terms) {
  return float(std::min<int64_t>(32767, INT32_MAX / (int64_t((1 << B) - 1) * terms)));
}

// Runs f(std::integral_constant<int, m>{}, i) over groups [i, i + m) of at
// most 4 of n_q queries: kernels templated on the group size keep their
// per-query accumulators in registers.
template <class F>
void by_query_groups(int n_q, F&& f) {
  for (int i = 0; i < n_q; i += 4) switch (std::min(4, n_q - i)) {
      case 1: f(std::integral_constant<int, 1>{}, i); break;
      case 2: f(std::integral_constant<int, 2>{}, i); break;
      case 3: f(std::integral_constant<int, 3>{}, i); break;
      default: f(std::integral_constant<int, 4>{}, i); break;
    }
}

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

#if defined(__AVX512F__)
// AVX-512 attention kernels. Each codec exposes a *source*: for token t,
// `token(t)` returns a small cursor whose `chunk(c, x)` dequantizes chunk c of
// the head slice (16 bytes of packed codes, or one q4_0 block) straight into
// Order::kVecs registers. The kernels below are codec-blind: scores
// accumulate q·x per token in registers and reduce 16 tokens at once;
// accumulate keeps the (query, dim) sums in registers across the block. Every
// key or value byte is read once per call, for all n_q queries of the group.
//
// Lane order: unpacking B-bit codes with shifts leaves vector k of a chunk
// holding codes j * kVecs + k (j = lane). Rather than shuffling every token's
// codes back, queries (and per-channel scales) are permuted into that order
// once per call, and accumulated outputs are permuted back once per call.
namespace simd {

#if defined(__AVX512F__)
using kvserve::simd::hsum16;
#endif
using kvserve::simd::prefetch_rows;





// 16 (scale, min) fp16 pairs, one per 32-bit word, split into two float vectors.
inline void split_pairs(__m512i words, __m512& scale, __m512& min) {
  scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
  min = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
}

// B-bit codes: a chunk is 16 bytes = kCodes codes in kVecs vectors; vector k,
// lane j holds code j * kVecs + k of the chunk.
template <int B>
struct Lanes {
  static constexpr int kVecs = 8 / B;
  static constexpr int kCodes = 16 * kVecs;

  static void unpack(const uint8_t* p, __m512* c) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mask = _mm512_set1_epi32((1 << B) - 1);
    c[0] = _mm512_cvtepi32_ps(B == 8 ? b : _mm512_and_si512(b, mask));
    for (int k = 1; k < kVecs; ++k) {
      const __m512i s = _mm512_srli_epi32(b, unsigned(k * B));
      c[k] = _mm512_cvtepi32_ps(k + 1 == kVecs ? s : _mm512_and_si512(s, mask));
    }
  }
  // kCodes natural-order floats -> lane order, and back.
  static void to_lanes(const float* nat, float* lanes) {
    if constexpr (B == 8) {
      std::memcpy(lanes, nat, sizeof(float) * 16);
    } else if constexpr (B == 4) {
      const __m512 n0 = _mm512_loadu_ps(nat), n1 = _mm512_loadu_ps(nat + 16);
      #pragma GCC unroll 16
      for (int k = 0; k < 2; ++k) _mm512_storeu_ps(lanes + 16 * k, _mm512_permutex2var_ps(n0, index(2, k), n1));
    } else {
      const __m512 n0 = _mm512_loadu_ps(nat), n1 = _mm512_loadu_ps(nat + 16);
      const __m512 n2 = _mm512_loadu_ps(nat + 32), n3 = _mm512_loadu_ps(nat + 48);
      #pragma GCC unroll 16
      for (int k = 0; k < 4; ++k) {
        const __m512i idx = _mm512_and_si512(index(4, k), _mm512_set1_epi32(31));  // element 4j + k
        _mm512_storeu_ps(lanes + 16 * k, _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(n0, idx, n1),
                                                              _mm512_permutex2var_ps(n2, idx, n3)));
      }
    }
  }
  static void from_lanes(const __m512* lanes, __m512* nat) {
    if constexpr (B == 8) {
      nat[0] = lanes[0];
    } else if constexpr (B == 4) {
      #pragma GCC unroll 16
      for (int m = 0; m < 2; ++m) {  // element e = 16m + j sits in vector e % 2, lane e / 2
        const __m512i j = iota();
        const __m512i idx = _mm512_or_si512(_mm512_add_epi32(_mm512_srli_epi32(j, 1), _mm512_set1_epi32(8 * m)),
                                            _mm512_slli_epi32(_mm512_and_si512(j, _mm512_set1_epi32(1)), 4));
        nat[m] = _mm512_permutex2var_ps(lanes[0], idx, lanes[1]);
      }
    } else {
      #pragma GCC unroll 16
      for (int m = 0; m < 4; ++m) {  // element e = 16m + j sits in vector e % 4, lane e / 4
        const __m512i j = iota();
        const __m512i idx = _mm512_or_si512(_mm512_add_epi32(_mm512_srli_epi32(j, 2), _mm512_set1_epi32(4 * m)),
                                            _mm512_slli_epi32(_mm512_and_si512(j, _mm512_set1_epi32(1)), 4));
        nat[m] = _mm512_mask_blend_ps(0xCCCC, _mm512_permutex2var_ps(lanes[0], idx, lanes[1]),
                                      _mm512_permutex2var_ps(lanes[2], idx, lanes[3]));
      }
    }
  }

 private:
  static __m512i iota() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
  // Lane j: mul * j + add.
  static __m512i index(int mul, int add) {
    return _mm512_add_epi32(_mm512_mullo_epi32(iota(), _mm512_set1_epi32(mul)), _mm512_set1_epi32(add));
  }
};

// Natural order with kVecs vectors per chunk (q4_0: one 32-value block).
template <int V>
struct Natural {
  static constexpr int kVecs = V;
  static constexpr int kCodes = 16 * V;
  static void to_lanes(const float* nat, float* lanes) { std::memcpy(lanes, nat, sizeof(float) * kCodes); }
  static void from_lanes(const __m512* lanes, __m512* nat) {
    #pragma GCC unroll 16
    for (int k = 0; k < V; ++k) nat[k] = lanes[k];
  }
};

// For nq <= 4 folded vectors: the largest magnitude top[i] and the sum b[i]
// of each; writes step[i] = max / qmax (the 16-bit rounding step), bias[i] =
// sum and inv[i] = qmax / max (0 when max is 0).
inline void fold_steps(const __m512* top, const __m512* b, int nq, float qmax, float* step, float* bias,
                       float* inv) {
  const __m128 tops = kvserve::simd::reduce4<true>(top, nq);
  const __mmask8 lane = __mmask8((1u << nq) - 1);
  _mm_mask_storeu_ps(step, lane, _mm_mul_ps(tops, _mm_set1_ps(1.0f / qmax)));
  _mm_mask_storeu_ps(bias, lane, kvserve::simd::reduce4<false>(b, nq));
  _mm_storeu_ps(inv, _mm_maskz_div_ps(_mm_cmp_ps_mask(tops, _mm_setzero_ps(), _CMP_GT_OQ), _mm_set1_ps(qmax), tops));
}

inline float* scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[2];
  std::vector<float>& buf = bufs[slot];
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// NQ queries (lane order, (NQ, hd) floats at qp + t * q_token_stride) against
// the first n tokens of the source.
template <int NQ, class Src>
void score_queries(const Src& src, const float* qp, size_t q_token_stride, int n, float scale, float* scores,
                   int stride) {
  constexpr int kVecs = Src::Order::kVecs;
  const int hd = src.head_dim, chunks = hd / Src::Order::kCodes;
  __m512 part[NQ][16];
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int nt = std::min(16, n - t0);
    for (int tt = 0; tt < 16; ++tt) {
      if (tt >= nt) {
        #pragma GCC unroll 16
        for (int i = 0; i < NQ; ++i) part[i][tt] = _mm512_setzero_ps();
        continue;
      }
      const int t = t0 + tt;
      const auto tok = src.token(t);
      const float* qt = qp + size_t(t) * q_token_stride;
      __m512 acc[NQ];
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) acc[i] = _mm512_setzero_ps();
      for (int c = 0; c < chunks; ++c) {
        __m512 x[kVecs];
        tok.chunk(c, x);
        #pragma GCC unroll 16
        for (int k = 0; k < kVecs; ++k)
          #pragma GCC unroll 16
          for (int i = 0; i < NQ; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qt + i * hd + (c * kVecs + k) * 16), x[k], acc[i]);
      }
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) part[i][tt] = acc[i];
    }
    const __mmask16 mask = __mmask16((1u << nt) - 1);
    const __m512 s = _mm512_set1_ps(scale);
    #pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i)
      _mm512_mask_storeu_ps(scores + i * stride + t0, mask, _mm512_mul_ps(s, hsum16(part[i])));
  }
}

// How many queries the next pass takes: passes of 3 or 4 keep the
// accumulators in registers.
inline int pass_size(int left) { return left <= 4 ? left : (left == 6 ? 3 : 4); }

// q: (n_q, head_dim) floats, or (n, n_q, head_dim) with per_token_q.
template <class Src>
void score(const Src& src, const float* q, int n_q, bool per_token_q, int n, float scale, float* scores,
           int stride) {
  using Order = typename Src::Order;
  const int hd = src.head_dim;
  src.prefetch(n);
  const size_t sets = size_t(per_token_q ? n : 1) * size_t(n_q);
  float* qp = scratch(0, sets * hd);
  for (size_t s = 0; s < sets; ++s)
    for (int c = 0; c < hd; c += Order::kCodes) Order::to_lanes(q + s * hd + c, qp + s * hd + c);
  const size_t q_token_stride = per_token_q ? size_t(n_q) * hd : 0;
  for (int i = 0; i < n_q;) {
    const int m = pass_size(n_q - i);
    const float* qi = qp + size_t(i) * hd;
    float* si = scores + size_t(i) * stride;
    switch (m) {
      case 1: score_queries<1>(src, qi, q_token_stride, n, scale, si, stride); break;
      case 2: score_queries<2>(src, qi, q_token_stride, n, scale, si, stride); break;
      case 3: score_queries<3>(src, qi, q_token_stride, n, scale, si, stride); break;
      default: score_queries<4>(src, qi, q_token_stride, n, scale, si, stride); break;
    }
    i += m;
  }
}

// out[i][d] += sum_t w[i][t] x_t[d] over the NV vectors of the head slice
// starting at vector v0 (whole chunks), NQ queries.
template <int NQ, int NV, class Src>
void accumulate_slice(const Src& src, const float* weights, int stride, int n, int v0, float* out) {
  using Order = typename Src::Order;
  constexpr int kVecs = Order::kVecs;
  static_assert(NV % kVecs == 0);
  const int hd = src.head_dim, c0 = v0 / kVecs;
  __m512 acc[NQ][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const auto tok = src.token(t);
    #pragma GCC unroll 16
    for (int c = 0; c < NV / kVecs; ++c) {
      __m512 x[kVecs];
      tok.chunk(c0 + c, x);
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) {
        const __m512 w = _mm512_set1_ps(weights[i * stride + t]);
        #pragma GCC unroll 16
        for (int k = 0; k < kVecs; ++k) acc[i][c * kVecs + k] = _mm512_fmadd_ps(w, x[k], acc[i][c * kVecs + k]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 16
    for (int c = 0; c < NV / kVecs; ++c) {
      __m512 nat[kVecs];
      Order::from_lanes(&acc[i][c * kVecs], nat);
      #pragma GCC unroll 16
      for (int k = 0; k < kVecs; ++k) {
        float* o = out + i * hd + v0 * 16 + (c * kVecs + k) * 16;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), nat[k]));
      }
    }
}

template <int NQ, class Src>
void accumulate_queries(const Src& src, const float* weights, int stride, int n, float* out) {
  constexpr int kVecs = Src::Order::kVecs;
  const int nv = src.head_dim / 16;
  for (int v0 = 0; v0 < nv;) {
    const int left = nv - v0;
    if (left >= 4) {
      accumulate_slice<NQ, 4>(src, weights, stride, n, v0, out);
      v0 += 4;
    } else if constexpr (kVecs <= 2) {
      if (left >= 2) {
        accumulate_slice<NQ, 2>(src, weights, stride, n, v0, out);
        v0 += 2;
      } else if constexpr (kVecs == 1) {
        accumulate_slice<NQ, 1>(src, weights, stride, n, v0, out);
        v0 += 1;
      }
    }
  }
}

template <class Src>
void accumulate(const Src& src, const float* weights, int n_q, int stride, int n, float* out) {
  const int hd = src.head_dim;
  src.prefetch(n);
  for (int i = 0; i < n_q;) {
    const int m = pass_size(n_q - i);
    const float* wi = weights + size_t(i) * stride;
    float* oi = out + size_t(i) * hd;
    switch (m) {
      case 1: accumulate_queries<1>(src, wi, stride, n, oi); break;
      case 2: accumulate_queries<2>(src, wi, stride, n, oi); break;
      case 3: accumulate_queries<3>(src, wi, stride, n, oi); break;
      default: accumulate_queries<4>(src, wi, stride, n, oi); break;
    }
    i += m;
  }
}

}  // namespace simd
#endif  // __AVX512F__

// Score and accumulate for codecs whose tokens can be read one at a time.
// With AVX-512 and a head slice the vector kernels can walk (Derived::
// simd_ready()), Derived::with_source hands them a source that dequantizes in
// registers. Otherwise (and as the scalar reference beside them) the token's
// head slice is dequantized into a head_dim scratch that stays in L1, then
// dot/axpy run on it.
template <class Derived>
class SliceCodec : public KvCodec {
 public:
  using KvCodec::KvCodec;

  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
#if defined(__AVX512F__)
    if (self().simd_ready()) {
      self().with_source(block, kv_head, [&](const auto& src) { simd::score(src, q, n_q, false, n, scale, scores, stride); });
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
#if defined(__AVX512F__)
    if (self().simd_ready()) {
      self().with_source(block, kv_head, [&](const auto& src) { simd::accumulate(src, weights, n_q, stride, n, out); });
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
#if defined(__AVX512F__)
    if (self().simd_ready()) {
      self().with_source(block, kv_head, [&](const auto& src) { simd::score(src, q, n_q, true, n, scale, scores, stride); });
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
  // A codec with a faster accumulate for some layouts hides this and returns
  // true where it ran.
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
        head_bytes_(size_t(s.block_size) * token_bytes_ / size_t(s.n_kv_heads)) {
#if defined(__AVX512F__)
    using Order = simd::Lanes<B>;
    const int hd = s.head_dim;
    // Groups inside a head are looked up per lane from one vector of (at most
    // 16) group scales; finer groups take the scalar path.
    simd_ = hd % Order::kCodes == 0 && (group_ >= hd || hd / group_ <= 16);
#if defined(__AVX512BW__)
    pairs_ready_ = head_major_ && group_ == hd && B >= 4 && hd % kUnitChannels == 0;
#endif
    if (simd_ && group_ < hd)
      for (int p = 0; p < hd; ++p) {  // lane-order position p -> element of the head slice
        const int c = p / Order::kCodes, k = p % Order::kCodes / 16, j = p % 16;
        lane_group_.push_back((c * Order::kCodes + j * Order::kVecs + k) / group_);
      }
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
    pairs_ready_ = head_major_ && group_ == s.head_dim && B >= 4 && s.head_dim % 16 == 0;
#endif
  }

  size_t block_bytes() const override { return size_t(shape_.block_size) * token_bytes_; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    if (head_major_)
      for (int h = 0; h < shape_.n_kv_heads; ++h) std::memset(code_row(block, slot, h), 0, head_code_bytes_);
    else
      std::memset(code_row(block, slot, 0), 0, code_bytes_);
    for (int g = 0; g * group_ < shape_.kv_dim(); ++g) {
      const float* xg = x + g * group_;
      const auto [lo, hi] = std::minmax_element(xg, xg + group_);
      const Affine a = fit_affine<B>(*lo, *hi);
      fp16_t* meta = pair(block, slot, g);
      meta[0] = a.scale16;
      meta[1] = a.min16;
      const float inv = inverse(a.scale);
      for (int d = 0; d < group_; ++d) {
        const int e = g * group_ + d;
        set_code<B>(code_row(block, slot, e / shape_.head_dim), index(e), quantize<B>(xg[d], a.min, inv));
      }
    }
  }

  int token_spans(int slot, int kv_head, ByteSpan* out) const override {
    if (!head_major_) return 0;
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
        const fp16_t* meta = pair(block, slot, first / group_ + g);
        const float scale = fp16_to_fp32(meta[0]), min = fp16_to_fp32(meta[1]);
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
      const fp16_t* meta = pair(block, slot, e / group_);
      out[d] = fp16_to_fp32(meta[1]) + fp16_to_fp32(meta[0]) * float(get_code<B>(row, index(e)));
    }
  }

#if defined(__AVX512F__)
  bool simd_ready() const { return simd_; }
#endif

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
    if (!pairs_ready_ || n <= 0) return false;
    const int hd = shape_.head_dim, n2 = (n + 1) / 2 * 2;  // tokens, padded to whole pairs
    const uint8_t* codes = head_codes(block, kv_head);
    const uint8_t* meta = codes + size_t(shape_.block_size) * head_code_bytes_;
#if defined(__AVX512BW__)
    simd::prefetch_rows(codes, head_bytes_, 1, head_bytes_);
    const float qmax = folded_qmax<B>(n2);
    const int ns = (n2 + 15) / 16 * 16;  // floats of u per query
    thread_local std::vector<float> fbuf;
    thread_local std::vector<int32_t> ubuf;
    if (fbuf.size() < size_t(n_q) * (ns + 2)) fbuf.resize(size_t(n_q) * (ns + 2));
    if (ubuf.size() < size_t(n_q) * n2 / 2) ubuf.resize(size_t(n_q) * n2 / 2);
    float *u = fbuf.data(), *step = u + size_t(n_q) * ns, *bias = step + n_q;
    int16_t* u16 = reinterpret_cast<int16_t*>(ubuf.data());  // (n_q, n2)
    by_query_groups(n_q, [&](auto nq, int i) {
      fold_weights<nq.value>(weights + size_t(i) * stride, stride, meta, n, n2, ns, qmax, u, step + i, bias + i,
                             u16 + size_t(i) * n2);
      accumulate_pairs<nq.value>(codes, ubuf.data() + size_t(i) * n2 / 2, n2 / 2, n, step + i, bias + i,
                                 out + size_t(i) * hd);
    });
#else
    const float qmax = folded_qmax<B>(n2);
    thread_local std::vector<float> fbuf;
    thread_local std::vector<int32_t> ubuf;
    if (fbuf.size() < size_t(2 * n2 + 2 * n_q)) fbuf.resize(size_t(2 * n2 + 2 * n_q));
    if (ubuf.size() < size_t(n_q) * n2 / 2) ubuf.resize(size_t(n_q) * n2 / 2);
    float *sc = fbuf.data(), *mn = sc + n2, *step = mn + n2, *bias = step + n_q;
    int16_t* u16 = reinterpret_cast<int16_t*>(ubuf.data());  // (n_q, n2)
    for (int t = 0; t < n2; ++t) {  // the tokens' (scale, min); a padding token weighs nothing
      const fp16_t* m = reinterpret_cast<const fp16_t*>(meta + size_t(t) * 4);
      sc[t] = t < n ? fp16_to_fp32(m[0]) : 0.0f;
      mn[t] = t < n ? fp16_to_fp32(m[1]) : 0.0f;
    }
    for (int i = 0; i < n_q; ++i) {
      const float* w = weights + size_t(i) * stride;
      float top = 0, b = 0;
      for (int t = 0; t < n; ++t) top = std::max(top, w[t] * sc[t]), b += w[t] * mn[t];
      step[i] = top / qmax;
      bias[i] = b;
      const float inv = top > 0 ? qmax / top : 0.0f;
      for (int t = 0; t < n2; ++t) u16[size_t(i) * n2 + t] = int16_t(t < n ? std::lrint(w[t] * sc[t] * inv) : 0);
    }
    for (int unit = 0; unit < hd; unit += 16)
      by_query_groups(n_q, [&](auto nq, int i) {
        accumulate_pairs8<nq.value>(codes, ubuf.data() + size_t(i) * n2 / 2, n2 / 2, n, unit, step + i, bias + i,
                                    out + size_t(i) * hd);
      });
#endif
    return true;
  }
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
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
    for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < n; t += 2) {
      const __m256i a = words16(codes, t, c0), b = t + 1 < n ? words16(codes, t + 1, c0) : _mm256_setzero_si256();
      // Lane 4L + j of unpacklo holds word 8L + j, of unpackhi word 8L + 4 + j.
      const __m256i p0 = _mm256_unpacklo_epi16(a, b), p1 = _mm256_unpackhi_epi16(a, b);
      for (int i = 0; i < NQ; ++i) {
        const __m256i ut = _mm256_set1_epi32(u[size_t(i) * upairs + t / 2]);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ut));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ut));
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int h = 0; h < 2; ++h) {  // channels c0 + 8h .. c0 + 8h + 7
        const __m256i v = _mm256_permute2x128_si256(acc[i][0], acc[i][1], h == 0 ? 0x20 : 0x31);
        float* o = out + size_t(i) * shape_.head_dim + c0 + 8 * h;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_fmadd_ps(_mm256_cvtepi32_ps(v),
                                                                                _mm256_set1_ps(step[i]),
                                                                                _mm256_set1_ps(bias[i]))));
      }
  }
#endif

#if defined(__AVX512F__)
  // One (scale, min) for the whole head slice (groups of head_dim or more).
  struct HeadSource {
    using Order = simd::Lanes<B>;
    const uint8_t* block;
    size_t code_off, code_stride, meta_off, meta_stride;  // in bytes
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
      simd::prefetch_rows(block + meta_off, meta_stride, n, 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      fp16_t sm[2];
      std::memcpy(sm, block + meta_off + size_t(t) * meta_stride, sizeof sm);
      return {block + code_off + size_t(t) * code_stride, _mm512_set1_ps(fp16_to_fp32(sm[0])),
              _mm512_set1_ps(fp16_to_fp32(sm[1]))};
    }
  };
  // Up to 16 groups inside the head slice: per-lane scale and min.
  struct GroupSource {
    using Order = simd::Lanes<B>;
    const uint8_t* block;
    size_t code_off, code_stride, meta_off, meta_stride;  // in bytes
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
      simd::prefetch_rows(block + meta_off, meta_stride, n, groups * 2 * sizeof(fp16_t));
    }
    Cursor token(int t) const {
      Cursor cur{block + code_off + size_t(t) * code_stride, {}, {}, lane_group};
      simd::split_pairs(_mm512_maskz_loadu_epi32(group_mask, block + meta_off + size_t(t) * meta_stride), cur.scale,
                        cur.min);
      return cur;
    }
  };
  template <class F>
  void with_source(const uint8_t* block, int kv_head, F&& f) const {
    const int hd = shape_.head_dim;
    const size_t code_off = head_major_ ? size_t(code_row(block, 0, kv_head) - block) : size_t(kv_head * hd) * B / 8;
    const size_t meta_off = size_t(reinterpret_cast<const uint8_t*>(pair(block, 0, kv_head * hd / group_)) - block);
    const size_t code_stride = head_major_ ? head_code_bytes_ : token_bytes_;
    const size_t meta_stride = head_major_ ? size_t(head_groups_) * 2 * sizeof(fp16_t) : token_bytes_;
    if (group_ >= hd) {
      f(HeadSource{block, code_off, code_stride, meta_off, meta_stride, hd});
    } else {
      const __mmask16 mask = __mmask16((1u << (hd / group_)) - 1);
      f(GroupSource{block, code_off, code_stride, meta_off, meta_stride, hd, mask, lane_group_.data()});
    }
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
  // Head-major: the first byte of KV head kv_head's codes (its pairs follow them).
  const uint8_t* head_codes(const uint8_t* block, int kv_head) const { return block + size_t(kv_head) * head_bytes_; }
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
  bool simd_ = false;
  bool pairs_ready_ = false;         // integer_accumulate applies
  std::vector<int32_t> lane_group_;  // (head_dim) when groups are finer than a head

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
  // NQ queries' weights (NQ, stride) folded with the tokens' scales: u16 (NQ,
  // n2) = round(w_t scale_t / step) (zero past n), step = max_t w_t scale_t /
  // qmax, bias = sum_t w_t min_t. meta: the head's (scale, min) per token.
  // u: scratch of (NQ, ns) floats.
  template <int NQ>
  static void fold_weights(const float* w, int stride, const uint8_t* meta, int n, int n2, int ns, float qmax,
                           float* u, float* step, float* bias, int16_t* u16) {
    __m512 top[NQ], b[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) top[i] = b[i] = _mm512_setzero_ps();
    for (int t = 0; t < n2; t += 16) {
      const __mmask16 m = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(0, n - t)) - 1);
      __m512 sc, mn;
      simd::split_pairs(_mm512_maskz_loadu_epi32(m, meta + size_t(t) * 4), sc, mn);
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
    simd::fold_steps(top, b, NQ, qmax, step, bias, invs);
    for (int t = 0; t < n2; t += 16) {
      const __mmask16 m = n2 - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n2 - t)) - 1);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 ut = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, u + size_t(i) * ns + t), _mm512_set1_ps(invs[i]));
        _mm256_mask_storeu_epi16(u16 + size_t(i) * n2 + t, m, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(ut)));
      }
    }
  }
  // First channel of natural vector m (0, 1) of word vector w.
  static int first_channel(int w, int m) { return B == 8 ? 16 * m : 16 * w + 32 * m; }

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
// the codes meet it as 16-bit integers in pairwise dot products (no float
// dequantization, no per-token horizontal sums). Static scales and pre-RoPE
// keys (a query per token) keep token rows (block_size, head_dim).
template <int B>
class ChannelCodec final : public KvCodec {
 public:
  ChannelCodec(const KvCodecConfig& c, const KvBlockShape& s)
      : KvCodec(c, s),
        static_(c.is_static()),
        group_(static_ ? s.block_size : c.group_size),
        code_bytes_(size_t(s.kv_dim()) * B / 8),
        head_major_(s.head_dim * B % 8 == 0),
        channel_major_(head_major_ && !static_ && !c.pre_rope),
        head_code_bytes_(size_t(s.head_dim) * B / 8),
        head_bytes_(size_t(s.block_size) * head_code_bytes_ +
                    (static_ ? 0 : size_t(s.block_size / group_) * size_t(s.head_dim) * 2 * sizeof(fp16_t))) {
    if (static_) {
      for (int d = 0; d < s.kv_dim(); ++d) {
        const Affine a = fit_affine<B>(c.static_min[size_t(d)], std::max(c.static_max[size_t(d)], c.static_min[size_t(d)]));
        static_scale_.push_back(a.scale);
        static_min_.push_back(a.min);
        static_max_.push_back(std::max(c.static_max[size_t(d)], a.min));
      }
    }
#if defined(__AVX512F__)
    using Order = simd::Lanes<B>;
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
  }

  size_t block_bytes() const override {
    const size_t meta = static_ ? 0 : size_t(shape_.block_size / group_) * size_t(shape_.kv_dim()) * 2 * sizeof(fp16_t);
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
    const int kv_dim = shape_.kv_dim();
    std::memset(block, 0, block_bytes());
    for (int tg = 0; tg * group_ < n; ++tg) {
      const int t0 = tg * group_, t1 = std::min(n, t0 + group_);
      for (int d = 0; d < kv_dim; ++d) {
        float lo = x[size_t(t0) * kv_dim + d], hi = lo;
        for (int t = t0 + 1; t < t1; ++t) {
          lo = std::min(lo, x[size_t(t) * kv_dim + d]);
          hi = std::max(hi, x[size_t(t) * kv_dim + d]);
        }
        const Affine a = fit_affine<B>(lo, hi);
        fp16_t* meta = pair(block, tg, d);
        meta[0] = a.scale16;
        meta[1] = a.min16;
        const float inv = inverse(a.scale);
        for (int t = t0; t < t1; ++t)
          put(block, t, d, quantize<B>(x[size_t(t) * kv_dim + d], a.min, inv));
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (channel_major_simd_) {
      score_channel_major(q, n_q, block, n, kv_head, scale, scores, stride);
      return;
    }
#endif
#if defined(__AVX512F__)
    if (simd_ && !channel_major_) {
      simd::score(source(block, n, kv_head), q, n_q, false, n, scale, scores, stride);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd;
    if (channel_major_) {
      score_channels(q, n_q, block, n, kv_head, scale, scores, stride);
      return;
    }
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
  void score_channels(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                      float* scores, int stride) const {
#if defined(__AVX2__) && defined(__FMA__)
    if (shape_.head_dim % 8 == 0) {
      score_channel_pairs(q, n_q, block, n, kv_head, scale, scores, stride);
      return;
    }
#endif
    const int hd = shape_.head_dim, first = kv_head * hd, bs = shape_.block_size;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    float* s = scratch(2 * size_t(hd) + size_t(group_));
    float *sc = s, *mn = s + hd, *acc = s + 2 * hd;
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, first, hd, sc, mn);
      const int t0 = tg * group_, nt = std::min(n, t0 + group_) - t0;
      for (int i = 0; i < n_q; ++i) {
        const float* qi = q + size_t(i) * hd;
        std::fill(acc, acc + nt, dot(qi, mn, hd));
        for (int c = 0; c < hd; ++c) {
          const uint8_t* row = head + size_t(c / (8 / B)) * bs + t0;
          const int shift = (c % (8 / B)) * B;
          const float qc = qi[c] * sc[c];
          int t = 0;
#if defined(__AVX2__) && defined(__FMA__)
          const __m256 qv = _mm256_set1_ps(qc);
          const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
          for (; t + 8 <= nt; t += 8) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + t));
            const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes), shift), mask);
            _mm256_storeu_ps(acc + t, _mm256_fmadd_ps(qv, _mm256_cvtepi32_ps(codes), _mm256_loadu_ps(acc + t)));
          }
#endif
          for (; t < nt; ++t) acc[t] += qc * float((row[t] >> shift) & ((1 << B) - 1));
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
  template <int NQ>
  static void score_tile8(const uint8_t* head, int bs, int pairs, int t0, int nt, const int32_t* q16,
                          const float* step, const float* bias, float scale, float* scores, int stride) {
    __m256i acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_si256();
    auto add = [&](__m256i x, int p) {
      for (int i = 0; i < NQ; ++i)
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(x, _mm256_set1_epi32(q16[i * pairs + p])));
    };
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
    for (int i = 0; i < NQ; ++i) {
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]),
                                                                               _mm256_set1_ps(step[i]),
                                                                               _mm256_set1_ps(bias[i]))));
      std::memcpy(scores + size_t(i) * stride + t0, out, sizeof(float) * size_t(nt));
    }
  }
  void score_channel_pairs(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                           float* scores, int stride) const {
    const int hd = shape_.head_dim, bs = shape_.block_size, pairs = hd / 2;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    const float qmax = folded_qmax<B>(hd);
    const FoldScratch f = fold_scratch(hd, n_q);
    float *sc = f.sc, *mn = f.mn, *step = f.step, *bias = f.bias;
    int16_t* q16 = f.q16;
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int tg = 0; tg * group_ < n; ++tg) {
      load_affine(block, tg, kv_head * hd, hd, sc, mn);
      for (int i = 0; i < n_q; ++i) {  // fold: q16 = round(q_c scale_c / step)
        const float* qi = q + size_t(i) * hd;
        __m256 top = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
          const __m256 x = _mm256_loadu_ps(qi + d);
          top = _mm256_max_ps(top, _mm256_and_ps(sign, _mm256_mul_ps(x, _mm256_loadu_ps(sc + d))));
          b = _mm256_fmadd_ps(x, _mm256_loadu_ps(mn + d), b);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        bias[i] = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        step[i] = mx / qmax;
        const __m256 inv = _mm256_set1_ps(mx > 0 ? qmax / mx : 0.0f);
        for (int d = 0; d < hd; d += 8) {
          const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(sc + d)), inv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q16 + size_t(i) * hd + d),
                           _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
        }
      }
      const int t1 = std::min(n, (tg + 1) * group_);
      for (int t0 = tg * group_; t0 < t1; t0 += 8) {
        const int nt = std::min(8, t1 - t0);
        by_query_groups(n_q, [&](auto nq, int i) {
          score_tile8<nq.value>(head, bs, pairs, t0, nt, f.pairs + size_t(i) * pairs, step + i, bias + i, scale,
                                scores + size_t(i) * stride, stride);
        });
      }
    }
  }
#endif

  // Pre-RoPE keys: a query per token, so the scaled query is per token too.
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
#if defined(__AVX512F__)
    if (simd_ && !channel_major_) {
      simd::score(source(block, n, kv_head), q, n_q, true, n, scale, scores, stride);
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

  // out_d += scale_d * sum_t w_t code_td + min_d * sum_t w_t, per token group.
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (channel_major_simd_) {
      accumulate_channel_major(weights, n_q, stride, block, n, kv_head, out);
      return;
    }
#endif
#if defined(__AVX512F__)
    if (simd_ && !channel_major_) {
      simd::accumulate(source(block, n, kv_head), weights, n_q, stride, n, out);
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
  static void load_pairs(const uint8_t* head, int bs, int p, int t0, __mmask16 m, __m512i* x) {
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
    const fp16_t* meta = pair(block, tg, kv_head * hd);
    for (int d = 0; d < hd; d += 16) {
      __m512 sc, mn;
      simd::split_pairs(_mm512_maskz_loadu_epi32(lanes(hd - d), meta + 2 * d), sc, mn);
      _mm512_mask_storeu_ps(scale + d, lanes(hd - d), sc);
      _mm512_mask_storeu_ps(min + d, lanes(hd - d), mn);
    }
  }

  // NQ queries (NQ, hd) folded with the channel scales: q16 = round(q_c
  // scale_c / step), step = max_c |q_c scale_c| / qmax, and bias = sum_c q_c
  // min_c. The queries go side by side so that their reductions overlap.
  template <int NQ>
  static void fold_queries(const float* q, int hd, const float* sc, const float* mn, float qmax, float* step,
                           float* bias, int16_t* q16) {
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
    simd::fold_steps(amax, b, NQ, qmax, step, bias, invs);
    __m512 inv[NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) inv[i] = _mm512_set1_ps(invs[i]);
    for (int d = 0; d < hd; d += 16) {
      const __mmask16 m = lanes(hd - d);
      const __m512 s = _mm512_maskz_loadu_ps(m, sc + d);
      #pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + size_t(i) * hd + d), s);
        _mm256_mask_storeu_epi16(q16 + size_t(i) * hd + d, m,
                                 _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv[i]))));
      }
    }
  }

  // Scores of NQ queries against tokens [t0, t0 + 16) (lanes of m): q16 is
  // (NQ, head_dim) int16, read as (NQ, head_dim / 2) channel pairs;
  // score = scale * (step * dot + bias) per query.
  template <int NQ>
  static void score_tile(const uint8_t* head, int bs, int pairs, int t0, __mmask16 m, const int32_t* q16,
                         const float* step, const float* bias, float scale, float* scores, int stride) {
    // Two sums per query (even and odd pairs): the dot products' latency, not
    // their throughput, would bound a single chain.
    __m512i acc[2][NQ];
    #pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_si512();
    int p = 0;
    for (; p + 2 <= pairs; p += 2) {
      __m512i x[2];
      load_pairs(head, bs, p, t0, m, x);
      if constexpr (kPairsPerLoad == 1) load_pairs(head, bs, p + 1, t0, m, x + 1);
      #pragma GCC unroll 8
      for (int k = 0; k < 2; ++k)
        #pragma GCC unroll 8
        for (int i = 0; i < NQ; ++i) acc[k][i] = kvserve::simd::dot_pairs(acc[k][i], x[k], _mm512_set1_epi32(q16[i * pairs + p + k]));
    }
    if (p < pairs) {  // an odd pair count (B = 8 or 4)
      __m512i x[kPairsPerLoad];
      load_pairs(head, bs, p, t0, m, x);
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

  // q·k_t = sum_c (q_c scale_c) code_tc + sum_c q_c min_c. The folded query is
  // rounded to 16 bits with one step per (query, token group): at most
  // 32767 steps across its largest channel, fewer where int32 sums of
  // head_dim products could overflow.
  void score_channel_major(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                           float* scores, int stride) const {
    const int hd = shape_.head_dim, bs = shape_.block_size, pairs = hd / 2;
    const uint8_t* head = block + size_t(kv_head) * head_bytes_;
    simd::prefetch_rows(head, head_bytes_, 1, head_bytes_);
    const float qmax = folded_qmax<B>(hd);
    const FoldScratch f = fold_scratch(hd, n_q);
    float *sc = f.sc, *mn = f.mn, *step = f.step, *bias = f.bias;
    int16_t* q16 = f.q16;
    for (int tg = 0; tg * group_ < n; ++tg) {
      head_affine(block, tg, kv_head, sc, mn);
      by_query_groups(n_q, [&](auto nq, int i) {
        fold_queries<nq.value>(q + size_t(i) * hd, hd, sc, mn, qmax, step + i, bias + i, q16 + size_t(i) * hd);
      });
      const int t1 = std::min(n, (tg + 1) * group_);
      for (int t0 = tg * group_; t0 < t1; t0 += 16) {
        const __mmask16 m = lanes(t1 - t0);
        by_query_groups(n_q, [&](auto nq, int i) {
          score_tile<nq.value>(head, bs, pairs, t0, m, f.pairs + size_t(i) * pairs, step + i, bias + i, scale,
                               scores + size_t(i) * stride, stride);
        });
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
          load_pairs(head, bs, p, t0, m, x);
          for (int k = 0; k < kPairsPerLoad; ++k) {
            const int c = 2 * (p + k);
            _mm512_storeu_ps(codes + size_t(c) * 16, _mm512_cvtepi32_ps(_mm512_and_si512(x[k], _mm512_set1_epi32(0xFFFF))));
            _mm512_storeu_ps(codes + size_t(c + 1) * 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(x[k], 16)));
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
  // REQUIRES: simd_. Converts the head's metadata of the token groups that
  // hold the first n tokens once, for every token of the call.
  Source source(const uint8_t* block, int n, int kv_head) const {
    using Order = simd::Lanes<B>;
    const int hd = shape_.head_dim, first = kv_head * hd;
    const size_t code_off = head_major_ ? size_t(code_row(block, 0, kv_head) - block) : size_t(first) * B / 8;
    Source src{block, head_major_ ? head_code_bytes_ : code_bytes_, code_off, hd, group_, nullptr, nullptr};
    if (static_) {
      src.scale = static_scale_lanes_.data() + first;
      src.min = static_min_lanes_.data() + first;
      return src;
    }
    const int groups = (n + group_ - 1) / group_;
    float* buf = simd::scratch(1, (size_t(groups) * 2 + 2) * size_t(hd));
    float *sc = buf, *mn = buf + size_t(groups) * hd, *nat_s = mn + size_t(groups) * hd, *nat_m = nat_s + hd;
    for (int tg = 0; tg < groups; ++tg) {
      const fp16_t* meta = pair(block, tg, first);
      for (int d = 0; d < hd; d += 16) {
        __m512 s, m;
        simd::split_pairs(_mm512_loadu_si512(meta + 2 * d), s, m);
        _mm512_storeu_ps(nat_s + d, s);
        _mm512_storeu_ps(nat_m + d, m);
      }
      for (int d = 0; d < hd; d += Order::kCodes) {
        Order::to_lanes(nat_s + d, sc + size_t(tg) * hd + d);
        Order::to_lanes(nat_m + d, mn + size_t(tg) * hd + d);
      }
    }
    src.scale = sc;
    src.min = mn;
    return src;
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
    const int c = d % shape_.head_dim;
    return (*channel_byte(block, slot, d) >> ((c % (8 / B)) * B)) & ((1 << B) - 1);
  }
  void put(uint8_t* block, int slot, int d, int code) const {
    if (!channel_major_) return set_code<B>(code_row(block, slot, d / shape_.head_dim), index(d), code);
    const int shift = (d % shape_.head_dim % (8 / B)) * B;
    uint8_t& byte = *channel_byte(block, slot, d);
    byte = uint8_t((byte & ~(((1 << B) - 1) << shift)) | (code << shift));
  }
  // Channel-major: the byte holding row channel d of token slot.
  template <class P>
  P* channel_byte(P* block, int slot, int d) const {
    const int hd = shape_.head_dim;
    return block + size_t(d / hd) * head_bytes_ + size_t((d % hd) / (8 / B)) * size_t(shape_.block_size) + size_t(slot);
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
  // scale/min of channels [first, first + count) for token group tg.
  void load_affine(const uint8_t* block, int tg, int first, int count, float* scale, float* min) const {
    if (static_) {
      std::copy_n(static_scale_.begin() + first, count, scale);
      std::copy_n(static_min_.begin() + first, count, min);
      return;
    }
    for (int d = 0; d < count; ++d) {
      const fp16_t* meta = pair(block, tg, first + d);
      scale[d] = fp16_to_fp32(meta[0]);
      min[d] = fp16_to_fp32(meta[1]);
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
  int group_;          // tokens per (scale, min) group
  size_t code_bytes_;  // packed codes of one token row
  bool head_major_;
  bool channel_major_;  // head-major codes stored (channel byte, token)
  size_t head_code_bytes_;  // packed codes of one head of one token (head-major)
  size_t head_bytes_;       // codes + metadata of one head for the whole block (head-major)
  std::vector<float> static_scale_, static_min_, static_max_;  // (kv_dim) when static
  bool simd_ = false;
  bool channel_major_simd_ = false;  // channel_major_ with the integer kernels below
  std::vector<float> static_scale_lanes_, static_min_lanes_;  // (kv_dim) lane order, when static and simd_
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
        head_blocks_(s.head_dim / kBlock) {}

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

#if defined(__AVX512F__)
  bool simd_ready() const { return shape_.head_dim % kBlock == 0; }

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
#endif

 private:
  // q4_0 block b (of the row's kv_dim / 32) of token slot.
  template <class P>
  P* at(P* block, int slot, int b) const {
    if (!head_major_) return block + size_t(slot) * token_bytes_ + size_t(b) * kBlockBytes;
    const int h = b / head_blocks_;
    return block + ((size_t(h) * shape_.block_size + size_t(slot)) * head_blocks_ + size_t(b % head_blocks_)) * kBlockBytes;
  }

  size_t token_bytes_;
  bool head_major_;
  int head_blocks_;  // q4_0 blocks per head (head-major)
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
