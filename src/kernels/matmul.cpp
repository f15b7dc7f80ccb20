// Matmul driver and inner kernels.
//
// Work is cut into tiles of up to kTileRows weight rows x kTileTokens tokens; a
// tile kernel keeps its R x T accumulators in registers and walks the columns
// once, so every weight element it loads serves T tokens. Threads split the
// output rows; each thread walks its rows once per chunk of kTokenChunk tokens,
// so the weights are read n / kTokenChunk times in all (once for decode) while
// the chunk's activations stay in L2.
//
// Quantized weights (AVX-512 VNNI): vpdpbusd multiplies unsigned by signed
// bytes, so weights are made unsigned by an offset (Q8_0: q ^ 0x80 = q + 128;
// Q4_0: the raw nibble, q + 8) and the activations stay signed:
//   sum (q + off) * x = sum q * x + off * sum x.
// The correction off * sum x depends only on the token, so it is computed once
// per token and block pair (one extra vpdpbusd) and seeds every row's sum.
//
// Q4_1 has one plain scalar kernel here: it only runs in tests (see
// ScalarQuantKernel).
#include "kernels/matmul.h"

#include "util/simd.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/interleaved_weights.h"
#include "kernels/quantize_q8.h"
#include "util/error.h"
#include "util/half.h"
#include "util/thread_pool.h"

namespace kvserve {

namespace {

// The R x T loops of the tile kernels must be unrolled so their arrays of
// vectors live in registers; -O2 alone keeps them on the stack.
#define KVSERVE_UNROLL _Pragma("GCC unroll 8")

// GCC 12.2 with -march=native on a VNNI machine (AVX-VNNI or AVX512-VNNI)
// vectorises a signed int8 x int8 dot-product loop into vpdpbusd, which is
// unsigned x signed, and so computes wrong sums. Keep the vectoriser off the
// scalar integer kernels.
#if defined(__GNUC__) && !defined(__clang__)
#define KVSERVE_NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#else
#define KVSERVE_NO_VECTORIZE
#endif

constexpr int kTileRows = 4;
constexpr int kTileTokens = 4;
constexpr int64_t kTokenChunk = 64;
constexpr int64_t kRowGrain = 32;  // chunks are multiples of it; a multiple of kTileRows
constexpr int64_t kQ8BlockBytes = 34;
constexpr int64_t kQ4BlockBytes = 18;
constexpr int64_t kQ4_1BlockBytes = 20;

struct MatmulArgs {
  const WeightMatrix* w;
  const float* x;           // (n, cols) floats; float weight types
  const QuantizedRows* qx;  // (n, cols) Q8 activations; quantized weight types
  float* y;                 // (n, rows)
  int64_t n;
};

[[maybe_unused]] float load_fp16(const uint8_t* p) {
  fp16_t h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_fp32(h);
}

// Which kernels the build targets; anything else gets the portable scalar ones.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_MATMUL_AVX512 1
#if defined(__AVX512VNNI__)
#define KVSERVE_MATMUL_VNNI 1
#endif
#endif

// One weight of a float row, as a float.
[[maybe_unused]] inline float weight_at(const float* p, int64_t k) { return p[k]; }
[[maybe_unused]] inline float weight_at(const fp16_t* p, int64_t k) { return fp16_to_fp32(p[k]); }

#if defined(KVSERVE_MATMUL_AVX512)

// Decode streams the weights from DRAM once, and the hardware prefetcher alone
// left the kernels at ~60% of read bandwidth. So while a tile works on rows
// [r0, r0 + R) it prefetches the same offset of rows [r0 + R, r0 + 2R): the next
// tile's data, one tile's compute time ahead. (Prefetches never fault, so
// running past the matrix end is harmless.)
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// ---- F32 / F16 weights: fp32 FMA, 16 columns per step, masked tail. ----

inline __m512 load_weights16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_weights16(const fp16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <class W>
struct FloatKernel {
  template <int R, int T>
  static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    const int64_t cols = a.w->cols;
    const W* wr[R];
    KVSERVE_UNROLL
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const W*>(a.w->row(r0 + r));
    const float* xt[T];
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) xt[t] = a.x + (t0 + t) * cols;
    __m512 acc[R][T];
    KVSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();

    const int64_t prefetch_offset = R * int64_t(a.w->row_bytes());
    auto step = [&](int64_t k, __mmask16 m) {
      __m512 wv[R];
      KVSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        prefetch(reinterpret_cast<const uint8_t*>(wr[r] + k) + prefetch_offset);
        wv[r] = load_weights16(wr[r] + k, m);
      }
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, xt[t] + k);
        KVSERVE_UNROLL
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
      }
    };
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) step(k, 0xFFFF);
    if (k < cols) step(k, __mmask16((1u << (cols - k)) - 1));

    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t)
      KVSERVE_UNROLL
      for (int r = 0; r < R; ++r)
        a.y[(t0 + t) * a.w->rows + r0 + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
};

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 (16 registers): one weight row at a time against T tokens, 8 columns
// per step, so the T accumulators and the row's vector fit in registers.

