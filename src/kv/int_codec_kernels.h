// Internal to the integer KV codecs (int_codecs.cpp, channel_codec.cpp): code
// packing, the affine fit, and the AVX-512 attention kernels the codecs share
// (token sources dequantized in registers, 16-bit folding helpers).
#pragma once

#include "kv/attention_simd.h"

#include "util/simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/rope_table.h"
#include "kernels/vector_ops.h"
#include "util/half.h"

namespace kvserve::int_codec {

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

// n consecutive fp16 (scale, min) pairs as two float arrays.
inline void split_pair_run(const fp16_t* pairs, int n, float* scale, float* min) {
  int t = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; t + 8 <= n; t += 8) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 2 * t));  // (scale, min) words
    auto halves = [](__m256i x) {  // 8 zero-extended halves -> 8 floats
      return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
    };
    _mm256_storeu_ps(scale + t, halves(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF))));
    _mm256_storeu_ps(min + t, halves(_mm256_srli_epi32(w, 16)));
  }
#endif
  for (; t < n; ++t) {
    scale[t] = fp16_to_fp32(pairs[2 * t]);
    min[t] = fp16_to_fp32(pairs[2 * t + 1]);
  }
}

// Per-thread buffers of the vector kernels (AVX-512's simd, AVX2's simd8):
// slot 0 for the queries a kernel puts in lane order, slot 1 for a source's
// per-call metadata, slot 2 for a block's dequantized rows (simd8).
inline float* scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[3];
  std::vector<float>& buf = bufs[slot];
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The lane-order rotation rows the score kernels take (AVX-512's simd::score,
// AVX2's simd8::score): for offsets [0, n), the rope table's cos row then sin
// row, each chunk put in Order's lane order.
template <class Order>
std::vector<float> rope_lanes(const RopeTable& rope, int n) {
  const int hd = rope.head_dim();
  std::vector<float> out(size_t(n) * 2 * size_t(hd));
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < hd; c += Order::kCodes) {
      Order::to_lanes(rope.cos_row(t) + c, out.data() + size_t(t) * 2 * hd + c);
      Order::to_lanes(rope.sin_row(t) + c, out.data() + size_t(t) * 2 * hd + hd + c);
    }
  return out;
}

// rope_lanes<Order> for one rope table, built on first use (attention
// threads share a codec) and kept: a block's offsets are 0 .. block_size - 1
// for every block, so the rows stay in L1. get() returns nullptr for a table
// other than the first one seen.
template <class Order>
class LaneRopeRows {
 public:
  const float* get(const RopeTable& rope, int n) const {
    std::call_once(once_, [&] {
      table_ = &rope;
      rows_ = rope_lanes<Order>(rope, n);
    });
    return table_ == &rope ? rows_.data() : nullptr;
  }

 private:
  mutable std::once_flag once_;
  mutable const RopeTable* table_ = nullptr;
  mutable std::vector<float> rows_;
};

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

// For nq <= 4 folded vectors, from the largest magnitude top[i] of each:
// step[i] = max / qmax (the rounding step) and inv[i] = qmax / max (0 when
// max is 0, or so small that qmax / max would overflow: such a vector
// folds to zeros instead of infinities).
inline void fold_steps(const __m512* top, int nq, float qmax, float* step, float* inv) {
  const __m128 tops = kvserve::simd::reduce4<true>(top, nq);
  _mm_mask_storeu_ps(step, __mmask8((1u << nq) - 1), _mm_mul_ps(tops, _mm_set1_ps(1.0f / qmax)));
  const __mmask8 finite = _mm_cmp_ps_mask(tops, _mm_set1_ps(qmax / std::numeric_limits<float>::max()), _CMP_GT_OQ);
  _mm_storeu_ps(inv, _mm_maskz_div_ps(finite, _mm_set1_ps(qmax), tops));
}

