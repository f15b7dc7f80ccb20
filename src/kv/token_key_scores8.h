// Internal to TokenGroupCodec and Q4_0Codec (int_codecs.cpp): AVX2 scores of
// token-grouped integer keys and q4_0 keys against queries rounded to
// integers, with no key dequantized.
//
// Why: the float source kernel (source_kernels8.h) turns every code into a
// float, applies its token's scale and min, and only then meets the query:
// a 4K layer of plain `--kv-dtype int4` took 1.36x FP16's time in cache
// (BENCHMARKS.md, "Token-grouped keys as integer dot products"). With the
// key's affine form factored out,
//   q . k_t = sum_g scale_tg (q_g . code_tg) + sum_g min_tg sum(q_g),
// the products q_g . code_tg are integer dot products: vpmaddubsw for 4- and
// 2-bit codes against the query rounded to 8 bits (as the 8-bit query kernel
// of channel-grouped keys), vpmaddwd for 8-bit codes against 16 bits, so
// that INT8 keys keep their precision.
//
// A token's head slice is read in units (KeyLanes<B>::kCodes codes) that
// give two integer vectors; the query is rounded and put in the same order
// once per call (order_query). After the products, int32 lane i of a unit
// holds the sum over a fixed set of the unit's codes (lane_first,
// kLaneSpan): with one
// (scale, min) per head the lanes of four tokens reduce together in
// integers; groups finer than a head scale each lane by its group's scale.
#pragma once

#include "util/simd.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv/attention_simd.h"
#include "kv/source_kernels8.h"

namespace kvserve::int_codec::simd8 {

// 8 int32 (each within [-127, 127]) x 4 -> 32 int8 in order a, b, c, d.
inline __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);  // 128-bit lanes interleave
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// 8 int32 (within int16) x 2 -> 16 int16 in order a, b.
inline __m256i pack_words(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

inline __m256i load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The even and odd elements of 16 K floats, scaled by inv and rounded: K
// vectors of 8 each.
template <int K>
inline void rounded_even_odd(const float* q, __m256 inv, __m256i* even, __m256i* odd) {
  #pragma GCC unroll 4
  for (int k = 0; k < K; ++k) {
    __m256 e, o;
    split_even_odd(_mm256_loadu_ps(q + 16 * k), _mm256_loadu_ps(q + 16 * k + 8), e, o);
    even[k] = _mm256_cvtps_epi32(_mm256_mul_ps(e, inv));
    odd[k] = _mm256_cvtps_epi32(_mm256_mul_ps(o, inv));
  }
}

// How a unit of a token's codes becomes integer lanes, and the query's order.
template <int B>
struct KeyLanes;

// 64 codes in 32 bytes. x[0]: low nibbles (byte b: code 2b), x[1]: high
// nibbles (2b + 1). vpmaddubsw against the query bytes in the same order,
// then the two added: int16 lane w holds codes 4w .. 4w + 3; vpmaddwd with
// ones: int32 lane i codes 8i .. 8i + 7.
template <>
struct KeyLanes<4> {
  static constexpr int kCodes = 64, kBytes = 32, kSteps = 127, kMaxCode = 15;
  static void unpack(const uint8_t* p, __m256i* x) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nib = _mm256_set1_epi8(0x0F);
    x[0] = _mm256_and_si256(b, nib);
    x[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
  }
  // First code and count of the unit's codes int32 lane i sums (every other
  // one from the first for 2-bit codes).
  static int lane_first(int i) { return 8 * i; }
  static constexpr int kLaneSpan = 8;
  static void order_query(const float* q, __m256 inv, __m256i* out) {
    __m256i e[4], o[4];
    rounded_even_odd<4>(q, inv, e, o);
    out[0] = pack_bytes(e[0], e[1], e[2], e[3]);
    out[1] = pack_bytes(o[0], o[1], o[2], o[3]);
  }
  static __m256i dot(const __m256i* x, const int32_t* q) {
#if defined(__AVXVNNI__)
    // vpdpbusd sums each lane's four products into 32 bits: the same lanes.
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), x[0], load(q)), x[1], load(q + 8));
#else
    // 16-bit lanes hold at most 4 x 15 x 127 = 7620: no saturation.
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(x[0], load(q)), _mm256_maddubs_epi16(x[1], load(q + 8)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
  }
};

