#include "kv/float_codecs.h"

#include "kv/attention_simd.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "util/half.h"

namespace kvserve {
namespace {

// load16 / load8 give each value divided by kUnit (FP8Traits); sums are
// multiplied back where they leave the kernels. kNaNCodes: some codes load
// wrongly (as finite values) in the vector loads.
struct F32Traits {
  using T = float;
  static constexpr float kUnit = 1.0f;
  static constexpr bool kNaNCodes = false;
  static T from(float x) { return x; }
  static float to(T x) { return x; }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#elif defined(__AVX2__)
  static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
#endif
};

struct F16Traits {
  using T = fp16_t;
  static constexpr float kUnit = 1.0f;
  static constexpr bool kNaNCodes = false;
  static T from(float x) { return fp32_to_fp16(x); }
  static float to(T x) { return fp16_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  static __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
};

struct BF16Traits {
  using T = bf16_t;
  static constexpr float kUnit = 1.0f;
  static constexpr bool kNaNCodes = false;
  static T from(float x) { return fp32_to_bf16(x); }
  static float to(T x) { return bf16_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
#elif defined(__AVX2__)
  static __m256 load8(const T* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
};

// FP8 E4M3 (util/half.h). The vector loads give each value times 2^-8: the
// byte's bits moved into an FP16's (exact, subnormals included), three
// integer instructions and a conversion; the kernels multiply by kUnit where
// a sum leaves them (a power of two: the results are those of exact values,
// unless a product falls below FP32's normal range 2^8 times sooner, ~2^-118).
// They read the NaN codes (0x7F, 0xFF) as +-480 * 2^-8, so a head's slice
// that holds one takes the scalar loops (kNaNCodes, holds_fp8_nan).
struct FP8Traits {
  using T = fp8_t;
  static constexpr float kUnit = 256.0f;
  static constexpr bool kNaNCodes = true;
  static T from(float x) { return fp32_to_fp8(x); }
  static float to(T x) { return fp8_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    // Sign-extended, then shifted: the sign lands in bits 15 and 14; bit 14 is cleared.
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(int16_t(0xBFFF))));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  static __m256 load8(const T* p) {
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(int16_t(0xBFFF))));
  }
#endif
};

// FP8 E5M2 (util/half.h): each byte is an FP16's top byte, so the vector
// loads widen it into one and convert, exact for every code, infinities and
// NaNs included.
struct FP8E5M2Traits {
  using T = fp8_e5m2_t;
  static constexpr float kUnit = 1.0f;
  static constexpr bool kNaNCodes = false;
  static T from(float x) { return fp32_to_fp8_e5m2(x); }
  static float to(T x) { return fp8_e5m2_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  static __m256 load8(const T* p) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};

// Whether n FP8 codes hold a NaN (0x7F or 0xFF): 64 codes per compare.
bool holds_fp8_nan(const fp8_t* p, size_t n) {
  size_t i = 0;
#if defined(__AVX512BW__)
  __mmask64 nan = 0;
  for (; i + 64 <= n; i += 64)
    nan |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(_mm512_loadu_si512(p + i), _mm512_set1_epi8(char(0x80))),
                                  _mm512_set1_epi8(char(0xFF)));
  if (nan != 0) return true;
#elif defined(__AVX2__)
  __m256i nan = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32)
    nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)),
                                                                 _mm256_set1_epi8(char(0x80))),
                                                 _mm256_set1_epi8(char(0xFF))));
  if (_mm256_movemask_epi8(nan) != 0) return true;
#endif
  for (; i < n; ++i)
    if ((p[i] & 0x7F) == 0x7F) return true;
  return false;
}

// vector false: the scalar loop only (FP8 slices holding a NaN code).
template <class Tr>
float dot_row(const float* q, const typename Tr::T* k, int n, bool vector) {
  int d = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  if (vector && n >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), Tr::load16(k + d), acc);
    sum = Tr::kUnit * _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (vector && n >= 8) {  // AVX2 machines: 8 lanes
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Tr::load8(k + d), acc);
    sum = Tr::kUnit * simd::hsum8(acc);
  }
#endif
  for (; d < n; ++d) sum += q[d] * Tr::to(k[d]);
  return sum;
}

template <class Tr>
void axpy_row(float w, const typename Tr::T* v, float* out, int n, bool vector) {
  int d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w * Tr::kUnit);
  for (; vector && d + 16 <= n; d += 16)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(wv, Tr::load16(v + d), _mm512_loadu_ps(out + d)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256 wv = _mm256_set1_ps(w * Tr::kUnit);
  for (; vector && d + 8 <= n; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, Tr::load8(v + d), _mm256_loadu_ps(out + d)));
