// Internal to the integer KV codecs (through int_codec_kernels.h, whose
// scratch() and rope_lanes() it uses): the AVX2 counterpart of its AVX-512
// score and accumulate over token sources, for the codecs that read token
// rows (token groups, q4_0, static scales, keys exactly before RoPE) and have
// no integer kernel on AVX2.
//
// Why: before these, an AVX2 build scored such keys by decoding each token's
// head slice into a scratch row and calling dot once per query (a full
// horizontal sum each), and q4_0 and static scales decoded value by value. A
// layer at 16K with plain `--kv-dtype int8` then took 1.7x FP16's time, q4_0
// 18x, and a decode step with static scales 23x.
//
// A source is the same contract as on AVX-512, on 8 lanes: `token(t)` gives a
// cursor whose `chunk(c, x)` dequantizes chunk c of the head slice into
// Order::kVecs registers. Lanes8<B>: a chunk is 8 bytes of B-bit codes and
// vector k, lane j holds code j * kVecs + k (the order shifts leave them
// in); queries are put in that order once per call and the value sums put
// back once per call. Natural8<V>: V vectors in natural order (q4_0's block).
// Each key or value byte is read once per call for all the queries of a pass.
#pragma once

#include "util/simd.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv/attention_simd.h"

namespace kvserve::int_codec::simd8 {

// Even and odd elements of the 16 floats (a, b): (0, 2, .., 14), (1, .., 15).
inline void split_even_odd(__m256 a, __m256 b, __m256& even, __m256& odd) {
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
// The inverse: 16 floats (a, b) from their even and odd elements.
inline void join_even_odd(__m256 even, __m256 odd, __m256& a, __m256& b) {
  const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
  a = _mm256_permute2f128_ps(lo, hi, 0x20);
  b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// Four scores (nt <= 4 of them real) to dst: a block's last tokens store
// only theirs.
inline void store_scores4(float* dst, __m128 sums, int nt) {
  if (nt == 4) {
    _mm_storeu_ps(dst, sums);
  } else {
    alignas(16) float four[4];
    _mm_store_ps(four, sums);
    std::copy(four, four + nt, dst);
  }
}

template <int B>
struct Lanes8 {
  static constexpr int kVecs = 8 / B;
  static constexpr int kCodes = 8 * kVecs;

  static void unpack(const uint8_t* p, __m256* c) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
    c[0] = _mm256_cvtepi32_ps(B == 8 ? b : _mm256_and_si256(b, mask));
    #pragma GCC unroll 4
    for (int k = 1; k < kVecs; ++k) {
      const __m256i s = _mm256_srli_epi32(b, k * B);
      c[k] = _mm256_cvtepi32_ps(k + 1 == kVecs ? s : _mm256_and_si256(s, mask));
    }
  }
  // kCodes natural-order floats -> lane order.
  static void to_lanes(const float* nat, float* lanes) {
    __m256 n[kVecs];
    #pragma GCC unroll 4
    for (int k = 0; k < kVecs; ++k) n[k] = _mm256_loadu_ps(nat + 8 * k);
    if constexpr (B == 4) {
      split_even_odd(n[0], n[1], n[0], n[1]);
    } else if constexpr (B == 2) {
      __m256 e01, o01, e23, o23;
      split_even_odd(n[0], n[1], e01, o01);  // codes 0, 2, .., 14 and 1, 3, .., 15
      split_even_odd(n[2], n[3], e23, o23);  // 16 .. 30 and 17 .. 31
      split_even_odd(e01, e23, n[0], n[2]);  // 4j and 4j + 2
      split_even_odd(o01, o23, n[1], n[3]);  // 4j + 1 and 4j + 3
    }
    #pragma GCC unroll 4
    for (int k = 0; k < kVecs; ++k) _mm256_storeu_ps(lanes + 8 * k, n[k]);
  }
  // kVecs lane-order vectors -> natural order.
  static void from_lanes(const __m256* lanes, __m256* nat) {
    if constexpr (B == 8) {
      nat[0] = lanes[0];
    } else if constexpr (B == 4) {
      join_even_odd(lanes[0], lanes[1], nat[0], nat[1]);
    } else {
      __m256 e01, e23, o01, o23;
      join_even_odd(lanes[0], lanes[2], e01, e23);
      join_even_odd(lanes[1], lanes[3], o01, o23);
      join_even_odd(e01, o01, nat[0], nat[1]);
      join_even_odd(e23, o23, nat[2], nat[3]);
    }
  }
};

template <int V>
struct Natural8 {
  static constexpr int kVecs = V;
  static constexpr int kCodes = 8 * V;
  static void to_lanes(const float* nat, float* lanes) { std::memcpy(lanes, nat, sizeof(float) * kCodes); }
  static void from_lanes(const __m256* lanes, __m256* nat) {
    #pragma GCC unroll 4
    for (int k = 0; k < V; ++k) nat[k] = lanes[k];
  }
};

// Rotates chunk c of a token's key (lane order, kVecs vectors) forward by the
// RoPE angles of rows cs (cos) and cs + hd (sin, signed per pair element as
// RopeTable keeps it) in lane order: k' = k * cos - partner(k) * sin, where a
// pair's partner sits in the next (or previous) vector at the same lane when
// a chunk has several (Lanes8<4>, Lanes8<2>), and in the neighbouring lane
// when it has one (8-bit codes, natural order).
template <int kVecs>
inline void rotate_chunk(const float* cs, int hd, int c, __m256* x) {
  const float* co = cs + c * kVecs * 8;
  const float* si = co + hd;
  if constexpr (kVecs == 1) {
    x[0] = _mm256_fnmadd_ps(_mm256_permute_ps(x[0], 0xB1), _mm256_loadu_ps(si), _mm256_mul_ps(x[0], _mm256_loadu_ps(co)));
  } else {
    #pragma GCC unroll 4
    for (int k = 0; k < kVecs; k += 2) {
      const __m256 a = x[k], b = x[k + 1];
      x[k] = _mm256_fnmadd_ps(b, _mm256_loadu_ps(si + 8 * k), _mm256_mul_ps(a, _mm256_loadu_ps(co + 8 * k)));
      x[k + 1] = _mm256_fnmadd_ps(a, _mm256_loadu_ps(si + 8 * (k + 1)), _mm256_mul_ps(b, _mm256_loadu_ps(co + 8 * (k + 1))));
    }
  }
}

// NQ queries (lane order, (NQ, hd) floats at qp + t * q_token_stride)
// against the first n tokens of the source, four tokens per reduction: their
// per-lane sums reduce together (three horizontal adds for four scores).
// With rot, token t's key is first rotated by the lane-order rows at
// rot + t * 2 * hd (rotate_chunk).
template <int NQ, class Src>
void score_queries(const Src& src, const float* qp, size_t q_token_stride, int n, float scale, float* scores,
                   int stride, const float* rot) {
  using Order = typename Src::Order;
  constexpr int kVecs = Order::kVecs;
  constexpr int kU = kVecs == 1 ? 2 : 1;
  const int hd = src.head_dim, chunks = hd / Order::kCodes;
  for (int t0 = 0; t0 < n; t0 += 4) {
    const int nt = std::min(4, n - t0);
    __m256 part[NQ][4];
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int t = t0 + std::min(u, nt - 1);  // past n: a repeat, not stored
      const auto tok = src.token(t);
      const float* qt = qp + size_t(t) * q_token_stride;
      // Two sums per query, even and odd vectors: one chain of dependent
      // FMAs per query made a token wait on their latency.
      __m256 acc[NQ][2];
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      // kU chunks per step, so that each step feeds both sums with
      // indices known at compile time (registers, not the stack).
      auto step = [&](int c, auto units) {
        #pragma GCC unroll 4
        for (int e = 0; e < units.value; ++e) {
          __m256 x[kVecs];
          tok.chunk(c + e, x);
          if (rot != nullptr) rotate_chunk<kVecs>(rot + size_t(t) * 2 * hd, hd, c + e, x);
          #pragma GCC unroll 4
          for (int k = 0; k < kVecs; ++k) {
            const int v = (c + e) * kVecs + k;
            #pragma GCC unroll 4
            for (int i = 0; i < NQ; ++i)
              acc[i][(e * kVecs + k) & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qt + i * hd + v * 8), x[k],
                                                            acc[i][(e * kVecs + k) & 1]);
          }
        }
      };
      int c = 0;
      for (; c + kU <= chunks; c += kU) step(c, std::integral_constant<int, kU>{});
      for (; c < chunks; ++c) step(c, std::integral_constant<int, 1>{});
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) part[i][u] = _mm256_add_ps(acc[i][0], acc[i][1]);
    }
    #pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(part[i][0], part[i][1]), _mm256_hadd_ps(part[i][2], part[i][3]));
      const __m128 sums = _mm_mul_ps(_mm_set1_ps(scale), _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      store_scores4(scores + size_t(i) * stride + t0, sums, nt);
    }
  }
}

