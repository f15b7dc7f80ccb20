// FP16 and BF16 scalar conversions. FP16 uses the F16C instructions the
// target machines have; BF16 rounds to nearest even.
#pragma once

#include "util/simd.h"

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

}  // namespace kvserve
