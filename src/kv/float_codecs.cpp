#include "kv/float_codecs.h"

#include <immintrin.h>

#include <cstring>

#include "util/half.h"

namespace kvserve {
namespace {

struct F32Traits {
  using T = float;
  static T from(float x) { return x; }
  static float to(T x) { return x; }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#endif
};

struct F16Traits {
  using T = fp16_t;
  static T from(float x) { return fp32_to_fp16(x); }
  static float to(T x) { return fp16_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};

struct BF16Traits {
  using T = bf16_t;
  static T from(float x) { return fp32_to_bf16(x); }
  static float to(T x) { return bf16_to_fp32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
#endif
};

template <class Tr>
float dot_row(const float* q, const typename Tr::T* k, int n) {
  int d = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), Tr::load16(k + d), acc);
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; d < n; ++d) sum += q[d] * Tr::to(k[d]);
  return sum;
}

template <class Tr>
void axpy_row(float w, const typename Tr::T* v, float* out, int n) {
  int d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(wv, Tr::load16(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < n; ++d) out[d] += w * Tr::to(v[d]);
}

template <class Tr>
class FloatCodec final : public KvCodec {
  using T = typename Tr::T;

 public:
  FloatCodec(const KvCodecConfig& c, const KvBlockShape& s) : KvCodec(c, s) {}

  size_t block_bytes() const override { return size_t(shape_.block_size) * size_t(shape_.kv_dim()) * sizeof(T); }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    T* dst = row(block, slot);
    for (int d = 0; d < shape_.kv_dim(); ++d) dst[d] = Tr::from(x[d]);
  }
  void decode_token(const uint8_t* block, int slot, float* out) const override {
    const T* src = row(block, slot);
    for (int d = 0; d < shape_.kv_dim(); ++d) out[d] = Tr::to(src[d]);
  }
  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    const int hd = shape_.head_dim;
    for (int t = 0; t < n; ++t) {
      const T* k = row(block, t) + kv_head * hd;
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot_row<Tr>(q + i * hd, k, hd);
    }
  }
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                    float* scores, int stride) const override {
    const int hd = shape_.head_dim;
    for (int t = 0; t < n; ++t) {
      const T* k = row(block, t) + kv_head * hd;
      for (int i = 0; i < n_q; ++i)
        scores[i * stride + t] = scale * dot_row<Tr>(q + (size_t(t) * n_q + i) * hd, k, hd);
    }
  }
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    const int hd = shape_.head_dim;
    for (int t = 0; t < n; ++t) {
      const T* v = row(block, t) + kv_head * hd;
      for (int i = 0; i < n_q; ++i) axpy_row<Tr>(weights[i * stride + t], v, out + i * hd, hd);
    }
  }

 private:
  T* row(uint8_t* block, int slot) const { return reinterpret_cast<T*>(block) + size_t(slot) * shape_.kv_dim(); }
  const T* row(const uint8_t* block, int slot) const {
    return reinterpret_cast<const T*>(block) + size_t(slot) * shape_.kv_dim();
  }
};

}  // namespace

std::unique_ptr<KvCodec> make_float_codec(const KvCodecConfig& config, const KvBlockShape& shape) {
  switch (config.dtype) {
    case KvDType::F16: return std::make_unique<FloatCodec<F16Traits>>(config, shape);
    case KvDType::BF16: return std::make_unique<FloatCodec<BF16Traits>>(config, shape);
    default: return std::make_unique<FloatCodec<F32Traits>>(config, shape);
  }
}

}  // namespace kvserve
