// Interleaved Q8_0/Q4_0/Q4_1 matmul: packing, activation tiles and the
// kernels (AVX-512 VNNI: 16 rows per register; AVX2: 8, and Q4_1).
//
// vpdpbusd multiplies unsigned by signed bytes. Here the weights are the
// unsigned operand (q + off: off = 128 for Q8_0, stored so; 8 for Q4_0's raw
// nibbles) and the activations the signed one, so
//   sum (q + off) x = sum q x + off sum x,
// and the correction -off sum x depends on (token, block) only: sum x is
// computed when the activations are quantized and seeds the block's sum.
// AVX2 without VNNI multiplies with vpmaddubsw, whose 16-bit pair sums would
// overflow on (q + 128) x; its Q8_0 path takes |q| times x sign(q) instead.
//
// Q4_1 (x = d q + m, q the raw nibble) needs no offset: its block sum is
// sum q x as Q4_0's without the correction, and the min adds m dx sum x,
// sum x again from the activations' quantization:
//   out += float(sum q x) (d dx) + m (dx sum x).
#include "kernels/interleaved_weights.h"

#include "util/simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/quantize_q8.h"
#include "util/aligned_buffer.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace kvserve {

namespace {

constexpr int kGroupRows = InterleavedWeights::kRows;
constexpr int kTileTokens = 16;       // tokens per activation tile (ActivationTiles)
constexpr int64_t kTokenChunk = 64;   // tokens whose tiles reuse a group's weights from L1/L2
constexpr int64_t kBlockValues = 32;
constexpr int64_t kStepBytes = 4 * kGroupRows;  // one vector: 4 bytes of each row
constexpr int64_t kQ8Steps = 8;       // steps per block (see InterleavedWeights::qs)
constexpr int64_t kQ4Steps = 4;  // Q4_0 and Q4_1
constexpr int64_t kParallelMinValues = 1 << 16;  // below: one thread quantizes the activations

int64_t steps_per_block(WeightType t) { return t == WeightType::Q8_0 ? kQ8Steps : kQ4Steps; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSERVE_INTERLEAVED 1
#define KVSERVE_INTERLEAVED_512 1
// Tokens per kernel call: 16 accumulators + 8 weight vectors.
constexpr int kCallTokens = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_INTERLEAVED 1
// Tokens per kernel call: with 16 registers, 4 tokens' integer and float
// sums beside a step's weights.
constexpr int kCallTokens = 4;
#endif

#if defined(KVSERVE_INTERLEAVED)
static_assert(kTileTokens % kCallTokens == 0, "a kernel call stays within one activation tile");
#define KVSERVE_UNROLL _Pragma("GCC unroll 16")

// Activations for the kernel, in tiles of 16 tokens so that a tile's block b
// is one contiguous run: (tiles, blocks, 16 tokens) of 32 quants, a scale,
// sum q, and d sum q (Q4_1's min term, so its kernel need not form it per row group).
struct ActivationTiles {
  int64_t n = 0, blocks = 0;
  AlignedBuffer<int8_t> qs;
  AlignedBuffer<float> d;
  AlignedBuffer<int32_t> sum;
  AlignedBuffer<float> dsum;

  size_t slot(int64_t t, int64_t b) const {
    return size_t(((t / kTileTokens) * blocks + b) * kTileTokens + t % kTileTokens);
  }
};

// Sum of a block's 32 quants: sad sums the unsigned bytes q + 128.
int32_t block_sum(const int8_t* q) {
  const __m256i u =
      _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)), _mm256_set1_epi8(char(0x80)));
  const __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());
  const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return int32_t(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 128 * int32_t(kBlockValues);
}

void quantize_tiles(const float* x, int64_t n, int64_t cols, ThreadPool* pool, ActivationTiles& out) {
  out.n = n;
  out.blocks = cols / kBlockValues;
  const size_t slots = size_t((n + kTileTokens - 1) / kTileTokens * kTileTokens * out.blocks);
  if (out.d.size() < slots) {
    out.qs.resize(slots * kBlockValues);
    out.d.resize(slots);
    out.sum.resize(slots);
    out.dsum.resize(slots);
  }
  auto rows = [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < out.blocks; ++b) {
        const size_t s = out.slot(t, b);
        int8_t* q = out.qs.data() + s * kBlockValues;
        quantize_block_q8(x + t * cols + b * kBlockValues, q, out.d.data() + s);
        out.sum[s] = block_sum(q);
        out.dsum[s] = out.d[s] * float(out.sum[s]);
      }
    }
  };
  if (pool != nullptr && n * cols >= kParallelMinValues) {
    pool->parallel_for(n, 1, rows);
  } else {
    rows(0, n, 0);
  }
}