#endif
  for (; d < n; ++d) out[d] += w * Tr::to(v[d]);
}

#if defined(__AVX512F__)
// Scores of NQ queries against n keys, 16 keys at a time: dot(t, acc) adds
// key t's per-lane products to acc[NQ]; hsum16 reduces 16 keys at once.
template <int NQ, class Dot>
inline void score_tiles(int n, float scale, float* scores, int stride, Dot&& dot) {
  __m512 part[NQ][16];
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int nt = std::min(16, n - t0);
    for (int tt = 0; tt < 16; ++tt) {
      __m512 acc[NQ];
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) acc[i] = _mm512_setzero_ps();
      if (tt < nt) dot(t0 + tt, acc);
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) part[i][tt] = acc[i];
    }
    const __mmask16 mask = __mmask16((1u << nt) - 1);
    #pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i)
      _mm512_mask_storeu_ps(scores + i * stride + t0, mask, _mm512_mul_ps(_mm512_set1_ps(scale), simd::hsum16(part[i])));
  }
}

// NQ queries against n keys, each key read once. k: first key's head
// slice; keys row elements apart. q of token t at q + t * q_token_stride, (NQ, hd).
// kChunks: hd / 16 when known at compile time (0 otherwise): the loop over a
// key unrolls, and queries shared by every token (q_token_stride 0) stay in
// registers.
template <class Tr, int NQ, int kChunks = 0>
void score_simd(const float* q, size_t q_token_stride, const typename Tr::T* k, int row, int hd, int n,
                float scale, float* scores, int stride) {
  if constexpr (kChunks > 0) {
    if (q_token_stride == 0) {
      __m512 qv[NQ][kChunks];
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) qv[i][c] = _mm512_loadu_ps(q + i * 16 * kChunks + 16 * c);
      score_tiles<NQ>(n, scale, scores, stride, [&](int t, __m512* acc) {
        const typename Tr::T* kt = k + size_t(t) * row;
        #pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) {
          const __m512 x = Tr::load16(kt + 16 * c);
          #pragma GCC unroll 16
          for (int i = 0; i < NQ; ++i) acc[i] = _mm512_fmadd_ps(qv[i][c], x, acc[i]);
        }
      });
      return;
    }
  }
  score_tiles<NQ>(n, scale, scores, stride, [&](int t, __m512* acc) {
    const typename Tr::T* kt = k + size_t(t) * row;
    const float* qt = q + size_t(t) * q_token_stride;
    for (int d = 0; d < hd; d += 16) {
      const __m512 x = Tr::load16(kt + d);
      #pragma GCC unroll 16
      for (int i = 0; i < NQ; ++i) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qt + i * hd + d), x, acc[i]);
    }
  });
}

// out (NQ, hd) += weights (NQ, stride) x values, over NV vectors from dim d0;
// values row elements apart.
template <class Tr, int NQ, int NV>
void accumulate_simd(const float* weights, int stride, const typename Tr::T* v, int row, int hd, int n, int d0,
                     float* out) {
  __m512 acc[NQ][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const typename Tr::T* vt = v + size_t(t) * row + d0;
    __m512 x[NV];
    #pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) x[j] = Tr::load16(vt + 16 * j);
    #pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i * stride + t]);
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(w, x[j], acc[i][j]);
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      float* o = out + i * hd + d0 + 16 * j;
      if constexpr (Tr::kUnit != 1.0f)
        _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[i][j], _mm512_set1_ps(Tr::kUnit), _mm512_loadu_ps(o)));
      else
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i][j]));
    }
}

template <class Tr, int NQ>
void accumulate_dims(const float* weights, int stride, const typename Tr::T* v, int row, int hd, int n,
                     float* out) {
  int d0 = 0;
  for (; d0 + 64 <= hd; d0 += 64) accumulate_simd<Tr, NQ, 4>(weights, stride, v, row, hd, n, d0, out);
  if (d0 + 32 <= hd) accumulate_simd<Tr, NQ, 2>(weights, stride, v, row, hd, n, d0, out), d0 += 32;
  if (d0 + 16 <= hd) accumulate_simd<Tr, NQ, 1>(weights, stride, v, row, hd, n, d0, out);
}
#endif

// Head-major: the block is (kv_head, token, head_dim) values, so one kv_head's
// keys or values for the whole block are one contiguous run.
template <class Tr>
class FloatCodec final : public KvCodec {
  using T = typename Tr::T;

 public:
  FloatCodec(const KvCodecConfig& c, const KvBlockShape& s) : KvCodec(c, s) {}