// 64 codes in 16 bytes (byte b: codes 4b .. 4b + 3). The 16 bytes fill both
// halves of a vector, the upper one shifted right by 2; AND 3 gives x[0]
// (half 0 byte b: code 4b, half 1: 4b + 1), after a shift by 4 x[1] (4b + 2,
// 4b + 3). int16 lane w of the products: half w / 8, bytes 2(w % 8) and
// 2(w % 8) + 1; int32 lane i: codes 16(i % 4) .. 16(i % 4) + 15 of parity
// i / 4.
template <>
struct KeyLanes<2> {
  static constexpr int kCodes = 64, kBytes = 16, kSteps = 127, kMaxCode = 3;
  static void unpack(const uint8_t* p, __m256i* x) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 2), 1);
    const __m256i low2 = _mm256_set1_epi8(0x03);
    x[0] = _mm256_and_si256(y, low2);
    x[1] = _mm256_and_si256(_mm256_srli_epi16(y, 4), low2);
  }
  static int lane_first(int i) { return 16 * (i % 4) + i / 4; }
  static constexpr int kLaneSpan = 15;  // codes first .. first + 14, every other one
  static void order_query(const float* q, __m256 inv, __m256i* out) {
    // Per 32 codes: k-th vector lane j = code 4j + k.
    __m256i f[2][4];
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 e01, o01, e23, o23, k[4];
      split_even_odd(_mm256_loadu_ps(q + 32 * h), _mm256_loadu_ps(q + 32 * h + 8), e01, o01);
      split_even_odd(_mm256_loadu_ps(q + 32 * h + 16), _mm256_loadu_ps(q + 32 * h + 24), e23, o23);
      split_even_odd(e01, e23, k[0], k[2]);
      split_even_odd(o01, o23, k[1], k[3]);
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) f[h][j] = _mm256_cvtps_epi32(_mm256_mul_ps(k[j], inv));
    }
    out[0] = pack_bytes(f[0][0], f[1][0], f[0][1], f[1][1]);
    out[1] = pack_bytes(f[0][2], f[1][2], f[0][3], f[1][3]);
  }
  static __m256i dot(const __m256i* x, const int32_t* q) { return KeyLanes<4>::dot(x, q); }
};

// 32 codes in 32 bytes as 16-bit words: x[0] the even codes (word w: code
// 2w), x[1] the odd ones; vpmaddwd against the 16-bit query in the same
// order, the two added: int32 lane i holds codes 4i .. 4i + 3.
template <>
struct KeyLanes<8> {
  static constexpr int kCodes = 32, kBytes = 32, kSteps = 32767, kMaxCode = 255;
  static void unpack(const uint8_t* p, __m256i* x) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    x[0] = _mm256_and_si256(b, _mm256_set1_epi16(0xFF));
    x[1] = _mm256_srli_epi16(b, 8);
  }
  static int lane_first(int i) { return 4 * i; }
  static constexpr int kLaneSpan = 4;
  static void order_query(const float* q, __m256 inv, __m256i* out) {
    __m256i e[2], o[2];
    rounded_even_odd<2>(q, inv, e, o);
    out[0] = pack_words(e[0], e[1]);
    out[1] = pack_words(o[0], o[1]);
  }
  static __m256i dot(const __m256i* x, const int32_t* q) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(x[0], load(q)), x[1], load(q + 8));
#else
    return _mm256_add_epi32(_mm256_madd_epi16(x[0], load(q)), _mm256_madd_epi16(x[1], load(q + 8)));
#endif
  }
};

