#include "model/ggml_dequantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/weight_matrix.h"
#include "kernels/weight_quantize.h"
#include "model/ggml_quantize.h"
#include "util/half.h"

namespace kvserve {
namespace {

// The tests address a block as one little-endian bit string: bit b is bit
// b % 8 of byte b / 8. Each type's expected values come from the documented
// position of every field of every element (below), read or written one
// field at a time, not from the decoder's loops over sub-blocks.
uint32_t get_bits(const std::vector<uint8_t>& block, int bit, int count) {
  uint32_t v = 0;
  for (int i = 0; i < count; ++i) v |= uint32_t((block[size_t((bit + i) / 8)] >> ((bit + i) % 8)) & 1) << i;
  return v;
}

void set_bits(std::vector<uint8_t>& block, int bit, int count, uint32_t v) {
  for (int i = 0; i < count; ++i) {
    const uint8_t mask = uint8_t(1u << ((bit + i) % 8));
    if ((v >> i) & 1) block[size_t((bit + i) / 8)] |= mask;
    else block[size_t((bit + i) / 8)] &= uint8_t(~mask);
  }
}

float half_at(const std::vector<uint8_t>& block, int byte) { return fp16_to_fp32(fp16_t(get_bits(block, 8 * byte, 16))); }
void set_half(std::vector<uint8_t>& block, int byte, float v) { set_bits(block, 8 * byte, 16, fp32_to_fp16(v)); }

std::vector<float> decode(GgmlType t, const std::vector<uint8_t>& bytes) {
  const GgmlBlock b = ggml_block(uint32_t(t));
  const int64_t n = int64_t(bytes.size()) / b.bytes * b.values;
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_ggml_row(t, bytes.data(), n, out.data());
  return out;
}

// ---- where each field of element v lies, in bits from the block's start ----

// Value v of a 32-value group stored as nibbles: v < 16 is the low nibble of
// byte v, v >= 16 the high nibble of byte v - 16.
int nibble_bit(int qs_byte, int v) { return 8 * (qs_byte + v % 16) + 4 * (v / 16); }

// K-quants with 16-value sub-blocks: v = 128h + 32k + l.
int kq_h(int v) { return v / 128; }
int kq_k(int v) { return v % 128 / 32; }
int kq_l(int v) { return v % 32; }

// Q4_K/Q5_K scale and min of 32-value sub-block j, 6 bits each, in the 12
// bytes from scales_byte: j < 4 in bits 0..5 of bytes j (scale) and j + 4
// (min); j >= 4 in the nibbles of byte j + 4 plus bits 6..7 of bytes j - 4
// (scale) and j (min).
uint32_t k4_scale(const std::vector<uint8_t>& b, int scales_byte, int j) {
  const int base = 8 * scales_byte;
  if (j < 4) return get_bits(b, base + 8 * j, 6);
  return get_bits(b, base + 8 * (j + 4), 4) | get_bits(b, base + 8 * (j - 4) + 6, 2) << 4;
}
uint32_t k4_min(const std::vector<uint8_t>& b, int scales_byte, int j) {
  const int base = 8 * scales_byte;
  if (j < 4) return get_bits(b, base + 8 * (j + 4), 6);
  return get_bits(b, base + 8 * (j + 4) + 4, 4) | get_bits(b, base + 8 * j + 6, 2) << 4;
}
void set_k4(std::vector<uint8_t>& b, int scales_byte, int j, uint32_t scale, uint32_t min) {
  const int base = 8 * scales_byte;
  if (j < 4) {
    set_bits(b, base + 8 * j, 6, scale);
    set_bits(b, base + 8 * (j + 4), 6, min);
  } else {
    set_bits(b, base + 8 * (j + 4), 4, scale & 0xF);
    set_bits(b, base + 8 * (j - 4) + 6, 2, scale >> 4);
    set_bits(b, base + 8 * (j + 4) + 4, 4, min & 0xF);
    set_bits(b, base + 8 * j + 6, 2, min >> 4);
  }
}

// Q3_K's 6-bit scale s (stored + 32) in the 12 bytes at 96: low 4 bits in the
// low nibble of byte 96 + s (s < 8) or the high nibble of byte 96 + s - 8,
// high 2 bits at bit 2 (s / 4) of byte 104 + s % 4.
int q3_low_bit(int s) { return s < 8 ? 8 * (96 + s) : 8 * (96 + s - 8) + 4; }
int q3_high_bit(int s) { return 8 * (104 + s % 4) + 2 * (s / 4); }

// The documented formula of each type for element v of one block.
float expected(GgmlType t, const std::vector<uint8_t>& b, int v) {
  switch (t) {
    case GgmlType::BF16: {
      const uint32_t bits = get_bits(b, 0, 16) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case GgmlType::Q4_1:
      return half_at(b, 0) * float(get_bits(b, nibble_bit(4, v), 4)) + half_at(b, 2);
    case GgmlType::Q5_0: {
      const int q = int(get_bits(b, nibble_bit(6, v), 4) | get_bits(b, 16 + v, 1) << 4);
      return half_at(b, 0) * float(q - 16);
    }
    case GgmlType::Q5_1: {
      const int q = int(get_bits(b, nibble_bit(8, v), 4) | get_bits(b, 32 + v, 1) << 4);
      return half_at(b, 0) * float(q) + half_at(b, 2);
    }
    case GgmlType::Q2_K: {
      const int s = v / 16;
      const float d = half_at(b, 80), dmin = half_at(b, 82);
      const float scale = float(get_bits(b, 8 * s, 4)), min = float(get_bits(b, 8 * s + 4, 4));
      const float q = float(get_bits(b, 8 * (16 + 32 * kq_h(v) + kq_l(v)) + 2 * kq_k(v), 2));
      return d * scale * q - dmin * min;
    }
    case GgmlType::Q3_K: {
      const int s = v / 16;
      const int scale = int(get_bits(b, q3_low_bit(s), 4) | get_bits(b, q3_high_bit(s), 2) << 4) - 32;
      const int low = int(get_bits(b, 8 * (32 + 32 * kq_h(v) + kq_l(v)) + 2 * kq_k(v), 2));
      const int high = int(get_bits(b, 8 * kq_l(v) + 4 * kq_h(v) + kq_k(v), 1));
      return half_at(b, 108) * float(scale) * float((low | high << 2) - 4);
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      const int j = v / 32, g = v / 64, nibble = j % 2, l = v % 32;
      int q = int(get_bits(b, 8 * ((five ? 48 : 16) + 32 * g + l) + 4 * nibble, 4));
      if (five) q |= int(get_bits(b, 8 * (16 + l) + 2 * g + nibble, 1)) << 4;
      return half_at(b, 0) * float(k4_scale(b, 4, j)) * float(q) - half_at(b, 2) * float(k4_min(b, 4, j));
    }
    case GgmlType::Q6_K: {
      const int h = kq_h(v), k = kq_k(v), l = kq_l(v);
      const int low = int(get_bits(b, 8 * (64 * h + 32 * (k % 2) + l) + 4 * (k / 2), 4));
      const int high = int(get_bits(b, 8 * (128 + 32 * h + l) + 2 * k, 2));
      const int scale = int8_t(get_bits(b, 8 * (192 + v / 16), 8));
      return half_at(b, 208) * float(scale) * float((low | high << 4) - 32);
    }
    default: ADD_FAILURE() << "no reference for " << ggml_type_name(uint32_t(t)); return 0;
  }
}

constexpr GgmlType kConverted[] = {GgmlType::BF16, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q2_K,
                                   GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};

TEST(GgmlDequantize, BlockSizesAndNames) {
  struct Case {
    GgmlType t;
    int64_t values, bytes;
    const char* name;
  };
  const Case cases[] = {
      {GgmlType::F32, 1, 4, "F32"},      {GgmlType::F16, 1, 2, "F16"},      {GgmlType::BF16, 1, 2, "BF16"},
      {GgmlType::Q4_0, 32, 18, "Q4_0"},  {GgmlType::Q4_1, 32, 20, "Q4_1"},  {GgmlType::Q5_0, 32, 22, "Q5_0"},
      {GgmlType::Q5_1, 32, 24, "Q5_1"},  {GgmlType::Q8_0, 32, 34, "Q8_0"},  {GgmlType::Q2_K, 256, 84, "Q2_K"},
      {GgmlType::Q3_K, 256, 110, "Q3_K"}, {GgmlType::Q4_K, 256, 144, "Q4_K"}, {GgmlType::Q5_K, 256, 176, "Q5_K"},
      {GgmlType::Q6_K, 256, 210, "Q6_K"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(ggml_block(uint32_t(c.t)).values, c.values) << c.name;
    EXPECT_EQ(ggml_block(uint32_t(c.t)).bytes, c.bytes) << c.name;
    EXPECT_EQ(ggml_type_name(uint32_t(c.t)), c.name);
    for (bool native_q4_1 : {false, true}) EXPECT_TRUE(ggml_load_type(uint32_t(c.t), native_q4_1).has_value()) << c.name;
  }
  for (GgmlType t : kConverted) {
    EXPECT_TRUE(ggml_needs_conversion(uint32_t(t)));
    EXPECT_EQ(*ggml_load_type(uint32_t(t), false), t == GgmlType::BF16 ? WeightType::F32 : WeightType::Q8_0);
    // Natively, the 4-bit types with a min and one scale per 32 values stay 4-bit.
    const bool q4_1 = t == GgmlType::Q4_1 || t == GgmlType::Q4_K;
    EXPECT_EQ(*ggml_load_type(uint32_t(t), true),
              t == GgmlType::BF16 ? WeightType::F32 : q4_1 ? WeightType::Q4_1 : WeightType::Q8_0);
  }
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0})
    EXPECT_FALSE(ggml_needs_conversion(uint32_t(t)));
  // Types kvserve cannot read: no size, no load type, a name for messages.
  for (uint32_t t : {9u, 15u, 16u, 23u, 29u, 34u, 39u, 4u, 1000u}) {
    EXPECT_EQ(ggml_block(t).values, 0) << t;
    EXPECT_FALSE(ggml_load_type(t, false)) << t;
    EXPECT_FALSE(ggml_load_type(t, true)) << t;
  }
  EXPECT_EQ(ggml_type_label(16), "IQ2_XXS (ggml type 16)");
  EXPECT_EQ(ggml_type_label(9), "Q8_1 (ggml type 9)");
  EXPECT_EQ(ggml_type_label(15), "Q8_K (ggml type 15)");
  EXPECT_EQ(ggml_type_label(35), "TQ2_0 (ggml type 35)");
  EXPECT_EQ(ggml_type_label(1000), "unknown (ggml type 1000)");
}

// ---- hand-built blocks: chosen scales and codes, expected values computed
// from the choices (powers of two and small integers: exact in float) ----

// Codes that visit every value of a b-bit field.
int chosen_code(int v, int bits) { return (v * 7 + v / 5) % (1 << bits); }

TEST(GgmlDequantize, Q4_1HandBuiltBlock) {
  std::vector<uint8_t> b(20, 0);
  set_half(b, 0, 0.25f);
  set_half(b, 2, -1.5f);
  for (int v = 0; v < 32; ++v) set_bits(b, nibble_bit(4, v), 4, uint32_t(chosen_code(v, 4)));
  const auto y = decode(GgmlType::Q4_1, b);
  for (int v = 0; v < 32; ++v) EXPECT_EQ(y[size_t(v)], 0.25f * float(chosen_code(v, 4)) - 1.5f) << v;
}

TEST(GgmlDequantize, Q5_0AndQ5_1HandBuiltBlocks) {
  std::vector<uint8_t> b0(22, 0), b1(24, 0);
  set_half(b0, 0, 0.5f);
  set_half(b1, 0, 0.125f);
  set_half(b1, 2, 2.0f);
  for (int v = 0; v < 32; ++v) {
    const uint32_t q = uint32_t(chosen_code(v, 5));
    set_bits(b0, nibble_bit(6, v), 4, q & 0xF);
    set_bits(b0, 16 + v, 1, q >> 4);  // qh bit v = the fifth bit of value v
    set_bits(b1, nibble_bit(8, v), 4, q & 0xF);
    set_bits(b1, 32 + v, 1, q >> 4);
  }
  const auto y0 = decode(GgmlType::Q5_0, b0), y1 = decode(GgmlType::Q5_1, b1);
  for (int v = 0; v < 32; ++v) {
    EXPECT_EQ(y0[size_t(v)], 0.5f * float(chosen_code(v, 5) - 16)) << v;
    EXPECT_EQ(y1[size_t(v)], 0.125f * float(chosen_code(v, 5)) + 2.0f) << v;
  }
  // Value 17 alone with its fifth bit: code 16 is zero in Q5_0.
  std::vector<uint8_t> one(22, 0);
  set_half(one, 0, 1.0f);
  one[2 + 2] = 0x02;  // qh byte 2, bit 1: bit 17
  const auto y = decode(GgmlType::Q5_0, one);
  for (int v = 0; v < 32; ++v) EXPECT_EQ(y[size_t(v)], v == 17 ? 0.0f : -16.0f) << v;
}

TEST(GgmlDequantize, Q2_KHandBuiltBlock) {
  std::vector<uint8_t> b(84, 0);
  set_half(b, 80, 0.5f);
  set_half(b, 82, 0.25f);
  int scale[16], min[16];
  for (int s = 0; s < 16; ++s) {
    scale[s] = (s * 5 + 3) % 16;
    min[s] = (s * 11 + 1) % 16;
    set_bits(b, 8 * s, 4, uint32_t(scale[s]));
    set_bits(b, 8 * s + 4, 4, uint32_t(min[s]));
  }
  for (int v = 0; v < 256; ++v)
    set_bits(b, 8 * (16 + 32 * kq_h(v) + kq_l(v)) + 2 * kq_k(v), 2, uint32_t(chosen_code(v, 2)));
  const auto y = decode(GgmlType::Q2_K, b);
  for (int v = 0; v < 256; ++v)
    EXPECT_EQ(y[size_t(v)], 0.5f * float(scale[v / 16] * chosen_code(v, 2)) - 0.25f * float(min[v / 16])) << v;
}

TEST(GgmlDequantize, Q3_KHandBuiltBlock) {
  std::vector<uint8_t> b(110, 0);
  set_half(b, 108, 0.125f);
  int scale[16];  // signed, -32..31: the stored 6 bits are scale + 32
  for (int s = 0; s < 16; ++s) {
    scale[s] = (s * 13) % 64 - 32;
    const uint32_t stored = uint32_t(scale[s] + 32);
    set_bits(b, q3_low_bit(s), 4, stored & 0xF);
    set_bits(b, q3_high_bit(s), 2, stored >> 4);
  }
  for (int v = 0; v < 256; ++v) {
    const uint32_t code = uint32_t(chosen_code(v, 3));  // 3 bits; the value is code - 4
    set_bits(b, 8 * (32 + 32 * kq_h(v) + kq_l(v)) + 2 * kq_k(v), 2, code & 3);
    set_bits(b, 8 * kq_l(v) + 4 * kq_h(v) + kq_k(v), 1, code >> 2);  // hmask[l], bit 4h + k
  }
  const auto y = decode(GgmlType::Q3_K, b);
  for (int v = 0; v < 256; ++v)
    EXPECT_EQ(y[size_t(v)], 0.125f * float(scale[v / 16] * (chosen_code(v, 3) - 4))) << v;
}

TEST(GgmlDequantize, Q4_KAndQ5_KHandBuiltBlocks) {
  // Scales and mins at 16 and above set the 2 high bits stored apart.
  const int scale[8] = {1, 17, 33, 63, 5, 21, 37, 62};
  const int min[8] = {0, 9, 63, 31, 48, 16, 7, 40};
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K}) {
    SCOPED_TRACE(ggml_type_name(uint32_t(t)));
    const bool five = t == GgmlType::Q5_K;
    const int bits = five ? 5 : 4;
    std::vector<uint8_t> b(size_t(ggml_block(uint32_t(t)).bytes), 0);
    set_half(b, 0, 0.0625f);
    set_half(b, 2, 0.5f);
    for (int j = 0; j < 8; ++j) set_k4(b, 4, j, uint32_t(scale[j]), uint32_t(min[j]));
    for (int v = 0; v < 256; ++v) {
      const int j = v / 32, g = v / 64, l = v % 32;
      const uint32_t q = uint32_t(chosen_code(v, bits));
      set_bits(b, 8 * ((five ? 48 : 16) + 32 * g + l) + 4 * (j % 2), 4, q & 0xF);
      if (five) set_bits(b, 8 * (16 + l) + 2 * g + j % 2, 1, q >> 4);
    }
    const auto y = decode(t, b);
    for (int v = 0; v < 256; ++v)
      EXPECT_EQ(y[size_t(v)], 0.0625f * float(scale[v / 32] * chosen_code(v, bits)) - 0.5f * float(min[v / 32]))
          << v;
  }
}

