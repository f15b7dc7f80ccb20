// Scalar conversions of util/half.h, FP8 E4M3 and E5M2 against the formats' definitions.
#include "util/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kvserve {
namespace {

// The value of an E4M3 code from its fields (NaN for 0x7F / 0xFF).
double e4m3_value(int code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xF, mant = code & 7;
  if (exp == 15 && mant == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? mant / 8.0 * std::ldexp(1.0, -6) : (1 + mant / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}

TEST(Fp8, EveryCodeDecodesToItsValueAndBack) {
  for (int code = 0; code < 256; ++code) {
    const double want = e4m3_value(code);
    const float got = fp8_to_fp32(fp8_t(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      EXPECT_EQ(fp32_to_fp8(got) & 0x7F, 0x7F) << code;
      continue;
    }
    EXPECT_EQ(double(got), want) << code;
    if (code == 0x80) continue;  // -0 encodes back as -0 (0x80) too, checked below
    EXPECT_EQ(int(fp32_to_fp8(got)), code) << code;
  }
  EXPECT_EQ(int(fp32_to_fp8(-0.0f)), 0x80);
  EXPECT_EQ(fp8_to_fp32(0x7E), 448.0f);
  EXPECT_EQ(fp8_to_fp32(0x01), std::ldexp(1.0f, -9));
}

// Every float between codes rounds to the nearer one, ties to the even
// mantissa; past 448 it saturates.
TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 0x7E; ++code) {
    const double lo = e4m3_value(code), hi = e4m3_value(code + 1);
    const float mid = float((lo + hi) / 2);  // exact in float: a few bits more than the codes
    const int even = (code & 1) == 0 ? code : code + 1;
    EXPECT_EQ(int(fp32_to_fp8(mid)), even) << code;
    EXPECT_EQ(int(fp32_to_fp8(std::nextafter(mid, 0.0f))), code) << code;
    EXPECT_EQ(int(fp32_to_fp8(std::nextafter(mid, 1e9f))), code + 1) << code;
    EXPECT_EQ(int(fp32_to_fp8(-std::nextafter(mid, 0.0f))), code | 0x80) << code;
  }
  EXPECT_EQ(int(fp32_to_fp8(464.0f)), 0x7E);  // the tie with the missing 480
  EXPECT_EQ(int(fp32_to_fp8(1e6f)), 0x7E);
  EXPECT_EQ(int(fp32_to_fp8(-std::numeric_limits<float>::infinity())), 0xFE);
  EXPECT_EQ(int(fp32_to_fp8(std::ldexp(1.0f, -11))), 0x00);  // a quarter of the smallest subnormal
  EXPECT_EQ(fp32_to_fp8(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

// The value of an E5M2 code from its fields (+-inf for 0x7C / 0xFC, NaN above).
double e5m2_value(int code) {
  const int sign = code >> 7, exp = (code >> 2) & 0x1F, mant = code & 3;
  if (exp == 31) return mant == 0 ? (sign ? -INFINITY : INFINITY) : std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? mant / 4.0 * std::ldexp(1.0, -14) : (1 + mant / 4.0) * std::ldexp(1.0, exp - 15);
  return sign ? -mag : mag;
}

TEST(Fp8E5M2, EveryCodeDecodesToItsValueAndBack) {
  for (int code = 0; code < 256; ++code) {
    const double want = e5m2_value(code);
    const float got = fp8_e5m2_to_fp32(fp8_e5m2_t(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      EXPECT_TRUE(std::isnan(fp8_e5m2_to_fp32(fp32_to_fp8_e5m2(got)))) << code;
      continue;
    }
    EXPECT_EQ(double(got), want) << code;
    if (std::isinf(want) || code == 0x80) continue;  // infinities saturate; -0 checked below
    EXPECT_EQ(int(fp32_to_fp8_e5m2(got)), code) << code;
  }
  EXPECT_EQ(int(fp32_to_fp8_e5m2(-0.0f)), 0x80);
  EXPECT_EQ(fp8_e5m2_to_fp32(0x7B), 57344.0f);
  EXPECT_EQ(fp8_e5m2_to_fp32(0x01), std::ldexp(1.0f, -16));
}

// As E4M3: nearest, ties to the even mantissa, from the FP32 value itself
// (a tie between two E5M2 codes is an FP16 value, so rounding through FP16
// first would round twice only off ties; the checks either side of each tie
// catch that too); past 57344 and for infinities it saturates.
TEST(Fp8E5M2, RoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 0x7B; ++code) {
    const double lo = e5m2_value(code), hi = e5m2_value(code + 1);
    const float mid = float((lo + hi) / 2);
    const int even = (code & 1) == 0 ? code : code + 1;
    EXPECT_EQ(int(fp32_to_fp8_e5m2(mid)), even) << code;
    EXPECT_EQ(int(fp32_to_fp8_e5m2(std::nextafter(mid, 0.0f))), code) << code;
    EXPECT_EQ(int(fp32_to_fp8_e5m2(std::nextafter(mid, 1e9f))), code + 1) << code;
    EXPECT_EQ(int(fp32_to_fp8_e5m2(-std::nextafter(mid, 0.0f))), code | 0x80) << code;
  }
  EXPECT_EQ(int(fp32_to_fp8_e5m2(61440.0f)), 0x7B);  // the tie with infinity
  EXPECT_EQ(int(fp32_to_fp8_e5m2(1e9f)), 0x7B);
  EXPECT_EQ(int(fp32_to_fp8_e5m2(std::numeric_limits<float>::infinity())), 0x7B);
  EXPECT_EQ(int(fp32_to_fp8_e5m2(-std::numeric_limits<float>::infinity())), 0xFB);
  EXPECT_EQ(int(fp32_to_fp8_e5m2(std::ldexp(1.0f, -18))), 0x00);  // a quarter of the smallest subnormal
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_fp32(fp32_to_fp8_e5m2(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(1.0f)), 1.0f);
  const float tie = 1.0f + std::ldexp(1.0f, -8);  // halfway between 1 and the next bf16 (1 + 2^-7)
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(tie)), 1.0f);
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(std::nextafter(tie, 2.0f))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace kvserve
