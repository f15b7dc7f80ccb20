#include "model/ggml_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/weight_quantize.h"
#include "util/half.h"

namespace kvserve {
namespace {

// Layouts: see ggml_dequantize.cpp. Every scale is rounded to what its
// field holds before the codes are chosen against it.

void put_fp16(uint8_t* p, float v) {
  const fp16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, sizeof h);
}

float round_fp16(float v) { return fp16_to_fp32(fp32_to_fp16(v)); }

// round(x / step) clamped to [lo, hi]; lo when the step is 0.
int code(float x, float step, int lo, int hi) {
  if (step == 0.0f) return std::clamp(0, lo, hi);
  return int(std::clamp<long>(std::lround(x / step), lo, hi));
}

// The value of largest magnitude, sign kept.
float max_signed(const float* x, int n) {
  float best = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > std::fabs(best)) best = x[i];
  return best;
}

// Sub-block range as x = scale*q - mn with q in [0, levels]: mn >= 0 (the
// K-quants subtract their mins).
void range_of(const float* x, int n, int levels, float& scale, float& mn) {
  const auto [lo, hi] = std::minmax_element(x, x + n);
  mn = std::max(0.0f, -*lo);
  scale = (std::max(*hi, 0.0f) + mn) / float(levels);
}

void q4_1_or_q5_1(const float* x, int levels, uint8_t* b, uint8_t* qh, uint8_t* qs) {
  const auto [lo, hi] = std::minmax_element(x, x + 32);
  const float d = round_fp16((*hi - *lo) / float(levels)), m = round_fp16(*lo);
  put_fp16(b, d);
  put_fp16(b + 2, m);
  uint32_t high = 0;
  for (int j = 0; j < 16; ++j) {
    const int a = code(x[j] - m, d, 0, levels), c = code(x[j + 16] - m, d, 0, levels);
    qs[j] = uint8_t((a & 0xF) | (c & 0xF) << 4);
    high |= uint32_t(a >> 4) << j | uint32_t(c >> 4) << (j + 16);
  }
  if (qh != nullptr) std::memcpy(qh, &high, sizeof high);
}

void q5_0(const float* x, uint8_t* b) {
  const float d = round_fp16(max_signed(x, 32) / -16.0f);
  put_fp16(b, d);
  uint32_t high = 0;
  for (int j = 0; j < 16; ++j) {
    const int a = code(x[j], d, -16, 15) + 16, c = code(x[j + 16], d, -16, 15) + 16;
    b[6 + j] = uint8_t((a & 0xF) | (c & 0xF) << 4);
    high |= uint32_t(a >> 4) << j | uint32_t(c >> 4) << (j + 16);
  }
  std::memcpy(b + 2, &high, sizeof high);
}

void q2_k(const float* x, uint8_t* b) {
  float scale[16], mn[16];
  for (int s = 0; s < 16; ++s) range_of(x + 16 * s, 16, 3, scale[s], mn[s]);
  const float d = round_fp16(*std::max_element(scale, scale + 16) / 15.0f);
  const float dmin = round_fp16(*std::max_element(mn, mn + 16) / 15.0f);
  put_fp16(b + 80, d);
  put_fp16(b + 82, dmin);
  for (int s = 0; s < 16; ++s) {
    const int sc = code(scale[s], d, 0, 15), m = code(mn[s], dmin, 0, 15);
    b[s] = uint8_t(sc | m << 4);
    for (int i = 0; i < 16; ++i) {
      const int v = 16 * s + i, h = v / 128, k = v % 128 / 32, l = v % 32;
      b[16 + 32 * h + l] |= uint8_t(code(x[v] + dmin * float(m), d * float(sc), 0, 3) << (2 * k));
    }
  }
}

// Each 16-value sub-block's signed scale, mapping its value of largest
// magnitude to `lowest` (the most negative code); returns the largest |scale|.
float sub_block_scales16(const float* x, float lowest, float (&scale)[16]) {
  float amax = 0;
  for (int s = 0; s < 16; ++s) {
    scale[s] = max_signed(x + 16 * s, 16) / lowest;
    amax = std::max(amax, std::fabs(scale[s]));
  }
  return amax;
}

void q3_k(const float* x, uint8_t* b) {
  float scale[16];
  const float d = round_fp16(sub_block_scales16(x, -4.0f, scale) / 32.0f);
  put_fp16(b + 108, d);
  for (int s = 0; s < 16; ++s) {
    const int sc = code(scale[s], d, -32, 31);
    const int stored = sc + 32;
    if (s < 8) b[96 + s] |= uint8_t(stored & 0xF);
    else b[96 + s - 8] |= uint8_t((stored & 0xF) << 4);
    b[96 + 8 + s % 4] |= uint8_t((stored >> 4) << (2 * (s / 4)));
    for (int i = 0; i < 16; ++i) {
      const int v = 16 * s + i, h = v / 128, k = v % 128 / 32, l = v % 32;
      const int q = code(x[v], d * float(sc), -4, 3) + 4;
      b[32 + 32 * h + l] |= uint8_t((q & 3) << (2 * k));
      b[l] |= uint8_t((q >> 2) << (4 * h + k));
    }
  }
}