// A vector whose values llama.cpp's dequantize_row_q4_K printed, as
// published by realizar's Q4_K parity test (PAR-001): d = 0x2E66, dmin =
// 0x2666, sub-blocks 0 and 1 with scales 10, 20 and mins 5, 10 (bytes 0, 1
// and 4, 5 of scales), qs[i < 32] = (i % 16) | (15 - i % 16) << 4, the rest 0.
// Values 0-19 and 32-39 as printed (6 decimals); the rest follow.
TEST(GgmlDequantize, Q4_KMatchesLlamaCppsPrintedValues) {
  std::vector<uint8_t> b(144, 0);
  b[0] = 0x66, b[1] = 0x2E, b[2] = 0x66, b[3] = 0x26;
  b[4] = 10, b[5] = 20, b[8] = 5, b[9] = 10;
  for (int i = 0; i < 32; ++i) b[size_t(16 + i)] = uint8_t((i % 16) | (15 - i % 16) << 4);
  const float first[20] = {-0.124969f, 0.874786f, 1.874542f,  2.874298f,  3.874054f,  4.873810f, 5.873566f,
                           6.873322f,  7.873077f, 8.872833f,  9.872589f,  10.872345f, 11.872101f, 12.871857f,
                           13.871613f, 14.871368f, -0.124969f, 0.874786f, 1.874542f,  2.874298f};
  const float at32[8] = {29.742737f, 27.743225f, 25.743713f, 23.744202f,
                         21.744690f, 19.745178f, 17.745667f, 15.746155f};
  const auto y = decode(GgmlType::Q4_K, b);
  for (int v = 0; v < 20; ++v) EXPECT_NEAR(y[size_t(v)], first[v], 1e-6f * (1.0f + std::fabs(first[v]))) << v;
  for (int v = 0; v < 8; ++v) EXPECT_NEAR(y[size_t(32 + v)], at32[v], 1e-6f * (1.0f + at32[v])) << 32 + v;
  // Sub-blocks 2-7 have scale and min 0; their codes are 0 anyway.
  for (int v = 64; v < 256; ++v) EXPECT_EQ(y[size_t(v)], 0.0f) << v;
}

