// FP16, BF16 and FP8 (E4M3 and E5M2) scalar conversions. FP16 uses the F16C
// instructions the target machines have; BF16 and FP8 round to nearest even.
#pragma once

#include "util/simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

using fp16_t = uint16_t;  // IEEE half, stored as raw bits
using bf16_t = uint16_t;  // bfloat16, stored as raw bits

inline float fp16_to_fp32(fp16_t h) { return _cvtsh_ss(h); }
inline fp16_t fp32_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

inline float bf16_to_fp32(bf16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline bf16_t fp32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16_t(bits >> 16);
}

// FP8 E4M3 as in the OCP 8-bit floating point spec ("E4M3FN", vLLM's
// fp8_e4m3 KV cache): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities, 0x7F / 0xFF are NaN, the largest finite value is 448 and the
// smallest subnormal 2^-9.
using fp8_t = uint8_t;

// The exponent and mantissa fields of finite magnitude a, rounded to nearest
// even on a minifloat with M mantissa bits and exponent bias Bias (subnormal
// below 2^(1 - Bias)); a must be below the format's saturation point.
template <int M, int Bias>
inline uint8_t round_minifloat_magnitude(float a) {
  constexpr float kMinNormal = 1.0f / float(1u << (Bias - 1));
  constexpr float kSubnormalSteps = float(1u << (Bias - 1 + M));  // subnormal steps per unit
  if (a < kMinNormal) return uint8_t(std::nearbyint(a * kSubnormalSteps));  // (1 << M): the smallest normal
  int e;
  const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): exponent e - 1, mantissa 2m - 1
  int q = int(std::nearbyint((2.0f * m - 1.0f) * float(1 << M)));  // exact products: powers of two
  int biased = e - 1 + Bias;
  if (q == (1 << M)) q = 0, ++biased;  // rounded up to the next binade
  return uint8_t((biased << M) | q);
}

// f as an 8-bit minifloat (sign bit 0x80): rounded to nearest even, NaN as
// nan_code, magnitudes from max_value up (infinities too) saturated to
// max_code, the largest finite one, as vLLM's saturating conversions do: a
// KV value that large is still kept as the largest one the type has.
template <int M, int Bias>
inline uint8_t fp32_to_minifloat(float f, float max_value, uint8_t max_code, uint8_t nan_code) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (std::isnan(f)) return uint8_t(sign | nan_code);
  if (a >= max_value) return uint8_t(sign | max_code);
  return uint8_t(sign | round_minifloat_magnitude<M, Bias>(a));
}

// Saturates at +-448; NaN is 0x7F.
inline fp8_t fp32_to_fp8(float f) { return fp32_to_minifloat<3, 7>(f, 448.0f, 0x7E, 0x7F); }

// The E4M3 bits moved into an FP16's (exponent over exponent, mantissa over
// the mantissa's top bits) read as that FP16 times 2^8: normals and
// subnormals alike, as both exponent biases differ by 8. The vector loads in
// kv/float_codecs.cpp do the same 16 or 8 at a time.
inline fp16_t fp8_as_scaled_fp16(fp8_t b) { return fp16_t(((b & 0x7F) << 7) | ((b & 0x80) << 8)); }
inline float fp8_to_fp32(fp8_t b) {
  if ((b & 0x7F) == 0x7F) return std::nanf("");
  return fp16_to_fp32(fp8_as_scaled_fp16(b)) * 256.0f;
}

// FP8 E5M2 as in the OCP spec (vLLM's fp8_e5m2 KV cache): the top byte of an
// FP16 — sign, 5 exponent bits (bias 15), 2 mantissa bits — with FP16's
// infinities and NaNs; the largest finite value is 57344 and the smallest
// subnormal 2^-16: twice E4M3's relative step, for a largest value 128 times
// E4M3's.
using fp8_e5m2_t = uint8_t;

// From the FP32 value (rounding through FP16 first would round twice);
// saturates at +-57344; NaN is 0x7E (FP16's quiet NaN's top byte).
inline fp8_e5m2_t fp32_to_fp8_e5m2(float f) { return fp32_to_minifloat<2, 15>(f, 57344.0f, 0x7B, 0x7E); }

// Exact: the byte is an FP16's top byte.
inline float fp8_e5m2_to_fp32(fp8_e5m2_t b) { return fp16_to_fp32(fp16_t(uint16_t(b) << 8)); }

}  // namespace kvserve
