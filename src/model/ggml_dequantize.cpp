#include "model/ggml_dequantize.h"

#include <cstring>
#include <iterator>

#include "util/half.h"

namespace kvserve {
namespace {

// Block layouts (ggml's ggml-common.h), fields in order, little-endian; "d"
// and "m"/"dmin" are fp16. Within a 32-value group stored as nibbles, value
// j < 16 is the low nibble of byte j and value j + 16 the high nibble.
//
//   Q4_1 (32 values, 20 bytes): d, m, qs[16] (4-bit q).            x = d*q + m
//   Q5_0 (32 values, 22 bytes): d, qh[4], qs[16]. Bit j of qh (as a
//        little-endian uint32) is the 5th bit of value j.          x = d*(q - 16)
//   Q5_1 (32 values, 24 bytes): d, m, qh[4], qs[16]; q as Q5_0.    x = d*q + m
//
// K-quants: super-blocks of 256 values in sub-blocks, each with its own
// scale (and min) quantized against the super-block's d (and dmin).
//   Q2_K (84 bytes): scales[16], qs[64], d, dmin. 16 sub-blocks of 16;
//        scales[s] = scale (low nibble) | min (high nibble). Value
//        128h + 32k + l (h < 2, k < 4, l < 32) is bits 2k..2k+1 of
//        qs[32h + l], in sub-block 8h + 2k + l/16.   x = d*sc*q - dmin*mn
//   Q3_K (110 bytes): hmask[32], qs[64], scales[12], d. 16 sub-blocks of 16
//        with 6-bit scales stored + 32: scale s's low 4 bits are the low
//        nibble of scales[s] (s < 8) or the high nibble of scales[s - 8],
//        its high 2 bits are bits 2(s/4).. of scales[8 + s%4]. Value
//        128h + 32k + l: low 2 bits as Q2_K, 3rd bit = bit 4h + k of
//        hmask[l]; q = that 3-bit code - 4.          x = d*(sc - 32)*q
//   Q4_K (144 bytes): d, dmin, scales[12], qs[128]. 8 sub-blocks of 32 with
//        6-bit scales and mins (scale_min_k4 below). Value 64g + l: low
//        nibble of qs[32g + l] (l < 32, sub-block 2g) or high nibble of
//        qs[32g + l - 32] (sub-block 2g + 1).        x = d*sc*q - dmin*mn
//   Q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128]. As Q4_K, plus
//        a 5th bit: bit 2g (low nibble) or 2g + 1 (high) of qh[l % 32].
//   Q6_K (210 bytes): ql[128], qh[64], scales[16] (int8), d. 16 sub-blocks
//        of 16. Value 128h + 32k + l: low 4 bits are the low (k < 2) or high
//        (k >= 2) nibble of ql[64h + 32(k%2) + l], high 2 bits are bits 2k..
//        of qh[32h + l]; sub-block 8h + 2k + l/16.   x = d*sc*(q - 32)
//   BF16 (1 value, 2 bytes): the high half of an fp32.

float fp16_at(const uint8_t* p) {
  fp16_t h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_fp32(h);
}

uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block: for j < 4
// the low 6 bits of bytes j and j + 4; for j >= 4 the nibbles of byte j + 4
// below the top 2 bits of bytes j - 4 (scale) and j (min).
void scale_min_k4(const uint8_t* scales, int j, int& scale, int& min) {
  if (j < 4) {
    scale = scales[j] & 63;
    min = scales[j + 4] & 63;
  } else {
    scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// Q5_0 and Q5_1 (m = 0 and offset 16 for Q5_0).
void q5_block(const uint8_t* qh_bytes, const uint8_t* qs, float d, float m, int offset, float* y) {
  const uint32_t qh = u32_at(qh_bytes);
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xF) | int((qh >> j) & 1) << 4;
    const int hi = (qs[j] >> 4) | int((qh >> (j + 16)) & 1) << 4;
    y[j] = d * float(lo - offset) + m;
    y[j + 16] = d * float(hi - offset) + m;
  }
}

void q2_k_block(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[8 * h + 2 * k + half];
        const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          *y++ = dl * float((qs[32 * h + l] >> (2 * k)) & 3) - ml;
      }
}

void q3_k_block(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  const float d = fp16_at(b + 108);
  int scales[16];
  for (int s = 0; s < 16; ++s) {
    const int low = s < 8 ? packed[s] & 0xF : packed[s - 8] >> 4;
    const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
    scales[s] = (low | high << 4) - 32;
  }
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int half = 0; half < 2; ++half) {
        const float dl = d * float(scales[8 * h + 2 * k + half]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int low = (qs[32 * h + l] >> (2 * k)) & 3;
          const int high = (hmask[l] >> (4 * h + k)) & 1;
          *y++ = dl * float((low | high << 2) - 4);
        }
      }
}