ActivationTiles& activation_scratch() {
  thread_local ActivationTiles scratch;
  return scratch;
}


inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One kernel call's place, block by block: group g's weights, scales (and
// mins, for a B with them), and the activations of tokens [t0, ...) in their
// tile. next() moves them all to the following block.
template <class B>
struct BlockCursor {
  const uint8_t* wq;
  const uint16_t* wd;
  const uint16_t* wm = nullptr;  // B::kMin only
  const int8_t* xq;
  const float* xd;
  const int32_t* xs;
  const float* xds = nullptr;  // B::kMin only

  BlockCursor(const InterleavedWeights& w, const ActivationTiles& a, int64_t g, int64_t t0) {
    const size_t first = a.slot(t0, 0);
    wq = w.qs.data() + size_t(g * w.blocks * B::kBytes);
    wd = w.d.data() + size_t(g * w.blocks * kGroupRows);
    if constexpr (B::kMin) wm = w.m.data() + size_t(g * w.blocks * kGroupRows);
    xq = a.qs.data() + first * kBlockValues;
    xd = a.d.data() + first;
    xs = a.sum.data() + first;
    if constexpr (B::kMin) xds = a.dsum.data() + first;
  }
  void next() {
    wq += B::kBytes;
    wd += kGroupRows;
    if constexpr (B::kMin) wm += kGroupRows;
    xq += kTileTokens * kBlockValues;
    xd += kTileTokens;
    xs += kTileTokens;
    if constexpr (B::kMin) xds += kTileTokens;
  }
};

#if defined(KVSERVE_INTERLEAVED_512)

// The unsigned weight vectors of one block in value order: vector i holds
// values 4i..4i+3 of each of the 16 rows.
struct Q8Block {
  static constexpr int kOffset = 128;
  static constexpr bool kMin = false;
  static constexpr int64_t kBytes = kQ8Steps * kStepBytes;
  static void load(const uint8_t* p, __m512i (&wv)[8]) {
    KVSERVE_UNROLL
    for (int i = 0; i < 8; ++i) wv[i] = _mm512_load_si512(p + i * kStepBytes);
  }
};

struct Q4Block {
  static constexpr int kOffset = 8;
  static constexpr bool kMin = false;
  static constexpr int64_t kBytes = kQ4Steps * kStepBytes;
  static void load(const uint8_t* p, __m512i (&wv)[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    KVSERVE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_load_si512(p + i * kStepBytes);
      wv[i] = _mm512_and_si512(v, low);                             // values 4i..4i+3
      wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // values 16+4i..
    }
  }
};

// Rows [16 g, 16 g + 16) for tokens [t0, t0 + T) of one tile.
template <class B, int T>
void group_tile(const InterleavedWeights& w, const ActivationTiles& a, int64_t g, int64_t t0, float* y) {
  BlockCursor<B> c(w, a, g, t0);
  __m512 out[T];
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) out[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    // Eight blocks ahead: the group's weights are one sequential stream.
    KVSERVE_UNROLL
    for (int64_t off = 0; off < B::kBytes; off += kStepBytes)
      _mm_prefetch(reinterpret_cast<const char*>(c.wq + 8 * B::kBytes + off), _MM_HINT_T0);
    __m512i wv[8];
    B::load(c.wq, wv);
    const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(c.wd)));
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      const int8_t* xt = c.xq + t * kBlockValues;
      // Two chains of four halve the dependent vpdpbusd latency per token.
      __m512i s0 = _mm512_set1_epi32(-B::kOffset * c.xs[t]);
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(load_i32(xt + 4)));
      s0 = _mm512_dpbusd_epi32(s0, wv[0], _mm512_set1_epi32(load_i32(xt)));
      KVSERVE_UNROLL
      for (int i = 2; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[i], _mm512_set1_epi32(load_i32(xt + 4 * i)));
        s1 = _mm512_dpbusd_epi32(s1, wv[i + 1], _mm512_set1_epi32(load_i32(xt + 4 * i + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      out[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(c.xd[t])), out[t]);
    }
    c.next();
  }
  const int64_t live = std::min<int64_t>(kGroupRows, w.rows - g * kGroupRows);
  const __mmask16 mask = __mmask16((1u << live) - 1);
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + g * kGroupRows, mask, out[t]);
}