template <class W>
struct FloatKernel {
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load8(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  template <int R, int T>
  static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    const int64_t cols = a.w->cols;
    for (int r = 0; r < R; ++r) {
      const W* wr = reinterpret_cast<const W*>(a.w->row(r0 + r));
      __m256 acc[T];
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= cols; k += 8) {
        const __m256 wv = load8(wr + k);
        KVSERVE_UNROLL
        for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a.x + (t0 + t) * cols + k), acc[t]);
      }
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) {
        float sum = simd::hsum8(acc[t]);
        for (int64_t j = k; j < cols; ++j) sum += weight_at(wr, j) * a.x[(t0 + t) * cols + j];
        a.y[(t0 + t) * a.w->rows + r0 + r] = sum;
      }
    }
  }
};

#else  // portable: the compiler vectorises what it can.

template <class W>
struct FloatKernel {

  template <int R, int T>
  static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    const int64_t cols = a.w->cols;
    for (int r = 0; r < R; ++r) {
      const W* wr = reinterpret_cast<const W*>(a.w->row(r0 + r));
      for (int t = 0; t < T; ++t) {
        const float* xt = a.x + (t0 + t) * cols;
        float sum = 0.0f;
        for (int64_t k = 0; k < cols; ++k) sum += weight_at(wr, k) * xt[k];
        a.y[(t0 + t) * a.w->rows + r0 + r] = sum;
      }
    }
  }
};

#endif

// ---- Q8_0 / Q4_0 / Q4_1 weights against Q8 activations. ----

// The plain scalar kernel, over Q's accessors: quant(row, b, j) (the code
// value j of block b multiplies), scale(row, b), and where Q::kMin,
// min(row, b), which adds min dx sum qx per block. Portable builds run
// Q8_0 and Q4_0 on it; every build runs Q4_1 on it, but only in tests:
// loaders make Q4_1 matrices only where native_q4_1_supported() and
// interleaved copies are made, and every Q4_1 projection then runs from
// its copy.
template <class Q>
struct ScalarQuantKernel {
  template <int R, int T>
  KVSERVE_NO_VECTORIZE static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = a.w->row(r0 + r);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.qx->row_qs(t0 + t);
        const float* xd = a.qx->row_d(t0 + t);
        float sum = 0.0f;
        for (int64_t b = 0; b < a.qx->blocks; ++b) {
          int32_t isum = 0, xsum = 0;
          for (int j = 0; j < 32; ++j) {
            isum += Q::quant(wr, b, j) * int(xq[b * 32 + j]);
            if constexpr (Q::kMin) xsum += int(xq[b * 32 + j]);
          }
          sum += Q::scale(wr, b) * xd[b] * float(isum);
          if constexpr (Q::kMin) sum += Q::min(wr, b) * xd[b] * float(xsum);
        }
        a.y[(t0 + t) * a.w->rows + r0 + r] = sum;
      }
    }
  }
};