// Q4_K and Q5_K; qh is null for Q4_K.
void q45_k_block(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  const uint8_t* scales = b + 4;
  for (int g = 0; g < 4; ++g)
    for (int nibble = 0; nibble < 2; ++nibble) {
      int scale, min;
      scale_min_k4(scales, 2 * g + nibble, scale, min);
      const float dl = d * float(scale), ml = dmin * float(min);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * g + l] >> (4 * nibble)) & 0xF;
        if (qh != nullptr) q |= ((qh[l] >> (2 * g + nibble)) & 1) << 4;
        *y++ = dl * float(q) - ml;
      }
    }
}

void q6_k_block(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_at(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const int low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
        const int high = (qh[32 * h + l] >> (2 * k)) & 3;
        *y++ = d * float(scales[8 * h + 2 * k + l / 16]) * float((low | high << 4) - 32);
      }
}

}  // namespace

GgmlBlock ggml_block(uint32_t type) {
  switch (GgmlType(type)) {
    case GgmlType::F32: return {1, 4};
    case GgmlType::F16: return {1, 2};
    case GgmlType::BF16: return {1, 2};
    case GgmlType::Q4_0: return {32, 18};
    case GgmlType::Q4_1: return {32, 20};
    case GgmlType::Q5_0: return {32, 22};
    case GgmlType::Q5_1: return {32, 24};
    case GgmlType::Q8_0: return {32, 34};
    case GgmlType::Q2_K: return {kSuperBlock, 84};
    case GgmlType::Q3_K: return {kSuperBlock, 110};
    case GgmlType::Q4_K: return {kSuperBlock, 144};
    case GgmlType::Q5_K: return {kSuperBlock, 176};
    case GgmlType::Q6_K: return {kSuperBlock, 210};
  }
  return {};
}

std::string ggml_type_name(uint32_t type) {
  // ggml.h's numbering; 4, 5 and 31..33, 36..38 are types ggml removed.
  static constexpr const char* kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",    "Q4_2",     "Q4_3",     "Q5_0",     "Q5_1",   "Q8_0",  "Q8_1",
      "Q2_K",    "Q3_K",   "Q4_K",    "Q5_K",    "Q6_K",     "Q8_K",     "IQ2_XXS",  "IQ2_XS", "IQ3_XXS",
      "IQ1_S",   "IQ4_NL", "IQ3_S",   "IQ2_S",   "IQ4_XS",   "I8",       "I16",      "I32",    "I64",   "F64",
      "IQ1_M",   "BF16",   "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",   "TQ2_0",    "IQ4_NL_4_4",
      "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4"};
  return type < std::size(kNames) ? kNames[type] : "unknown";
}

std::string ggml_type_label(uint32_t type) {
  return ggml_type_name(type) + " (ggml type " + std::to_string(type) + ")";
}

const char* ggml_readable_types() {
  return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";
}

