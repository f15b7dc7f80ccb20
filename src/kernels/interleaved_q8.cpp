// Interleaved Q8_0 matmul: packing, activation tiles and the VNNI kernel.
//
// vpdpbusd multiplies unsigned by signed bytes. Here the weights are the
// unsigned operand (q + 128, stored so) and the activations the signed one, so
//   sum (q + 128) x = sum q x + 128 sum x,
// and the correction -128 sum x depends on (token, block) only: it is computed
// when the activations are quantized and seeds the block's integer sum.
#include "kernels/interleaved_q8.h"

#include "util/simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/quantize_q8.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace kvserve {

namespace {

constexpr int kGroupRows = InterleavedQ8::kRows;
constexpr int kTileTokens = 16;       // tokens per kernel call: 16 accumulators + 8 weight vectors
constexpr int64_t kTokenChunk = 64;   // tokens whose tiles reuse a group's weights from L1/L2
constexpr int64_t kBlockValues = 32;
constexpr int64_t kStepBytes = 64;    // one vector: 4 values of each of 16 rows
constexpr int64_t kBlockBytes = 8 * kStepBytes;
constexpr int64_t kQ8BlockBytes = 34;
constexpr int64_t kParallelMinValues = 1 << 16;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSERVE_INTERLEAVED_Q8 1

#define KVSERVE_UNROLL _Pragma("GCC unroll 16")

// Activations for the kernel, in tiles of 16 tokens so that a tile's block b
// is one contiguous run: (tiles, blocks, 16 tokens) of 32 quants, a scale and
// the seed -128 * sum q.
struct ActivationTiles {
  int64_t n = 0, blocks = 0;
  AlignedBuffer<int8_t> qs;
  AlignedBuffer<float> d;
  AlignedBuffer<int32_t> seed;

  size_t slot(int64_t t, int64_t b) const {
    return size_t(((t / kTileTokens) * blocks + b) * kTileTokens + t % kTileTokens);
  }
};

// Sum of a block's 32 quants: sad sums the unsigned bytes q + 128.
int32_t block_sum(const int8_t* q) {
  const __m256i u = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)), _mm256_set1_epi8(char(0x80)));
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
    out.seed.resize(slots);
  }
  auto rows = [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < out.blocks; ++b) {
        const size_t s = out.slot(t, b);
        int8_t* q = out.qs.data() + s * kBlockValues;
        quantize_block_q8(x + t * cols + b * kBlockValues, q, out.d.data() + s);
        out.seed[s] = -128 * block_sum(q);
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

// Rows [16 g, 16 g + 16) for tokens [t0, t0 + T) of one tile.
template <int T>
void group_tile(const InterleavedQ8& w, const ActivationTiles& a, int64_t g, int64_t t0, float* y) {
  const int64_t nb = w.blocks;
  const uint8_t* wq = w.qs.data() + size_t(g * nb * kBlockBytes);
  const uint16_t* wd = w.d.data() + size_t(g * nb * kGroupRows);
  const size_t first = a.slot(t0, 0);
  const int8_t* xq = a.qs.data() + first * kBlockValues;
  const float* xd = a.d.data() + first;
  const int32_t* xs = a.seed.data() + first;

  __m512 out[T];
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) out[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // Eight blocks ahead: the group's weights are one sequential stream.
    KVSERVE_UNROLL
    for (int i = 0; i < 8; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(wq + 8 * kBlockBytes + i * kStepBytes), _MM_HINT_T0);
    __m512i wv[8];
    KVSERVE_UNROLL
    for (int i = 0; i < 8; ++i) wv[i] = _mm512_load_si512(wq + i * kStepBytes);
    const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(wd)));
    KVSERVE_UNROLL
    for (int t = 0; t < T; ++t) {
      const int8_t* xt = xq + t * kBlockValues;
      // Two chains of four halve the dependent vpdpbusd latency per token.
      __m512i s0 = _mm512_set1_epi32(xs[t]);
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(load_i32(xt + 4)));
      s0 = _mm512_dpbusd_epi32(s0, wv[0], _mm512_set1_epi32(load_i32(xt)));
      KVSERVE_UNROLL
      for (int i = 2; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[i], _mm512_set1_epi32(load_i32(xt + 4 * i)));
        s1 = _mm512_dpbusd_epi32(s1, wv[i + 1], _mm512_set1_epi32(load_i32(xt + 4 * i + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      out[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xd[t])), out[t]);
    }
    wq += kBlockBytes;
    wd += kGroupRows;
    xq += kTileTokens * kBlockValues;
    xd += kTileTokens;
    xs += kTileTokens;
  }
  const int64_t live = std::min<int64_t>(kGroupRows, w.rows - g * kGroupRows);
  const __mmask16 mask = __mmask16((1u << live) - 1);
  KVSERVE_UNROLL
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + g * kGroupRows, mask, out[t]);
}