// llama.cpp's q4_0 (Q4_0Codec): a unit is two of its blocks, 64 values in
// 36 bytes (an fp16 scale d, then 16 bytes: byte j holds value j in its low
// nibble, j + 16 in its high one). The two blocks' code bytes fill the two
// halves of a vector: x[0] low nibbles (half 0 byte j: value j, half 1:
// 32 + j), x[1] high ones (16 + j, 48 + j). int32 lane i: values 4i' ..
// 4i' + 3 and 16 + 4i' .. 16 + 4i' + 3 of block i / 4 (i' = i % 4). A
// value is d (code - 8): the affine form with scale d and min -8 d.
struct KeyLanesQ4_0 {
  static constexpr int kCodes = 64, kBytes = 36, kSteps = 127, kMaxCode = 15;
  static void unpack(const uint8_t* p, __m256i* x) {
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 20));
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1), nib = _mm256_set1_epi8(0x0F);
    x[0] = _mm256_and_si256(y, nib);
    x[1] = _mm256_and_si256(_mm256_srli_epi16(y, 4), nib);
  }
  static int lane_first(int i) { return 32 * (i / 4) + 4 * (i % 4); }
  static constexpr int kLaneSpan = 20;  // 4 values, 12 skipped, 4 more
  static void order_query(const float* q, __m256 inv, __m256i* out) {
    auto r = [&](int first) { return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + first), inv)); };
    out[0] = pack_bytes(r(0), r(8), r(32), r(40));
    out[1] = pack_bytes(r(16), r(24), r(48), r(56));
  }
  static __m256i dot(const __m256i* x, const int32_t* q) { return KeyLanes<4>::dot(x, q); }
};

// The rounding steps across max |q| (the test's error bound): 8-bit queries
// for 4- and 2-bit codes; for 8-bit codes as many as int32 sums of head_dim
// products with codes up to 255 allow, at most 16 bits.
template <class L>
int key_query_steps(int head_dim) {
  return int(std::min<int64_t>(L::kSteps, INT32_MAX / (int64_t(L::kMaxCode) * head_dim)));
}

// The group (of head_dim / groups) of each int32 lane of each unit, or an
// empty table where a lane's codes straddle two groups (the kernel then
// does not apply).
template <class L>
std::vector<int32_t> key_lane_groups(int head_dim, int group) {
  std::vector<int32_t> table;
  for (int u = 0; u * L::kCodes < head_dim; ++u)
    for (int i = 0; i < 8; ++i) {
      const int first = u * L::kCodes + L::lane_first(i), last = first + L::kLaneSpan - 1;
      if (first / group != last / group) return {};
      table.push_back(first / group);
    }
  return table;
}