TEST(GgmlDequantize, Q6_KHandBuiltBlock) {
  std::vector<uint8_t> b(210, 0);
  set_half(b, 208, 0.25f);
  int scale[16];
  for (int s = 0; s < 16; ++s) {
    scale[s] = (s * 37) % 256 - 128;  // int8, negative ones included
    set_bits(b, 8 * (192 + s), 8, uint32_t(uint8_t(int8_t(scale[s]))));
  }
  for (int v = 0; v < 256; ++v) {
    const int h = kq_h(v), k = kq_k(v), l = kq_l(v);
    const uint32_t q = uint32_t(chosen_code(v, 6));  // the value is q - 32
    set_bits(b, 8 * (64 * h + 32 * (k % 2) + l) + 4 * (k / 2), 4, q & 0xF);
    set_bits(b, 8 * (128 + 32 * h + l) + 2 * k, 2, q >> 4);
  }
  const auto y = decode(GgmlType::Q6_K, b);
  for (int v = 0; v < 256; ++v)
    EXPECT_EQ(y[size_t(v)], 0.25f * float(scale[v / 16] * (chosen_code(v, 6) - 32))) << v;
}

TEST(GgmlDequantize, Bf16IsTheHighHalfOfAnFp32) {
  const std::vector<uint8_t> b = {0x80, 0x3F, 0x00, 0xC0, 0x49, 0x40, 0x80, 0x7F, 0x01, 0x00};
  const auto y = decode(GgmlType::BF16, b);
  EXPECT_EQ(y[0], 1.0f);              // 0x3F80
  EXPECT_EQ(y[1], -2.0f);             // 0xC000
  EXPECT_EQ(y[2], 3.140625f);         // 0x4049
  EXPECT_TRUE(std::isinf(y[3]));      // 0x7F80
  EXPECT_EQ(y[4], std::ldexp(1.0f, -133));  // 0x0001: the smallest subnormal
}