// Q4_K (qh null, 15 levels) and Q5_K (31 levels).
void q45_k(const float* x, int levels, uint8_t* b, uint8_t* qh, uint8_t* qs) {
  float scale[8], mn[8];
  for (int j = 0; j < 8; ++j) range_of(x + 32 * j, 32, levels, scale[j], mn[j]);
  const float d = round_fp16(*std::max_element(scale, scale + 8) / 63.0f);
  const float dmin = round_fp16(*std::max_element(mn, mn + 8) / 63.0f);
  put_fp16(b, d);
  put_fp16(b + 2, dmin);
  uint8_t* scales = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = code(scale[j], d, 0, 63), m = code(mn[j], dmin, 0, 63);
    if (j < 4) {
      scales[j] |= uint8_t(sc);
      scales[j + 4] |= uint8_t(m);
    } else {
      scales[j + 4] = uint8_t((sc & 0xF) | (m & 0xF) << 4);
      scales[j - 4] |= uint8_t((sc >> 4) << 6);
      scales[j] |= uint8_t((m >> 4) << 6);
    }
    const int g = j / 2, nibble = j % 2;
    for (int l = 0; l < 32; ++l) {
      const int q = code(x[32 * j + l] + dmin * float(m), d * float(sc), 0, levels);
      qs[32 * g + l] |= uint8_t((q & 0xF) << (4 * nibble));
      if (qh != nullptr) qh[l] |= uint8_t((q >> 4) << (2 * g + nibble));
    }
  }
}

void q6_k(const float* x, uint8_t* b) {
  float scale[16];
  const float d = round_fp16(sub_block_scales16(x, -32.0f, scale) / 127.0f);
  put_fp16(b + 208, d);
  for (int s = 0; s < 16; ++s) {
    const int sc = code(scale[s], d, -128, 127);
    b[192 + s] = uint8_t(int8_t(sc));
    for (int i = 0; i < 16; ++i) {
      const int v = 16 * s + i, h = v / 128, k = v % 128 / 32, l = v % 32;
      const int q = code(x[v], d * float(sc), -32, 31) + 32;
      b[64 * h + 32 * (k % 2) + l] |= uint8_t((q & 0xF) << (4 * (k / 2)));
      b[128 + 32 * h + l] |= uint8_t((q >> 4) << (2 * k));
    }
  }
}

}  // namespace

GgmlType ggml_type_of(WeightType t) {
  switch (t) {
    case WeightType::F32: return GgmlType::F32;
    case WeightType::F16: return GgmlType::F16;
    case WeightType::Q8_0: return GgmlType::Q8_0;
    case WeightType::Q4_0: return GgmlType::Q4_0;
    case WeightType::Q4_1: return GgmlType::Q4_1;  // the same block layout
  }
  return GgmlType::F32;
}

void quantize_ggml_row(GgmlType t, const float* x, int64_t n, std::vector<uint8_t>& out) {
  switch (t) {
    case GgmlType::F32: quantize_row(WeightType::F32, x, n, out); return;
    case GgmlType::F16: quantize_row(WeightType::F16, x, n, out); return;
    case GgmlType::Q8_0: quantize_row(WeightType::Q8_0, x, n, out); return;
    case GgmlType::Q4_0: quantize_row(WeightType::Q4_0, x, n, out); return;
    default: break;
  }
  const GgmlBlock block = ggml_block(uint32_t(t));
  const size_t start = out.size();
  out.resize(start + size_t(n / block.values * block.bytes), 0);  // the encoders OR bits into zeros
  for (int64_t i = 0; i < n / block.values; ++i) {
    const float* v = x + i * block.values;
    uint8_t* b = out.data() + start + size_t(i * block.bytes);
    switch (t) {
      case GgmlType::BF16: {
        const bf16_t h = fp32_to_bf16(*v);
        std::memcpy(b, &h, sizeof h);
        break;
      }
      case GgmlType::Q4_1: q4_1_or_q5_1(v, 15, b, nullptr, b + 4); break;
      case GgmlType::Q5_0: q5_0(v, b); break;
      case GgmlType::Q5_1: q4_1_or_q5_1(v, 31, b, b + 4, b + 8); break;
      case GgmlType::Q2_K: q2_k(v, b); break;
      case GgmlType::Q3_K: q3_k(v, b); break;
      case GgmlType::Q4_K: q45_k(v, 15, b, nullptr, b + 16); break;
      case GgmlType::Q5_K: q45_k(v, 31, b, b + 16, b + 48); break;
      case GgmlType::Q6_K: q6_k(v, b); break;
      default: break;  // the computable types returned above
    }
  }
}

}  // namespace kvserve