// A source's first n tokens dequantized (and, with rot, rotated) once into
// lane-order floats, for calls with more query rows than one pass takes
// (prefill tiles: 16 tokens' query groups per block): every pass then loads
// floats instead of dequantizing each token again.
template <class O>
struct FloatRows {
  using Order = O;
  const float* rows;  // (n, head_dim) lane order
  int head_dim;
  struct Cursor {
    const float* row;
    void chunk(int c, __m256* x) const {
      #pragma GCC unroll 4
      for (int k = 0; k < Order::kVecs; ++k) x[k] = _mm256_loadu_ps(row + (c * Order::kVecs + k) * 8);
    }
  };
  void prefetch(int) const {}
  Cursor token(int t) const { return {rows + size_t(t) * head_dim}; }
};
template <class Src>
FloatRows<typename Src::Order> dequantize_rows(const Src& src, int n, const float* rot) {
  using Order = typename Src::Order;
  constexpr int kVecs = Order::kVecs;
  const int hd = src.head_dim, chunks = hd / Order::kCodes;
  src.prefetch(n);
  float* rows = scratch(2, size_t(n) * size_t(hd));
  for (int t = 0; t < n; ++t) {
    const auto tok = src.token(t);
    for (int c = 0; c < chunks; ++c) {
      __m256 x[kVecs];
      tok.chunk(c, x);
      if (rot != nullptr) rotate_chunk<kVecs>(rot + size_t(t) * 2 * hd, hd, c, x);
      #pragma GCC unroll 4
      for (int k = 0; k < kVecs; ++k) _mm256_storeu_ps(rows + size_t(t) * hd + (c * kVecs + k) * 8, x[k]);
    }
  }
  return {rows, hd};
}
// Query rows past one pass (kvserve::simd::by_query_passes<3>).
constexpr int kPassRows = 3;