// ---- random bytes: every type against the per-element formula ----

TEST(GgmlDequantize, RandomBlocksMatchTheDocumentedLayout) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (GgmlType t : kConverted) {
    SCOPED_TRACE(ggml_type_name(uint32_t(t)));
    const GgmlBlock block = ggml_block(uint32_t(t));
    const int blocks = t == GgmlType::BF16 ? 512 : 6;
    std::vector<uint8_t> bytes(size_t(blocks * block.bytes));
    for (auto& x : bytes) x = uint8_t(rng());
    // Finite fp16 scales (random bytes would include infinities and NaNs,
    // which no formula compares equal on); BF16 values likewise finite.
    for (int i = 0; i < blocks; ++i) {
      std::vector<uint8_t> b(bytes.begin() + i * block.bytes, bytes.begin() + (i + 1) * block.bytes);
      switch (t) {
        case GgmlType::BF16: set_bits(b, 0, 16, fp32_to_bf16(u(rng) * 1e3f)); break;
        case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K:
          set_half(b, 0, u(rng));
          set_half(b, 2, u(rng));
          break;
        case GgmlType::Q5_0: set_half(b, 0, u(rng)); break;
        case GgmlType::Q2_K: set_half(b, 80, u(rng)); set_half(b, 82, u(rng)); break;
        case GgmlType::Q3_K: set_half(b, 108, u(rng)); break;
        case GgmlType::Q6_K: set_half(b, 208, u(rng)); break;
        default: break;
      }
      std::copy(b.begin(), b.end(), bytes.begin() + i * block.bytes);
    }
    const auto y = decode(t, bytes);
    for (int i = 0; i < blocks; ++i) {
      const std::vector<uint8_t> b(bytes.begin() + i * block.bytes, bytes.begin() + (i + 1) * block.bytes);
      for (int v = 0; v < block.values; ++v) {
        const float want = expected(t, b, v), got = y[size_t(i * block.values + v)];
        // The formulas' products in another order: a few ulps.
        EXPECT_NEAR(got, want, 1e-6f * std::max(1.0f, std::fabs(want))) << "block " << i << " value " << v;
      }
    }
  }
}