#else  // AVX2

// The 256-bit kernel. A block's steps stream through one register each (8
// of them would leave too few for the tokens' sums); each step meets the
// call's tokens in turn. Block sums come out in int32 with the offset
// correction applied, as the 512-bit kernel's.
struct Q8Block {
  static constexpr bool kMin = false;
  static constexpr int64_t kBytes = kQ8Steps * kStepBytes;
  template <int T>
  static void dot(const uint8_t* p, const int8_t* xq, const int32_t* xs, __m256i (&sum)[T]) {
#if defined(__AVXVNNI__)
    // A token's chain of 8 dependent vpdpbusd would set the pace of a call
    // with few tokens (decode's one): below 4, even and odd steps take
    // separate chains. (At 4 tokens two chains measured the same.)
    constexpr int C = T < 4 ? 2 : 1;
    __m256i acc[C][T];
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      acc[0][t] = _mm256_set1_epi32(-128 * xs[t]);
      if constexpr (C == 2) acc[1][t] = _mm256_setzero_si256();
    }
    KVSERVE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i * kStepBytes));
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t)
        acc[i % C][t] = _mm256_dpbusd_avx_epi32(acc[i % C][t], wv,
                                                _mm256_set1_epi32(load_i32(xq + t * kBlockValues + 4 * i)));
    }
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) sum[t] = C == 2 ? _mm256_add_epi32(acc[0][t], acc[C - 1][t]) : acc[0][t];
#else
    // |q| (unsigned, up to 128 for q = -128) times x sign(q) (|x| <= 127):
    // pair sums stay within int16.
    const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) sum[t] = _mm256_setzero_si256();
    KVSERVE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const __m256i q = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + i * kStepBytes)), flip);
      const __m256i magnitude = _mm256_abs_epi8(q);
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) {
        const __m256i x = _mm256_set1_epi32(load_i32(xq + t * kBlockValues + 4 * i));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q));
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(pairs, ones));
      }
    }
#endif
  }
};

// Q4_0 (kMin false: nibble q + 8, the sums corrected by -8 sum x) and Q4_1
// (kMin: nibble q, no correction; group_tile adds the min term).
template <bool kWithMin>
struct NibbleBlock {
  static constexpr bool kMin = kWithMin;
  static constexpr int kOffset = kWithMin ? 0 : 8;
  static constexpr int64_t kBytes = kQ4Steps * kStepBytes;
  // Calls meet(t, lo, hi, x_lo, x_hi) for each step and token: step i's low
  // nibbles (values 4i..4i+3 of each row) and high ones (16+4i..), and the
  // token's four activation bytes for each, broadcast.
  template <int T, class Meet>
  static void for_each_step(const uint8_t* p, const int8_t* xq, Meet&& meet) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    KVSERVE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i * kStepBytes));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) {
        const int8_t* xt = xq + t * kBlockValues;
        meet(t, lo, hi, _mm256_set1_epi32(load_i32(xt + 4 * i)), _mm256_set1_epi32(load_i32(xt + 16 + 4 * i)));
      }
    }
  }
  template <int T>
  static void dot(const uint8_t* p, const int8_t* xq, const int32_t* xs, __m256i (&sum)[T]) {
#if defined(__AVXVNNI__)
    // Low and high nibbles are two chains already.
    __m256i high[T];
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      sum[t] = _mm256_set1_epi32(-kOffset * xs[t]);
      high[t] = _mm256_setzero_si256();
    }
    for_each_step<T>(p, xq, [&](int t, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
      sum[t] = _mm256_dpbusd_avx_epi32(sum[t], lo, x_lo);
      high[t] = _mm256_dpbusd_avx_epi32(high[t], hi, x_hi);
    });
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) sum[t] = _mm256_add_epi32(sum[t], high[t]);
#else
    // Nibbles (0..15) times x: a pair is at most 2 * 15 * 127 = 3810, so a
    // whole block's eight pair sums add up in int16 (30480) before one
    // widening vpmaddwd.
    __m256i pairs[T];
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) pairs[t] = _mm256_setzero_si256();
    for_each_step<T>(p, xq, [&](int t, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
      pairs[t] = _mm256_add_epi16(pairs[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi)));
    });
    const __m256i ones = _mm256_set1_epi16(1);
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t)
      sum[t] = _mm256_add_epi32(_mm256_madd_epi16(pairs[t], ones), _mm256_set1_epi32(-kOffset * xs[t]));