  size_t block_bytes() const override { return size_t(shape_.block_size) * size_t(shape_.kv_dim()) * sizeof(T); }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    const int hd = shape_.head_dim;
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      T* dst = at(block, h, slot);
      for (int d = 0; d < hd; ++d) dst[d] = Tr::from(x[h * hd + d]);
    }
  }
  void decode_token(const uint8_t* block, int slot, float* out) const override {
    const int hd = shape_.head_dim;
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      const T* src = at(block, h, slot);
      for (int d = 0; d < hd; ++d) out[h * hd + d] = Tr::to(src[d]);
    }
  }
  int token_spans(int slot, int kv_head, ByteSpan* out) const override {
    out[0] = {offset(kv_head, slot) * sizeof(T), size_t(shape_.head_dim) * sizeof(T)};
    return 1;
  }
  bool stores_floats() const override { return true; }
  void decode_head(const uint8_t* block, int n, int kv_head, float* out) const override {
    const T* src = at(block, kv_head, 0);  // the head's n rows are one run
    const int count = n * shape_.head_dim;
    int i = 0;
#if defined(__AVX512F__)
    if (vector_loads(src, n))
      for (; i + 16 <= count; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(Tr::load16(src + i), _mm512_set1_ps(Tr::kUnit)));
#endif
    for (; i < count; ++i) out[i] = Tr::to(src[i]);
  }
  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    const int hd = shape_.head_dim;
    const bool vector = vector_loads(at(block, kv_head, 0), n);
#if defined(__AVX512F__)
    if (vector && hd % 16 == 0) {
      score_passes(q, 0, n_q, block, n, kv_head, scale, scores, stride);
      return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (vector && hd % 8 == 0) {  // AVX2: each key converted once for up to 3 queries, 4 keys reduced together
      const T* k = at(block, kv_head, 0);
      simd::by_query_passes<3>(n_q, [&](auto m, int i) {
        score_quads8<m>(q + size_t(i) * hd, k, n, scale * Tr::kUnit, scores + size_t(i) * stride, stride);
      });
      return;
    }
#endif
    for (int t = 0; t < n; ++t) {
      const T* k = at(block, kv_head, t);
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot_row<Tr>(q + i * hd, k, hd, vector);
    }
  }
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
    const int hd = shape_.head_dim;
    const bool vector = vector_loads(at(block, kv_head, 0), n);
#if defined(__AVX512F__)
    if (vector && hd % 16 == 0) {
      score_passes(q, size_t(n_q) * hd, n_q, block, n, kv_head, scale, scores, stride);
      return;
    }
#endif
    for (int t = 0; t < n; ++t) {
      const T* k = at(block, kv_head, t);
      for (int i = 0; i < n_q; ++i)
        scores[i * stride + t] = scale * dot_row<Tr>(q + (size_t(t) * n_q + i) * hd, k, hd, vector);
    }
  }
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    const int hd = shape_.head_dim;
    const bool vector = vector_loads(at(block, kv_head, 0), n);