template <int... Ts>
void dispatch_tile(int tokens, const InterleavedQ8& w, const ActivationTiles& a, int64_t g, int64_t t0,
                   float* y, std::integer_sequence<int, Ts...>) {
  ((tokens == Ts + 1 ? group_tile<Ts + 1>(w, a, g, t0, y) : void()), ...);
}

// Groups [begin, end) of the matrices laid end to end, for all tokens.
void run_groups(const InterleavedQ8* const* ws, float* const* ys, const ActivationTiles& a, int64_t begin,
                int64_t end) {
  for (int64_t c0 = 0; c0 < a.n; c0 += kTokenChunk) {
    const int64_t c1 = std::min(a.n, c0 + kTokenChunk);
    int m = 0;
    int64_t first = 0;  // global index of matrix m's group 0
    for (int64_t g = begin; g < end; ++g) {
      while (g >= first + ws[m]->groups) first += ws[m++]->groups;
      for (int64_t t = c0; t < c1; t += kTileTokens) {
        const int tokens = int(std::min<int64_t>(kTileTokens, c1 - t));
        dispatch_tile(tokens, *ws[m], a, g - first, t, ys[m], std::make_integer_sequence<int, kTileTokens>{});
      }
    }
  }
}

#undef KVSERVE_UNROLL
#endif

}  // namespace

bool interleaved_q8_supported() {
#if defined(KVSERVE_INTERLEAVED_Q8)
  return true;
#else
  return false;
#endif
}

std::unique_ptr<InterleavedQ8> interleave_q8(const WeightMatrix& w) {
  if (!interleaved_q8_supported() || w.type != WeightType::Q8_0 || w.rows <= 0) return nullptr;
  auto p = std::make_unique<InterleavedQ8>();
  p->rows = w.rows;
  p->cols = w.cols;
  p->groups = (w.rows + kGroupRows - 1) / kGroupRows;
  p->blocks = w.cols / kBlockValues;
  p->qs.resize(size_t(p->groups * p->blocks * kBlockBytes));
  p->d.resize(size_t(p->groups * p->blocks * kGroupRows));
  std::memset(p->qs.data(), 0x80, p->qs.size());  // padding rows: q = 0 (and d = 0)
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t g = r / kGroupRows, lane = r % kGroupRows;
    const uint8_t* src = w.row(r);
    for (int64_t b = 0; b < p->blocks; ++b) {
      const uint8_t* block = src + b * kQ8BlockBytes;
      const size_t gb = size_t(g * p->blocks + b);
      std::memcpy(&p->d[gb * kGroupRows + size_t(lane)], block, 2);
      uint8_t* dst = p->qs.data() + gb * kBlockBytes + size_t(lane) * 4;
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 4; ++j) dst[i * kStepBytes + j] = uint8_t(block[2 + 4 * i + j] ^ 0x80);
    }
  }
  return p;
}

void interleaved_q8_matmul(const InterleavedQ8& w, const float* x, float* y, int64_t n, ThreadPool* pool) {
  const InterleavedQ8* ws[] = {&w};
  float* ys[] = {y};
  interleaved_q8_matmul_many(ws, ys, 1, x, n, pool);
}

void interleaved_q8_matmul_many(const InterleavedQ8* const* ws, float* const* ys, int count, const float* x,
                                int64_t n, ThreadPool* pool) {
#if defined(KVSERVE_INTERLEAVED_Q8)
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
  pool->parallel_for(groups, 2, [&](int64_t begin, int64_t end, int) { run_groups(ws, ys, a, begin, end); });
#else
  fail("interleaved Q8_0 matmul: this build has no AVX-512 VNNI kernel");
#endif
}

}  // namespace kvserve