// Q4_1: the raw nibble (Q4_0's order), x = d q + m.
struct Q4_1Weights {
  static constexpr bool kMin = true;
  static int quant(const uint8_t* row, int64_t b, int j) {
    const uint8_t q = row[b * kQ4_1BlockBytes + 4 + (j & 15)];
    return j < 16 ? q & 0x0F : q >> 4;
  }
  static float scale(const uint8_t* row, int64_t b) { return load_fp16(row + b * kQ4_1BlockBytes); }
  static float min(const uint8_t* row, int64_t b) { return load_fp16(row + b * kQ4_1BlockBytes + 2); }
};

#if defined(KVSERVE_MATMUL_VNNI)

// Lanes 0-7 take element 0 of a vector, lanes 8-15 element 1: spreads a pair of
// block scales over the int32 lanes that hold those blocks' partial sums.
inline __m512 spread_scale_pair(__m128 pair) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(pair));
}

// Scales of blocks b and b + 1 (0 for the second when !kSecond), blocks being
// kStride bytes apart: lanes 0-7 hold block b's scale, lanes 8-15 block b+1's.
template <int64_t kStride, bool kSecond>
inline __m512 weight_scale_pair(const uint8_t* row, int64_t b) {
  const __m128i d0 = _mm_loadu_si16(row + b * kStride);
  __m256i halves = _mm256_broadcastw_epi16(d0);
  if constexpr (kSecond) {
    const __m128i d1 = _mm_loadu_si16(row + (b + 1) * kStride);
    halves = _mm256_mask_broadcastw_epi16(halves, 0xFF00, d1);
  } else {
    halves = _mm256_maskz_mov_epi16(0x00FF, halves);
  }
  return _mm512_cvtph_ps(halves);
}

// Q8_0: the 64 quants of blocks b, b + 1 as unsigned bytes q + 128.
struct Q8Weights {
  static constexpr int64_t kStride = kQ8BlockBytes;
  static constexpr char kOffset = char(128);
  template <bool kSecond>
  static __m512i load_pair(const uint8_t* row, int64_t b) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kStride + 2));
    __m512i v = _mm512_zextsi256_si512(lo);
    if constexpr (kSecond) {
      const auto* p = reinterpret_cast<const __m256i*>(row + (b + 1) * kStride + 2);
      v = _mm512_inserti64x4(v, _mm256_loadu_si256(p), 1);
    }
    return _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
  }
};

// Q4_0: the 64 nibbles of blocks b, b + 1 as unsigned bytes q + 8, in element
// order: 128-bit lanes hold (b low nibbles, b high, b+1 low, b+1 high).
struct Q4Weights {
  static constexpr int64_t kStride = kQ4BlockBytes;
  static constexpr char kOffset = 8;
  template <bool kSecond>
  static __m512i load_pair(const uint8_t* row, int64_t b) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kStride + 2));
    const __m128i q1 =
        kSecond ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (b + 1) * kStride + 2))
                : _mm_setzero_si128();
    const __m512i dup = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(_mm256_set_m128i(q1, q0)));
    // Shift the copies in 128-bit lanes 1 and 3 down to their high nibbles.
    const __m512i shifted = _mm512_mask_srli_epi16(dup, __mmask32(0xFF00FF00u), dup, 4);
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  }
};

template <class Q>
struct QuantKernel {
  template <int R, int T, bool kSecond>
  static void block_pair(const uint8_t* const* wr, const int8_t* const* xq,
                         const float* const* xd, int64_t b, int64_t prefetch_offset,
                         __m512 (&acc)[R][T]) {
    __m512i wv[R];
    __m512 wd[R];
    KVSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      prefetch(wr[r] + b * Q::kStride + prefetch_offset);
      wv[r] = Q::template load_pair<kSecond>(wr[r], b);
      wd[r] = weight_scale_pair<Q::kStride, kSecond>(wr[r], b);
    }
    const __m512i offset = _mm512_set1_epi8(Q::kOffset);
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      const __m512i xv = _mm512_load_si512(xq[t] + b * 32);
      const __m512i seed =
          _mm512_sub_epi32(_mm512_setzero_si512(),
                           _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xv));
      const __m512 xs = spread_scale_pair(
          _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(xd[t] + b))));
      KVSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(seed, wv[r], xv));
        acc[r][t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(wd[r], xs), acc[r][t]);
      }
    }
  }

  template <int R, int T>
  static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    const int64_t nb = a.qx->blocks;
    const uint8_t* wr[R];
    KVSERVE_UNROLL
    for (int r = 0; r < R; ++r) wr[r] = a.w->row(r0 + r);
    const int8_t* xq[T];
    const float* xd[T];
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      xq[t] = a.qx->row_qs(t0 + t);
      xd[t] = a.qx->row_d(t0 + t);
    }
    __m512 acc[R][T];
    KVSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    int64_t b = 0;
    const int64_t prefetch_offset = R * int64_t(a.w->row_bytes());
    for (; b + 2 <= nb; b += 2) block_pair<R, T, true>(wr, xq, xd, b, prefetch_offset, acc);
    if (b < nb) block_pair<R, T, false>(wr, xq, xd, b, prefetch_offset, acc);
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t)
      KVSERVE_UNROLL
      for (int r = 0; r < R; ++r)
        a.y[(t0 + t) * a.w->rows + r0 + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
};