#endif
  }
};
using Q4Block = NibbleBlock<false>;
using Q4_1Block = NibbleBlock<true>;

// Rows [8 g, 8 g + 8) for tokens [t0, t0 + T) of one tile.
template <class B, int T>
void group_tile(const InterleavedWeights& w, const ActivationTiles& a, int64_t g, int64_t t0, float* y) {
  BlockCursor<B> c(w, a, g, t0);
  __m256 out[T];
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) out[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    // Sixteen blocks ahead: the 512-bit kernel's distance in bytes (8 of
    // its blocks). Decode (one token, from DRAM) took 2-6% longer with 8.
    KVSERVE_UNROLL
    for (int64_t off = 0; off < B::kBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c.wq + 16 * B::kBytes + off), _MM_HINT_T0);
    __m256i sum[T];
    B::template dot<T>(c.wq, c.xq, c.xs, sum);
    const __m256 scale = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(c.wd)));
    if constexpr (B::kMin) {
      // m (dx sum x) as the addend of the scaled sum's FMA: out's own chain
      // stays one dependent operation per block.
      const __m256 mins = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(c.wm)));
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t) {
        const __m256 min_term = _mm256_mul_ps(mins, _mm256_broadcast_ss(c.xds + t));
        const __m256 block =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(scale, _mm256_set1_ps(c.xd[t])), min_term);
        out[t] = _mm256_add_ps(out[t], block);
      }
    } else {
      KVSERVE_UNROLL
      for (int t = 0; t < T; ++t)
        out[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(scale, _mm256_set1_ps(c.xd[t])), out[t]);
    }
    c.next();
  }
  const int64_t live = std::min<int64_t>(kGroupRows, w.rows - g * kGroupRows);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) _mm256_maskstore_ps(y + (t0 + t) * w.rows + g * kGroupRows, mask, out[t]);
}

#endif  // AVX2

template <int... Ts>
void dispatch_tile(int tokens, const InterleavedWeights& w, const ActivationTiles& a, int64_t g, int64_t t0,
                   float* y, std::integer_sequence<int, Ts...>) {
  if (w.type == WeightType::Q8_0) {
    ((tokens == Ts + 1 ? group_tile<Q8Block, Ts + 1>(w, a, g, t0, y) : void()), ...);
  } else if (w.type == WeightType::Q4_0) {
    ((tokens == Ts + 1 ? group_tile<Q4Block, Ts + 1>(w, a, g, t0, y) : void()), ...);
  } else {
#if defined(KVSERVE_INTERLEAVED_512)
    // No 512-bit Q4_1 kernel: make_interleaved never makes a Q4_1 copy here.
    fail("interleaved matmul: no Q4_1 kernel in the AVX-512 VNNI build");
#else
    ((tokens == Ts + 1 ? group_tile<Q4_1Block, Ts + 1>(w, a, g, t0, y) : void()), ...);
#endif
  }
}

// Groups [begin, end) of the matrices laid end to end, for all tokens.
void run_groups(const InterleavedWeights* const* ws, float* const* ys, const ActivationTiles& a, int64_t begin,
                int64_t end) {
  for (int64_t c0 = 0; c0 < a.n; c0 += kTokenChunk) {
    const int64_t c1 = std::min(a.n, c0 + kTokenChunk);
    int m = 0;
    int64_t first = 0;  // global index of matrix m's group 0
    for (int64_t g = begin; g < end; ++g) {
      while (g >= first + ws[m]->groups) first += ws[m++]->groups;
      for (int64_t t = c0; t < c1; t += kCallTokens) {
        const int tokens = int(std::min<int64_t>(kCallTokens, c1 - t));
        dispatch_tile(tokens, *ws[m], a, g - first, t, ys[m], std::make_integer_sequence<int, kCallTokens>{});
      }
    }
  }
}

#undef KVSERVE_UNROLL
#endif

}  // namespace

bool interleaved_weights_supported() {
#if defined(KVSERVE_INTERLEAVED)
  return true;
#else
  return false;
#endif
}

bool native_q4_1_supported() {
#if defined(KVSERVE_INTERLEAVED) && !defined(KVSERVE_INTERLEAVED_512)
  return true;
#else
  return false;
#endif
}

