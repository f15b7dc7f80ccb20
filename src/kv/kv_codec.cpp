#include "kv/kv_codec.h"

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "util/error.h"
#include "util/half.h"

namespace kvserve {
namespace {

// Loads 16 stored values of type T as floats.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const fp16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(fp16_t x) { return fp16_to_fp32(x); }

// Slab layout shared by the plain-float codecs: (block_size, head_dim) values
// of type T, token-major, so one token's vector is contiguous.
template <class T>
float dot_row(const float* q, const T* k, int head_dim) {
  int d = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  if (head_dim >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= head_dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; d < head_dim; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

template <class T>
void axpy_row(float w, const T* v, float* out, int head_dim) {
  int d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= head_dim; d += 16)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(wv, load16(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < head_dim; ++d) out[d] += w * to_float(v[d]);
}

template <class T, KvDType kType>
class PlainCodec final : public KvCodec {
 public:
  KvDType dtype() const override { return kType; }
  size_t slab_bytes(int block_size, int head_dim) const override {
    return size_t(block_size) * size_t(head_dim) * sizeof(T);
  }
  void encode(uint8_t* slab, int slot, const float* x, int head_dim) const override {
    T* dst = reinterpret_cast<T*>(slab) + size_t(slot) * head_dim;
    if constexpr (sizeof(T) == sizeof(float)) {
      std::memcpy(dst, x, sizeof(float) * size_t(head_dim));
    } else {
      for (int d = 0; d < head_dim; ++d) dst[d] = fp32_to_fp16(x[d]);
    }
  }
  void decode(const uint8_t* slab, int slot, float* out, int head_dim) const override {
    const T* src = reinterpret_cast<const T*>(slab) + size_t(slot) * head_dim;
    for (int d = 0; d < head_dim; ++d) out[d] = to_float(src[d]);
  }
  void score(const float* q, int n_q, const uint8_t* slab, int n, int head_dim, float scale,
             float* scores, int stride) const override {
    const T* k = reinterpret_cast<const T*>(slab);
    for (int t = 0; t < n; ++t, k += head_dim)
      for (int i = 0; i < n_q; ++i) scores[i * stride + t] = scale * dot_row(q + i * head_dim, k, head_dim);
  }
  void accumulate(const float* weights, int n_q, int stride, const uint8_t* slab, int n, int head_dim,
                  float* out) const override {
    const T* v = reinterpret_cast<const T*>(slab);
    for (int t = 0; t < n; ++t, v += head_dim)
      for (int i = 0; i < n_q; ++i) axpy_row(weights[i * stride + t], v, out + i * head_dim, head_dim);
  }
};

}  // namespace

std::string_view kv_dtype_name(KvDType t) {
  switch (t) {
    case KvDType::F32: return "fp32";
    case KvDType::F16: return "fp16";
  }
  return "?";
}

KvDType parse_kv_dtype(std::string_view name) {
  if (name == "fp32" || name == "f32") return KvDType::F32;
  if (name == "fp16" || name == "f16") return KvDType::F16;
  fail("unknown KV dtype '{}' (expected fp32 or fp16)", name);
}

const KvCodec& kv_codec(KvDType t) {
  static const PlainCodec<float, KvDType::F32> f32;
  static const PlainCodec<fp16_t, KvDType::F16> f16;
  switch (t) {
    case KvDType::F32: return f32;
    case KvDType::F16: return f16;
  }
  return f32;
}

void score_reference(const KvCodec& codec, const float* q, int n_q, const uint8_t* slab, int n,
                     int head_dim, float scale, float* scores, int stride) {
  std::vector<float> key(static_cast<size_t>(head_dim));
  for (int t = 0; t < n; ++t) {
    codec.decode(slab, t, key.data(), head_dim);
    for (int i = 0; i < n_q; ++i) {
      double sum = 0;
      for (int d = 0; d < head_dim; ++d) sum += double(q[i * head_dim + d]) * key[size_t(d)];
      scores[i * stride + t] = float(scale * sum);
    }
  }
}

void accumulate_reference(const KvCodec& codec, const float* weights, int n_q, int stride,
                          const uint8_t* slab, int n, int head_dim, float* out) {
  std::vector<float> value(static_cast<size_t>(head_dim));
  for (int t = 0; t < n; ++t) {
    codec.decode(slab, t, value.data(), head_dim);
    for (int i = 0; i < n_q; ++i)
      for (int d = 0; d < head_dim; ++d) out[i * head_dim + d] += weights[i * stride + t] * value[size_t(d)];
  }
}

}  // namespace kvserve