// Per-thread: the n_q queries rounded (q_d ~ step r_d) and ordered ((n_q,
// units, 2) vectors of 8 int32 words), with per query a = scale * step and,
// per group g (lanes past the groups zero; all zero where q is):
//   group_sums G_g = sum(q_g) / step, the mins' factor;
//   mid_terms  C_g = mid (G_g - sum(r_g)), mid = L::kMaxCode / 2.
// The rounding then errs against codes centred on the group's midpoint:
//   q_g . code = step (sum_d r_d code_d + C_g) + sum_d (q_d - step r_d)(code_d - mid),
// half the codes' range instead of all of it (and both signs).
struct KeyQueries {
  const int32_t* words;
  const float* a;
  const float* group_sums;  // (n_q, 8)
  const float* mid_terms;   // (n_q, 8)
};
// A call with the same queries and parameters as this thread's last one
// (decode scores every block of a KV head against one query group) reuses
// them: rounding three queries cost as much as scoring a 16-token block.
template <class L>
KeyQueries round_queries(const float* q, int n_q, int head_dim, int group, float scale) {
  const int units = head_dim / L::kCodes, groups = std::max(1, head_dim / group);
  thread_local std::vector<int32_t> words;
  thread_local std::vector<float> floats;
  thread_local std::vector<float> last_q;
  thread_local int last_dims[2] = {0, 0};  // head_dim, group
  thread_local float last_scale = 0;
  const size_t q_floats = size_t(n_q) * head_dim;
  // floats: a (n_q), then group_sums and mid_terms (n_q, 8) each.
  auto view = [&] {
    const float* a = floats.data();
    return KeyQueries{words.data(), a, a + n_q, a + n_q + size_t(n_q) * 8};
  };
  if (last_q.size() == q_floats && last_dims[0] == head_dim && last_dims[1] == group && last_scale == scale &&
      std::memcmp(last_q.data(), q, q_floats * sizeof(float)) == 0)
    return view();
  last_q.assign(q, q + q_floats);
  last_dims[0] = head_dim;
  last_dims[1] = group;
  last_scale = scale;
  words.resize(size_t(n_q) * units * 16);
  floats.resize(size_t(n_q) * 17);
  float *a = floats.data(), *sums = a + n_q, *mids = sums + size_t(n_q) * 8;
  constexpr float kMid = 0.5f * float(L::kMaxCode);
  const float steps = float(key_query_steps<L>(head_dim));
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    __m256 top = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int d = 0; d < head_dim; d += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(qi + d), abs_mask));
    const float mx = kvserve::simd::hmax8(top), step = mx / steps;
    const float inv = step > 0 ? 1.0f / step : 0.0f;
    for (int u = 0; u < units; ++u) {
      __m256i w[2];
      L::order_query(qi + u * L::kCodes, _mm256_set1_ps(inv), w);
      int32_t* dst = &words[(size_t(i) * units + u) * 16];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), w[0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), w[1]);
    }
    a[i] = scale * step;
    float *gs = sums + size_t(i) * 8, *gm = mids + size_t(i) * 8;
    std::fill(gs, gs + 8, 0.0f);
    std::fill(gm, gm + 8, 0.0f);
    const int len = std::min(group, head_dim);
    for (int g = 0; g < groups; ++g) {
      __m256 s = _mm256_setzero_ps();
      __m256i r = _mm256_setzero_si256();
      int d = 0;
      for (; d + 8 <= len; d += 8) {
        const __m256 x = _mm256_loadu_ps(qi + g * len + d);
        s = _mm256_add_ps(s, x);
        r = _mm256_add_epi32(r, _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(inv))));  // as order_query rounds
      }
      alignas(32) int32_t rs[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(rs), r);
      float sum = kvserve::simd::hsum8(s);
      int64_t rounded = 0;
      for (int k = 0; k < 8; ++k) rounded += rs[k];
      for (; d < len; ++d) {  // groups of 4 (8-bit codes)
        sum += qi[g * len + d];
        rounded += _mm_cvtss_si32(_mm_set_ss(qi[g * len + d] * inv));
      }
      gs[g] = sum * inv;
      gm[g] = kMid * (gs[g] - float(rounded));
    }
  }
  return view();
}