#if defined(__AVX512F__)
    if (vector && hd % 16 == 0) {
      const T* v = at(block, kv_head, 0);
      simd::prefetch_rows(v, size_t(hd) * sizeof(T), n, size_t(hd) * sizeof(T));
      simd::by_query_passes(n_q, [&](auto m, int i) {
        accumulate_dims<Tr, m>(weights + size_t(i) * stride, stride, v, hd, hd, n, out + size_t(i) * hd);
      });
      return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (vector && hd % 32 == 0) {  // AVX2: up to 3 queries' sums of 32 channels stay in registers across the tokens
      const T* v = at(block, kv_head, 0);
      simd::by_query_passes<3>(n_q, [&](auto m, int i) {
        accumulate_dims8<m>(weights + size_t(i) * stride, stride, v, n, out + size_t(i) * hd);
      });
      return;
    }
#endif
    for (int t = 0; t < n; ++t) {
      const T* v = at(block, kv_head, t);
      for (int i = 0; i < n_q; ++i) axpy_row<Tr>(weights[i * stride + t], v, out + i * hd, hd, vector);
    }
  }

 private:
  // Whether the vector loads read the head's first n rows (from p) right.
  bool vector_loads(const T* p, int n) const {
    if constexpr (Tr::kNaNCodes) return !holds_fp8_nan(p, size_t(n) * size_t(shape_.head_dim));
    return true;
  }
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // NQ queries (NQ, hd) against keys k (n, hd), four keys at a time: their
  // per-lane sums reduce together (three horizontal adds for four scores,
  // instead of a full reduction per score).
  template <int NQ>
  void score_quads8(const float* q, const T* k, int n, float scale, float* scores, int stride) const {
    const int hd = shape_.head_dim;
    for (int t = 0; t < n; t += 4) {
      const int nt = std::min(4, n - t);
      __m256 acc[NQ][4];
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[i][u] = _mm256_setzero_ps();
      #pragma GCC unroll 8
      for (int d = 0; d < hd; d += 8)
        #pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const __m256 x = Tr::load8(k + size_t(t + std::min(u, nt - 1)) * hd + d);  // past n: a repeat, not stored
          #pragma GCC unroll 4
          for (int i = 0; i < NQ; ++i) acc[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + size_t(i) * hd + d), x, acc[i][u]);
        }
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
        const __m128 sums = _mm_mul_ps(_mm_set1_ps(scale), _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        alignas(16) float four[4];
        _mm_store_ps(four, sums);
        std::copy(four, four + nt, scores + size_t(i) * stride + t);
      }
    }
  }
  // NQ queries' weights (NQ, stride) times values v (n, hd) into out (NQ, hd).
  template <int NQ>
  void accumulate_dims8(const float* w, int stride, const T* v, int n, float* out) const {
    const int hd = shape_.head_dim;
    for (int d0 = 0; d0 < hd; d0 += 32) {
      __m256 acc[NQ][4];
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) acc[i][e] = _mm256_loadu_ps(out + size_t(i) * hd + d0 + 8 * e);
      for (int t = 0; t < n; ++t) {
        __m256 wt[NQ];
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          wt[i] = _mm256_broadcast_ss(w + size_t(i) * stride + t);
          if constexpr (Tr::kUnit != 1.0f) wt[i] = _mm256_mul_ps(wt[i], _mm256_set1_ps(Tr::kUnit));
        }
        #pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          const __m256 x = Tr::load8(v + size_t(t) * hd + d0 + 8 * e);
          #pragma GCC unroll 4
          for (int i = 0; i < NQ; ++i) acc[i][e] = _mm256_fmadd_ps(wt[i], x, acc[i][e]);
        }
      }
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        #pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) _mm256_storeu_ps(out + size_t(i) * hd + d0 + 8 * e, acc[i][e]);
    }
  }
#endif
#if defined(__AVX512F__)
  void score_passes(const float* q, size_t q_token_stride, int n_q, const uint8_t* block, int n, int kv_head,
                    float scale, float* scores, int stride) const {
    const int hd = shape_.head_dim;
    const T* k = at(block, kv_head, 0);
    simd::prefetch_rows(k, size_t(hd) * sizeof(T), n, size_t(hd) * sizeof(T));
    simd::by_query_passes(n_q, [&](auto m, int i) {
      score_head<m>(q + size_t(i) * hd, q_token_stride, k, n, scale * Tr::kUnit, scores + size_t(i) * stride, stride);
    });
  }
  // score_simd with the common head sizes (64, 128) known at compile time.
  template <int NQ>
  void score_head(const float* q, size_t q_token_stride, const T* k, int n, float scale, float* scores,
                  int stride) const {
    const int hd = shape_.head_dim;
    if (hd == 64) return score_simd<Tr, NQ, 4>(q, q_token_stride, k, hd, hd, n, scale, scores, stride);
    if (hd == 128) return score_simd<Tr, NQ, 8>(q, q_token_stride, k, hd, hd, n, scale, scores, stride);
    score_simd<Tr, NQ>(q, q_token_stride, k, hd, hd, n, scale, scores, stride);
  }
#endif
  // The head_dim values of kv_head for token slot.
  size_t offset(int kv_head, int slot) const {
    return (size_t(kv_head) * size_t(shape_.block_size) + size_t(slot)) * size_t(shape_.head_dim);
  }
  T* at(uint8_t* block, int kv_head, int slot) const { return reinterpret_cast<T*>(block) + offset(kv_head, slot); }
  const T* at(const uint8_t* block, int kv_head, int slot) const {
    return reinterpret_cast<const T*>(block) + offset(kv_head, slot);
  }
};

}  // namespace

std::unique_ptr<KvCodec> make_float_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  switch (config.dtype) {
    case KvDType::F16: return std::make_unique<FloatCodec<F16Traits>>(config, shape);
    case KvDType::BF16: return std::make_unique<FloatCodec<BF16Traits>>(config, shape);
    case KvDType::FP8: return std::make_unique<FloatCodec<FP8Traits>>(config, shape);
    case KvDType::FP8_E5M2: return std::make_unique<FloatCodec<FP8E5M2Traits>>(config, shape);
    default: return std::make_unique<FloatCodec<F32Traits>>(config, shape);
  }
}

}  // namespace kvserve