// ---- the encoders (for synthetic checkpoints): decode close to their input ----

TEST(GgmlQuantize, EncodersRoundTripWithinTheirResolution) {
  // Relative RMS error bounds for uniform values in [-a, a]: a b-bit code
  // over the range 2a errs by 2a / (2^b - 1) / sqrt(12) RMS, against a / sqrt(3)
  // for the values: 1 / (2^b - 1) relative. A quarter more for the rounding
  // of the scales (4- to 8-bit sub-block scales in the K-quants).
  auto bits = [](int b) { return 1.25 / double((1 << b) - 1); };
  const std::pair<GgmlType, double> bounds[] = {
      {GgmlType::BF16, 3e-3},    {GgmlType::Q4_1, bits(4)}, {GgmlType::Q5_0, bits(5)}, {GgmlType::Q5_1, bits(5)},
      {GgmlType::Q2_K, bits(2)}, {GgmlType::Q3_K, bits(3)}, {GgmlType::Q4_K, bits(4)}, {GgmlType::Q5_K, bits(5)},
      {GgmlType::Q6_K, bits(6)},
  };
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(1024);
  for (auto& v : x) v = u(rng) * 0.05f;
  x[100] = 0.0f;
  std::fill(x.begin() + 512, x.begin() + 544, 0.0f);  // an all-zero block and sub-blocks
  for (auto [t, bound] : bounds) {
    SCOPED_TRACE(ggml_type_name(uint32_t(t)));
    std::vector<uint8_t> bytes;
    quantize_ggml_row(t, x.data(), int64_t(x.size()), bytes);
    ASSERT_EQ(bytes.size(), x.size() / size_t(ggml_block(uint32_t(t)).values) * size_t(ggml_block(uint32_t(t)).bytes));
    const auto y = decode(t, bytes);
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      num += std::pow(double(y[i]) - x[i], 2);
      den += std::pow(double(x[i]), 2);
    }
    EXPECT_LT(std::sqrt(num / den), bound);
    for (size_t i = 512; i < 544; ++i) EXPECT_NEAR(y[i], 0.0f, 1e-3f) << i;
  }
}