// q: (n_q, head_dim) floats, or (n, n_q, head_dim) with per_token_q. rot:
// keys rotated by these rows first (rope_lanes; pre-RoPE keys by their
// offset in the block), or nullptr.
template <class Src>
void score(const Src& src, const float* q, int n_q, bool per_token_q, int n, float scale, float* scores, int stride,
           const float* rot = nullptr) {
  if constexpr (!std::is_same_v<Src, FloatRows<typename Src::Order>>) {
    if (n_q > kPassRows && n > 0) {
      score(dequantize_rows(src, n, rot), q, n_q, per_token_q, n, scale, scores, stride);
      return;
    }
  }
  using Order = typename Src::Order;
  const int hd = src.head_dim;
  src.prefetch(n);
  const size_t sets = size_t(per_token_q ? n : 1) * size_t(n_q);
  float* qp = scratch(0, sets * size_t(hd));
  for (size_t s = 0; s < sets; ++s)
    for (int c = 0; c < hd; c += Order::kCodes) Order::to_lanes(q + s * hd + c, qp + s * hd + c);
  const size_t q_token_stride = per_token_q ? size_t(n_q) * hd : 0;
  kvserve::simd::by_query_passes<3>(n_q, [&](auto m, int i) {
    score_queries<m>(src, qp + size_t(i) * hd, q_token_stride, n, scale, scores + size_t(i) * stride, stride, rot);
  });
}

// out[i][d] += sum_t w[i][t] x_t[d] over chunks [c0, c0 + NC) of the head
// slice (NC * kVecs vectors, at most 4), NQ queries: the sums stay in
// registers across the tokens.
template <int NQ, int NC, class Src>
void accumulate_chunks(const Src& src, const float* weights, int stride, int n, int c0, float* out) {
  using Order = typename Src::Order;
  constexpr int kVecs = Order::kVecs, kAcc = NC * kVecs;
  static_assert(kAcc <= 4);
  const int hd = src.head_dim;
  __m256 acc[NQ][kAcc];
  #pragma GCC unroll 4
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < kAcc; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const auto tok = src.token(t);
    #pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      __m256 x[kVecs];
      tok.chunk(c0 + c, x);
      #pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) {
        const __m256 w = _mm256_broadcast_ss(weights + size_t(i) * stride + t);
        #pragma GCC unroll 4
        for (int k = 0; k < kVecs; ++k) acc[i][c * kVecs + k] = _mm256_fmadd_ps(w, x[k], acc[i][c * kVecs + k]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < NQ; ++i)
    #pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      __m256 nat[kVecs];
      Order::from_lanes(&acc[i][c * kVecs], nat);
      #pragma GCC unroll 4
      for (int k = 0; k < kVecs; ++k) {
        float* o = out + size_t(i) * hd + size_t(c0 + c) * Order::kCodes + 8 * k;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), nat[k]));
      }
    }
}

template <class Src>
void accumulate(const Src& src, const float* weights, int n_q, int stride, int n, float* out) {
  if constexpr (!std::is_same_v<Src, FloatRows<typename Src::Order>>) {
    if (n_q > kPassRows && n > 0) {
      accumulate(dequantize_rows(src, n, nullptr), weights, n_q, stride, n, out);
      return;
    }
  }
  using Order = typename Src::Order;
  constexpr int kStep = 4 / Order::kVecs;  // chunks per pass: four vectors' sums per query
  const int hd = src.head_dim, chunks = hd / Order::kCodes;
  src.prefetch(n);
  kvserve::simd::by_query_passes<3>(n_q, [&](auto m, int i) {
    const float* w = weights + size_t(i) * stride;
    float* o = out + size_t(i) * hd;
    int c = 0;
    for (; c + kStep <= chunks; c += kStep) accumulate_chunks<m, kStep>(src, w, stride, n, c, o);
    for (; c < chunks; ++c) accumulate_chunks<m, 1>(src, w, stride, n, c, o);
  });
}

}  // namespace kvserve::int_codec::simd8

#endif  // AVX2 without AVX-512