#else  // portable

struct Q8Weights {
  static constexpr bool kMin = false;
  static int quant(const uint8_t* row, int64_t b, int j) {
    return int8_t(row[b * kQ8BlockBytes + 2 + j]);
  }
  static float scale(const uint8_t* row, int64_t b) { return load_fp16(row + b * kQ8BlockBytes); }
};

struct Q4Weights {
  static constexpr bool kMin = false;
  static int quant(const uint8_t* row, int64_t b, int j) {
    const uint8_t q = row[b * kQ4BlockBytes + 2 + (j & 15)];
    return int(j < 16 ? q & 0x0F : q >> 4) - 8;
  }
  static float scale(const uint8_t* row, int64_t b) { return load_fp16(row + b * kQ4BlockBytes); }
};

#if defined(__AVX2__) && defined(__FMA__)

// AVX2: one 32-value block per instruction pair. maddubs multiplies unsigned
// by signed bytes, so the weights' signs move onto the activations (|w| times
// x·sign(w)); pair sums stay within int16 (2 · 128 · 127 < 32768). With
// AVX-VNNI (Intel since Alder Lake, AMD since Zen 4, on the 256-bit
// registers) vpdpbusd sums each lane's four products into 32 bits at once.
inline __m256 block_dot(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)));
#else
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline __m256i load_block(const Q8Weights&, const uint8_t* row, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kQ8BlockBytes + 2));
}
inline __m256i load_block(const Q4Weights&, const uint8_t* row, int64_t b) {  // elements 0-15 low nibbles, 16-31 high
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kQ4BlockBytes + 2));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nib), _mm_and_si128(q, nib));
  return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
}

template <class Q>
struct QuantKernel {
  template <int R, int T>
  static void tile(const MatmulArgs& a, int64_t r0, int64_t t0) {
    const int64_t nb = a.qx->blocks;
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = a.w->row(r0 + r);
      __m256 acc[T];
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i wv = load_block(Q{}, wr, b);
        const float wd = Q::scale(wr, b);
        KVSERVE_UNROLL
        for (int t = 0; t < T; ++t) {
          const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.qx->row_qs(t0 + t) + b * 32));
          acc[t] = _mm256_fmadd_ps(block_dot(wv, xv), _mm256_set1_ps(wd * a.qx->row_d(t0 + t)[b]), acc[t]);
        }
      }
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.w->rows + r0 + r] = simd::hsum8(acc[t]);
    }
  }
};

#else

template <class Q>
using QuantKernel = ScalarQuantKernel<Q>;

#endif  // AVX2
#endif

// ---- Driver. ----

template <class K, int R>
void tile_tokens(const MatmulArgs& a, int64_t r0, int64_t t0, int64_t tokens) {
  static_assert(kTileTokens == 4);
  switch (tokens) {
    case 1: K::template tile<R, 1>(a, r0, t0); break;
    case 2: K::template tile<R, 2>(a, r0, t0); break;
    case 3: K::template tile<R, 3>(a, r0, t0); break;
    default: K::template tile<R, 4>(a, r0, t0); break;
  }
}