std::optional<WeightType> ggml_load_type(uint32_t type, bool native_q4_1) {
  switch (GgmlType(type)) {
    case GgmlType::F32: return WeightType::F32;
    case GgmlType::F16: return WeightType::F16;
    case GgmlType::Q8_0: return WeightType::Q8_0;
    case GgmlType::Q4_0: return WeightType::Q4_0;
    case GgmlType::BF16: return WeightType::F32;
    case GgmlType::Q4_1:
    case GgmlType::Q4_K: return native_q4_1 ? WeightType::Q4_1 : WeightType::Q8_0;
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K: return WeightType::Q8_0;
  }
  return std::nullopt;
}

bool ggml_needs_conversion(uint32_t type) {
  switch (GgmlType(type)) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0: return false;
    default: return ggml_load_type(type, false).has_value();
  }
}

void dequantize_ggml_row(GgmlType t, const uint8_t* src, int64_t n, float* out) {
  const GgmlBlock block = ggml_block(uint32_t(t));
  // The types kvserve computes with (Q4_1's block is its computed Q4_1's):
  // the kernels' own decoder.
  if (!ggml_needs_conversion(uint32_t(t)) || t == GgmlType::Q4_1) {
    const WeightType w = t == GgmlType::Q4_1 ? WeightType::Q4_1 : *ggml_load_type(uint32_t(t), false);
    dequantize_row(WeightMatrix{w, src, 1, n}, 0, out);
    return;
  }
  const int64_t blocks = n / block.values;
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = src + i * block.bytes;
    float* y = out + i * block.values;
    switch (t) {
      case GgmlType::F32:
      case GgmlType::F16:
      case GgmlType::Q4_0:
      case GgmlType::Q8_0:
      case GgmlType::Q4_1: break;  // above
      case GgmlType::BF16: {
        bf16_t v;
        std::memcpy(&v, b, sizeof v);
        *y = bf16_to_fp32(v);
        break;
      }
      case GgmlType::Q5_0: q5_block(b + 2, b + 6, fp16_at(b), 0.0f, 16, y); break;
      case GgmlType::Q5_1: q5_block(b + 4, b + 8, fp16_at(b), fp16_at(b + 2), 0, y); break;
      case GgmlType::Q2_K: q2_k_block(b, y); break;
      case GgmlType::Q3_K: q3_k_block(b, y); break;
      case GgmlType::Q4_K: q45_k_block(b, nullptr, b + 16, y); break;
      case GgmlType::Q5_K: q45_k_block(b, b + 16, b + 48, y); break;
      case GgmlType::Q6_K: q6_k_block(b, y); break;
    }
  }
}

void repack_ggml_row_q4_1(GgmlType t, const uint8_t* src, int64_t n, uint8_t* out) {
  constexpr int64_t kBlockBytes = 20;  // WeightType::Q4_1: d, m, qs[16]
  if (t == GgmlType::Q4_1) {  // the same block, byte for byte
    std::memcpy(out, src, size_t(n / 32 * kBlockBytes));
    return;
  }
  for (int64_t i = 0; i < n / kSuperBlock; ++i) {
    const uint8_t* b = src + i * 144;
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    const uint8_t* qs = b + 16;
    // Sub-block 2g + nibble holds value l < 32 in that nibble of qs[32g + l];
    // Q4_1 wants value j < 16 in the low nibble of byte j, j + 16 in the high.
    for (int g = 0; g < 4; ++g)
      for (int nibble = 0; nibble < 2; ++nibble) {
        int scale, min;
        scale_min_k4(b + 4, 2 * g + nibble, scale, min);
        uint8_t* o = out + (i * 8 + 2 * g + nibble) * kBlockBytes;
        const fp16_t dh = fp32_to_fp16(d * float(scale)), mh = fp32_to_fp16(-dmin * float(min));
        std::memcpy(o, &dh, sizeof dh);
        std::memcpy(o + 2, &mh, sizeof mh);
        auto q = [&](int l) { return (qs[32 * g + l] >> (4 * nibble)) & 0xF; };
        for (int j = 0; j < 16; ++j) o[4 + j] = uint8_t(q(j) | q(j + 16) << 4);
      }
  }
}

}  // namespace kvserve