// Token t's (at most 8) group scales and mins from arrays sc, mn (n, groups);
// lanes past the groups zero.
struct ArrayAffines {
  const float *sc, *mn;
  int groups;
  __m256i live;
  ArrayAffines(const float* s, const float* m, int g)
      : sc(s), mn(m), groups(g), live(_mm256_cmpgt_epi32(_mm256_set1_epi32(g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) {}
  void operator()(int t, __m256& scale, __m256& min) const {
    scale = _mm256_maskload_ps(sc + size_t(t) * groups, live);
    min = _mm256_maskload_ps(mn + size_t(t) * groups, live);
  }
};

// f(std::integral_constant<int, U>{}) with U = units where heads commonly
// have that many (1, 2 or 4: 64 or 128 channels), else 0 (a count known at
// run time). Loops of known length unroll into one straight block: with a
// run-time count an unrelated change elsewhere in the binary made the int4
// layer ~45% slower in cache (Zen 2; BENCHMARKS.md).
template <class F>
void with_units(int units, F&& f) {
  switch (units) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

// The int32 lanes of unit products for query rows [i0, i0 + NQ) against
// token t: acc[i] (lanes summed over units when every lane has one scale).
template <class L, int NQ>
inline void token_products(const uint8_t* codes, int units, const int32_t* qw, __m256i (&acc)[NQ]) {
  #pragma GCC unroll 4
  for (int u = 0; u < units; ++u) {
    __m256i x[2];
    L::unpack(codes + u * L::kBytes, x);
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      const __m256i d = L::dot(x, qw + (size_t(i) * units + u) * 16);
      acc[i] = u == 0 ? d : _mm256_add_epi32(acc[i], d);
    }
  }
}

// One (scale, min) per token for the head: sc[t], mn[t] (readable up to n
// rounded up to 4). Four tokens' int32 lanes reduce together, then
// score = a (sc_t (sum + C) + mn_t G).
template <class L, int NQ, int kUnits>
void score_head_group(const uint8_t* codes, size_t code_stride, int run_units, const KeyQueries& kq, int i0,
                      const float* sc, const float* mn, int n, float* scores, int stride) {
  const int units = kUnits > 0 ? kUnits : run_units;
  for (int t0 = 0; t0 < n; t0 += 4) {
    const int nt = std::min(4, n - t0);
    __m256i part[NQ][4];
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int t = t0 + std::min(u, nt - 1);  // past n: a repeat, not stored
      __m256i acc[NQ];
      token_products<L, NQ>(codes + size_t(t) * code_stride, units, kq.words + size_t(i0) * units * 16, acc);
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) part[i][u] = acc[i];
    }
    const __m128 s4 = _mm_loadu_ps(sc + t0), m4 = _mm_loadu_ps(mn + t0);
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(part[i][0], part[i][1]),
                                          _mm256_hadd_epi32(part[i][2], part[i][3]));
      const __m128 sums = _mm_add_ps(_mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))),
                                     _mm_set1_ps(kq.mid_terms[size_t(i0 + i) * 8]));
      const __m128 r = _mm_mul_ps(_mm_set1_ps(kq.a[i0 + i]),
                                  _mm_fmadd_ps(sums, s4, _mm_mul_ps(m4, _mm_set1_ps(kq.group_sums[size_t(i0 + i) * 8]))));
      store_scores4(scores + size_t(i0 + i) * stride + t0, r, nt);
    }
  }
}

// Groups finer than a head (at most 8): the token's group scales and mins
// come from Affines (ArrayAffines, or a codec's own reader: q4_0 keeps its
// scales among the codes); lane_groups (units, 8) from key_lane_groups.
// Each lane is scaled by its group's scale in floats, the mins meet the
// group sums, and four tokens reduce together.
template <class L, int NQ, int kUnits, class Affines>
void score_sub_groups(const uint8_t* codes, size_t code_stride, int run_units, const KeyQueries& kq, int i0,
                      const Affines& affines, const int32_t* lane_groups, int n, float* scores, int stride) {
  const int units = kUnits > 0 ? kUnits : run_units;
  for (int t0 = 0; t0 < n; t0 += 4) {
    const int nt = std::min(4, n - t0);
    __m256 part[NQ][4];
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int t = t0 + std::min(u, nt - 1);
      __m256 gsc, gmn;
      affines(t, gsc, gmn);
      __m256 f[NQ];
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i)
        f[i] = _mm256_fmadd_ps(gsc, _mm256_loadu_ps(kq.mid_terms + size_t(i0 + i) * 8),
                               _mm256_mul_ps(gmn, _mm256_loadu_ps(kq.group_sums + size_t(i0 + i) * 8)));
      const uint8_t* row = codes + size_t(t) * code_stride;
      #pragma GCC unroll 4
      for (int un = 0; un < units; ++un) {
        __m256i x[2];
        L::unpack(row + un * L::kBytes, x);
        const __m256 lane_scale = _mm256_permutevar8x32_ps(
            gsc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_groups + un * 8)));
        #pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          const __m256i d = L::dot(x, kq.words + (size_t(i0 + i) * units + un) * 16);
          f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), lane_scale, f[i]);
        }
      }
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) part[i][u] = f[i];
    }
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(part[i][0], part[i][1]), _mm256_hadd_ps(part[i][2], part[i][3]));
      const __m128 r = _mm_mul_ps(_mm_set1_ps(kq.a[i0 + i]),
                                  _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      store_scores4(scores + size_t(i0 + i) * stride + t0, r, nt);
    }
  }
}

}  // namespace kvserve::int_codec::simd8

#endif  // AVX2 without AVX-512