template <class K>
void tile(const MatmulArgs& a, int64_t r0, int64_t rows, int64_t t0, int64_t tokens) {
  static_assert(kTileRows == 4);
  switch (rows) {
    case 1: tile_tokens<K, 1>(a, r0, t0, tokens); break;
    case 2: tile_tokens<K, 2>(a, r0, t0, tokens); break;
    case 3: tile_tokens<K, 3>(a, r0, t0, tokens); break;
    default: tile_tokens<K, 4>(a, r0, t0, tokens); break;
  }
}

// Output rows [begin, end) for all n tokens.
template <class K>
void run_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  for (int64_t c0 = 0; c0 < a.n; c0 += kTokenChunk) {
    const int64_t c1 = std::min(a.n, c0 + kTokenChunk);
    for (int64_t r = begin; r < end; r += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, end - r);
      for (int64_t t = c0; t < c1; t += kTileTokens) {
        tile<K>(a, r, rows, t, std::min<int64_t>(kTileTokens, c1 - t));
      }
    }
  }
}

template <class K>
void run(const MatmulArgs& a, ThreadPool* pool) {
  if (pool == nullptr) {
    run_rows<K>(a, 0, a.w->rows);
    return;
  }
  // A thread done early takes the chunks a slower one has not reached (as
  // interleaved_matmul).
  pool->parallel_chunks(a.w->rows, pool->chunk_size(a.w->rows, kRowGrain),
                        [&](int64_t begin, int64_t end, int) { run_rows<K>(a, begin, end); });
}

// Reused across calls so decode does not allocate per projection. One per
// calling thread; the pool's workers only read it during the call.
QuantizedRows& activation_scratch() {
  thread_local QuantizedRows scratch;
  return scratch;
}

}  // namespace

void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n, ThreadPool* pool) {
  if (n <= 0 || w.rows <= 0) return;
  if (w.interleaved != nullptr) {
    interleaved_matmul(*w.interleaved, x, y, n, pool);
    return;
  }
  MatmulArgs a{&w, x, nullptr, y, n};
  switch (w.type) {
    case WeightType::F32: run<FloatKernel<float>>(a, pool); return;
    case WeightType::F16: run<FloatKernel<fp16_t>>(a, pool); return;
    case WeightType::Q8_0:
    case WeightType::Q4_0:
    case WeightType::Q4_1: {
      QuantizedRows& qx = activation_scratch();
      quantize_rows_q8(x, n, w.cols, pool, qx);
      a.qx = &qx;
      if (w.type == WeightType::Q8_0) {
        run<QuantKernel<Q8Weights>>(a, pool);
      } else if (w.type == WeightType::Q4_0) {
        run<QuantKernel<Q4Weights>>(a, pool);
      } else {
        run<ScalarQuantKernel<Q4_1Weights>>(a, pool);
      }
      return;
    }
  }
}

void matmul_shared_input(std::initializer_list<const WeightMatrix*> ws, std::initializer_list<float*> ys,
                         const float* x, int64_t n, ThreadPool* pool) {
  if (ws.size() != ys.size()) fail("matmul_shared_input: {} matrices but {} outputs", ws.size(), ys.size());
  constexpr int kMax = 4;
  const InterleavedWeights* packed[kMax];
  int count = 0;
  bool all_interleaved = ws.size() <= kMax;
  for (const WeightMatrix* w : ws) {
    all_interleaved = all_interleaved && w->interleaved != nullptr;
    if (all_interleaved) packed[count++] = w->interleaved;
  }
  if (all_interleaved) {
    interleaved_matmul_many(packed, ys.begin(), count, x, n, pool);
    return;
  }
  auto y = ys.begin();
  for (const WeightMatrix* w : ws) matmul(*w, x, *y++, n, pool);
}

void matmul_reference(const WeightMatrix& w, const float* x, float* y, int64_t n) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w, r, row.data());
    for (int64_t t = 0; t < n; ++t) {
      const float* xt = x + t * w.cols;
      double sum = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) sum += double(row[size_t(k)]) * double(xt[k]);
      y[t * w.rows + r] = float(sum);
    }
  }
}

}  // namespace kvserve

#undef KVSERVE_UNROLL
#undef KVSERVE_NO_VECTORIZE