// ---- repacking into the computed Q4_1 (kernels/weight_matrix.h) ----

// Q4_1 in a file is the computed Q4_1's block: copied as is, and what
// quantize_row writes for Q4_1 is what quantize_ggml_row writes.
TEST(GgmlRepackQ4_1, Q4_1IsCopiedByteForByte) {
  std::mt19937 rng(17);
  std::vector<uint8_t> file(5 * 20);
  for (auto& b : file) b = uint8_t(rng());
  std::vector<uint8_t> out(file.size());
  repack_ggml_row_q4_1(GgmlType::Q4_1, file.data(), 5 * 32, out.data());
  EXPECT_EQ(out, file);

  std::uniform_real_distribution<float> u(-0.3f, 0.2f);
  std::vector<float> x(4 * 32);
  for (auto& v : x) v = u(rng);
  std::fill(x.begin() + 32, x.begin() + 64, 0.125f);  // max = min: d = 0
  std::vector<uint8_t> computed, ggml;
  quantize_row(WeightType::Q4_1, x.data(), int64_t(x.size()), computed);
  quantize_ggml_row(GgmlType::Q4_1, x.data(), int64_t(x.size()), ggml);
  EXPECT_EQ(computed, ggml);
  std::vector<float> y(x.size());
  dequantize_row(WeightMatrix{WeightType::Q4_1, computed.data(), 1, int64_t(x.size())}, 0, y.data());
  EXPECT_EQ(y, decode(GgmlType::Q4_1, ggml));
}