std::unique_ptr<InterleavedWeights> make_interleaved(const WeightMatrix& w) {
  if (!interleaved_weights_supported() || w.rows <= 0) return nullptr;
  if (w.type != WeightType::Q8_0 && w.type != WeightType::Q4_0 && w.type != WeightType::Q4_1) return nullptr;
  if (w.type == WeightType::Q4_1 && !native_q4_1_supported()) return nullptr;
  auto p = std::make_unique<InterleavedWeights>();
  p->type = w.type;
  p->rows = w.rows;
  p->cols = w.cols;
  p->groups = (w.rows + kGroupRows - 1) / kGroupRows;
  p->blocks = w.cols / kBlockValues;
  const int64_t steps = steps_per_block(w.type);
  const int64_t block_bytes = steps * kStepBytes;  // interleaved, per (group, block)
  const int64_t quant_bytes = steps * 4;           // one row's quants per block in the checkpoint
  const bool q8 = w.type == WeightType::Q8_0, with_min = w.type == WeightType::Q4_1;
  const int64_t header_bytes = with_min ? 4 : 2;   // fp16 d (and m) before a block's quants
  p->qs.resize(size_t(p->groups * p->blocks * block_bytes));
  p->d.resize(size_t(p->groups * p->blocks * kGroupRows));
  if (with_min) p->m.resize(p->d.size());
  // Stored quants are q + 128 (Q8_0: flip the sign bit) or the raw nibble bytes.
  const uint32_t flip = q8 ? 0x80808080u : 0u;
  // A padding row's quants: q = 0 (Q4_1: code 0; its d and m are 0 anyway).
  const int pad = q8 ? 0x80 : with_min ? 0x00 : 0x88;
  for (int64_t r = 0; r < p->groups * kGroupRows; ++r) {
    const int64_t g = r / kGroupRows, lane = r % kGroupRows;
    const uint8_t* src = r < w.rows ? w.row(r) : nullptr;
    for (int64_t b = 0; b < p->blocks; ++b) {
      const size_t gb = size_t(g * p->blocks + b);
      uint8_t* dst = p->qs.data() + gb * size_t(block_bytes) + size_t(lane) * 4;
      if (src == nullptr) {  // padding row: q = 0, d = m = 0 (the buffers are zeroed)
        for (int64_t i = 0; i < steps; ++i) std::memset(dst + i * kStepBytes, pad, 4);
        continue;
      }
      const uint8_t* block = src + b * (header_bytes + quant_bytes);
      std::memcpy(&p->d[gb * kGroupRows + size_t(lane)], block, 2);
      if (with_min) std::memcpy(&p->m[gb * kGroupRows + size_t(lane)], block + 2, 2);
      for (int64_t i = 0; i < steps; ++i) {
        uint32_t v;
        std::memcpy(&v, block + header_bytes + 4 * i, 4);
        v ^= flip;
        std::memcpy(dst + i * kStepBytes, &v, 4);
      }
    }
  }
  return p;
}

void interleaved_matmul(const InterleavedWeights& w, const float* x, float* y, int64_t n, ThreadPool* pool) {
  const InterleavedWeights* ws[] = {&w};
  float* ys[] = {y};
  interleaved_matmul_many(ws, ys, 1, x, n, pool);
}

void interleaved_matmul_many(const InterleavedWeights* const* ws, float* const* ys, int count, const float* x,
                             int64_t n, ThreadPool* pool) {
#if defined(KVSERVE_INTERLEAVED)
  if (n <= 0 || count <= 0) return;
  int64_t groups = 0;
  for (int i = 0; i < count; ++i) {
    if (ws[i]->cols != ws[0]->cols) fail("interleaved matmul: matrices over one input differ in cols");
    groups += ws[i]->groups;
  }
  ActivationTiles& a = activation_scratch();
  quantize_tiles(x, n, ws[0]->cols, pool, a);
  if (pool == nullptr) {
    run_groups(ws, ys, a, 0, groups);
    return;
  }
  // In chunks of groups: the cores of a shared host stream at different
  // speeds from call to call, and a thread done early takes the chunks the
  // other has not reached (ThreadPool::parallel_chunks).
  pool->parallel_chunks(groups, pool->chunk_size(groups, 1),
                        [&](int64_t begin, int64_t end, int) { run_groups(ws, ys, a, begin, end); });
#else
  fail("interleaved matmul: this build has no AVX-512 VNNI or AVX2 kernel");
#endif
}

}  // namespace kvserve
