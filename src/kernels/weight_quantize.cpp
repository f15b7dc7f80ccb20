#include "kernels/weight_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "util/half.h"

namespace kvserve {
namespace {

template <class T>
void append(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

}  // namespace

void quantize_row(WeightType t, const float* x, int64_t cols, std::vector<uint8_t>& out) {
  switch (t) {
    case WeightType::F32:
      for (int64_t i = 0; i < cols; ++i) append(out, x[i]);
      return;
    case WeightType::F16:
      for (int64_t i = 0; i < cols; ++i) append(out, fp32_to_fp16(x[i]));
      return;
    case WeightType::Q8_0:
      for (int64_t b = 0; b < cols; b += kQuantBlock) {
        float amax = 0;
        for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(x[b + j]));
        const float d = amax / 127.0f, inv = d != 0 ? 1.0f / d : 0.0f;
        append(out, fp32_to_fp16(d));
        for (int j = 0; j < kQuantBlock; ++j) append(out, int8_t(std::lround(x[b + j] * inv)));
      }
      return;
    case WeightType::Q4_0:
      for (int64_t b = 0; b < cols; b += kQuantBlock) {
        float max_signed = 0, amax = 0;
        for (int j = 0; j < kQuantBlock; ++j)
          if (std::fabs(x[b + j]) > amax) amax = std::fabs(x[b + j]), max_signed = x[b + j];
        const float d = max_signed / -8.0f, inv = d != 0 ? 1.0f / d : 0.0f;
        append(out, fp32_to_fp16(d));
        auto q = [&](int j) { return uint8_t(std::clamp<long>(std::lround(x[b + j] * inv) + 8, 0, 15)); };
        for (int j = 0; j < kQuantBlock / 2; ++j) append(out, uint8_t(q(j) | (q(j + 16) << 4)));
      }
      return;
    case WeightType::Q4_1:
      for (int64_t b = 0; b < cols; b += kQuantBlock) {
        const auto [lo, hi] = std::minmax_element(x + b, x + b + kQuantBlock);
        // The codes are chosen against the scale and min as stored.
        const fp16_t d16 = fp32_to_fp16((*hi - *lo) / 15.0f), m16 = fp32_to_fp16(*lo);
        const float d = fp16_to_fp32(d16), m = fp16_to_fp32(m16);
        append(out, d16);
        append(out, m16);
        auto q = [&](int j) {
          return d == 0 ? uint8_t(0) : uint8_t(std::clamp<long>(std::lround((x[b + j] - m) / d), 0, 15));
        };
        for (int j = 0; j < kQuantBlock / 2; ++j) append(out, uint8_t(q(j) | (q(j + 16) << 4)));
      }
      return;
  }
}

}  // namespace kvserve