// A Q4_K super-block becomes eight Q4_1 blocks of the same codes with
// d = fp16(d_super sc) and m = fp16(-dmin min). Where those products are
// fp16 numbers (the hand-built block) the values are exact; otherwise each
// value d sc q - dmin min differs by the two roundings, at most 2^-11
// relative each (|d sc| q + |dmin min|), or 2^-25 absolute each below
// fp16's normal range, plus one float rounding of either side (2^-24 relative).
TEST(GgmlRepackQ4_1, Q4_KSubBlocksBecomeQ4_1Blocks) {
  std::mt19937 rng(19);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  constexpr int kBlocks = 6;
  std::vector<uint8_t> bytes(kBlocks * 144);
  for (auto& b : bytes) b = uint8_t(rng());
  for (int i = 0; i < kBlocks; ++i) {
    std::vector<uint8_t> b(bytes.begin() + i * 144, bytes.begin() + (i + 1) * 144);
    if (i == 0) {  // exact: the hand-built block's scales and mins are fp16 numbers
      const int scale[8] = {1, 17, 33, 63, 5, 21, 37, 62}, min[8] = {0, 9, 63, 31, 48, 16, 7, 40};
      set_half(b, 0, 0.0625f);
      set_half(b, 2, 0.5f);
      for (int j = 0; j < 8; ++j) set_k4(b, 4, j, uint32_t(scale[j]), uint32_t(min[j]));
    } else {
      // Finite scales; block 1 below fp16's normal range after the product.
      const float tiny = i == 1 ? 1e-6f : 1.0f;
      set_half(b, 0, u(rng) * tiny);
      set_half(b, 2, u(rng) * tiny);
    }
    std::copy(b.begin(), b.end(), bytes.begin() + i * 144);
  }
  const int64_t n = kBlocks * 256;
  std::vector<uint8_t> q4_1(size_t(n / 32 * 20));
  repack_ggml_row_q4_1(GgmlType::Q4_K, bytes.data(), n, q4_1.data());
  std::vector<float> got(static_cast<size_t>(n));
  dequantize_row(WeightMatrix{WeightType::Q4_1, q4_1.data(), 1, n}, 0, got.data());
  const std::vector<float> want = decode(GgmlType::Q4_K, bytes);
  for (int i = 0; i < kBlocks; ++i) {
    const std::vector<uint8_t> b(bytes.begin() + i * 144, bytes.begin() + (i + 1) * 144);
    for (int v = 0; v < 256; ++v) {
      const int j = v / 32, q = int(get_bits(b, 8 * (16 + 32 * (v / 64) + v % 32) + 4 * (j % 2), 4));
      const double scaled = std::fabs(double(half_at(b, 0)) * k4_scale(b, 4, j)) * q,
                   shift = std::fabs(double(half_at(b, 2)) * k4_min(b, 4, j));
      const double bound =
          i == 0 ? 0.0 : (std::ldexp(1.0, -11) + std::ldexp(1.0, -23)) * (scaled + shift) + std::ldexp(1.0, -25) * (q + 1);
      const size_t at = size_t(i * 256 + v);
      ASSERT_LE(std::fabs(double(got[at]) - want[at]), bound) << "block " << i << " value " << v;
    }
  }
}

}  // namespace
}  // namespace kvserve