// Rotates chunk c of a token's key (lane order, kVecs vectors) forward by the
// RoPE angles of rows cs (cos) and cs + hd (sin) in lane order:
// k' = k * cos - partner(k) * sin, where a pair's partner sits in the next
// (or previous) vector at the same lane when a chunk has several vectors
// (Lanes<4>, Lanes<2>: element 2i and 2i + 1 are vectors 2m and 2m + 1), and
// in the neighbouring lane when it has one (natural order).
template <int kVecs>
inline void rotate_chunk(const float* cs, int hd, int c, __m512* x) {
  const float* co = cs + c * kVecs * 16;
  const float* si = co + hd;
  if constexpr (kVecs == 1) {
    const __m512i swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
    x[0] = _mm512_fnmadd_ps(_mm512_permutexvar_ps(swap, x[0]), _mm512_loadu_ps(si), _mm512_mul_ps(x[0], _mm512_loadu_ps(co)));
  } else {
    #pragma GCC unroll 16
    for (int k = 0; k < kVecs; k += 2) {
      const __m512 a = x[k], b = x[k + 1];
      x[k] = _mm512_fnmadd_ps(b, _mm512_loadu_ps(si + 16 * k), _mm512_mul_ps(a, _mm512_loadu_ps(co + 16 * k)));
      x[k + 1] = _mm512_fnmadd_ps(a, _mm512_loadu_ps(si + 16 * (k + 1)), _mm512_mul_ps(b, _mm512_loadu_ps(co + 16 * (k + 1))));
    }
  }
}

// NQ queries (lane order, (NQ, hd) floats at qp + t * q_token_stride) against
// the first n tokens of the source; with rot, token t's key is first rotated
// by the lane-order rows at rot + t * 2 * hd (rotate_chunk).
template <int NQ, class Src>
void score_queries(const Src& src, const float* qp, size_t q_token_stride, int n, float scale, float* scores,
                   int stride, const float* rot = nullptr) {
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
        if (rot != nullptr) rotate_chunk<kVecs>(rot + size_t(t) * 2 * hd, hd, c, x);
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

// q: (n_q, head_dim) floats, or (n, n_q, head_dim) with per_token_q. rot:
// keys rotated by these rows first (rope_lanes; pre-RoPE keys by their
// offset in the block), or nullptr.
template <class Src>
void score(const Src& src, const float* q, int n_q, bool per_token_q, int n, float scale, float* scores,
           int stride, const float* rot = nullptr) {
  using Order = typename Src::Order;
  const int hd = src.head_dim;
  src.prefetch(n);
  const size_t sets = size_t(per_token_q ? n : 1) * size_t(n_q);
  float* qp = scratch(0, sets * hd);
  for (size_t s = 0; s < sets; ++s)
    for (int c = 0; c < hd; c += Order::kCodes) Order::to_lanes(q + s * hd + c, qp + s * hd + c);
  const size_t q_token_stride = per_token_q ? size_t(n_q) * hd : 0;
  kvserve::simd::by_query_passes(n_q, [&](auto m, int i) {
    score_queries<m>(src, qp + size_t(i) * hd, q_token_stride, n, scale, scores + size_t(i) * stride, stride, rot);
  });
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
  kvserve::simd::by_query_passes(n_q, [&](auto m, int i) {
    accumulate_queries<m>(src, weights + size_t(i) * stride, stride, n, out + size_t(i) * hd);
  });
}

}  // namespace simd
#endif  // __AVX512F__

}  // namespace kvserve::int_codec

#include "kv/source_kernels8.h"

// Builds whose codecs that read token rows have vector score and accumulate
// kernels over sources that dequantize in registers: AVX-512 (simd above, 16
// lanes) and AVX2 (source_kernels8.h, 8 lanes). source_kernels names the one
// this build has.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVSERVE_TOKEN_SOURCES 1
namespace kvserve::int_codec {
#if defined(__AVX512F__)
namespace source_kernels = simd;
#else
namespace source_kernels = simd8;
#endif
}  // namespace kvserve::int_codec
#endif
