#include "kernels/weight_matrix.h"

#include <cassert>
#include <cstring>

#include "util/half.h"

namespace kvserve {

namespace {

constexpr size_t kQ8BlockBytes = 34;  // fp16 d + int8 qs[32]
constexpr size_t kQ4BlockBytes = 18;  // fp16 d + uint8 qs[16]
constexpr size_t kQ4_1BlockBytes = 20;  // fp16 d + fp16 m + uint8 qs[16]

float load_fp16(const uint8_t* p) {
  fp16_t h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_fp32(h);
}

}  // namespace

std::string_view weight_type_name(WeightType t) {
  switch (t) {
    case WeightType::F32: return "F32";
    case WeightType::F16: return "F16";
    case WeightType::Q8_0: return "Q8_0";
    case WeightType::Q4_0: return "Q4_0";
    case WeightType::Q4_1: return "Q4_1";
  }
  return "unknown";
}

size_t weight_row_bytes(WeightType t, int64_t cols) {
  switch (t) {
    case WeightType::F32: return 4 * size_t(cols);
    case WeightType::F16: return 2 * size_t(cols);
    case WeightType::Q8_0:
      assert(cols % kQuantBlock == 0);
      return kQ8BlockBytes * size_t(cols / kQuantBlock);
    case WeightType::Q4_0:
      assert(cols % kQuantBlock == 0);
      return kQ4BlockBytes * size_t(cols / kQuantBlock);
    case WeightType::Q4_1:
      assert(cols % kQuantBlock == 0);
      return kQ4_1BlockBytes * size_t(cols / kQuantBlock);
  }
  return 0;
}

void dequantize_row(const WeightMatrix& w, int64_t r, float* out) {
  const uint8_t* row = w.row(r);
  const int64_t cols = w.cols;
  switch (w.type) {
    case WeightType::F32:
      std::memcpy(out, row, 4 * size_t(cols));
      return;
    case WeightType::F16:
      for (int64_t i = 0; i < cols; ++i) out[i] = load_fp16(row + 2 * i);
      return;
    case WeightType::Q8_0:
      for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
        const uint8_t* block = row + b * kQ8BlockBytes;
        const float d = load_fp16(block);
        const auto* qs = reinterpret_cast<const int8_t*>(block + 2);
        for (int j = 0; j < kQuantBlock; ++j) out[b * kQuantBlock + j] = d * float(qs[j]);
      }
      return;
    case WeightType::Q4_0:
      for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
        const uint8_t* block = row + b * kQ4BlockBytes;
        const float d = load_fp16(block);
        const uint8_t* qs = block + 2;
        float* o = out + b * kQuantBlock;
        for (int j = 0; j < kQuantBlock / 2; ++j) {
          o[j] = d * float(int(qs[j] & 0x0F) - 8);
          o[j + kQuantBlock / 2] = d * float(int(qs[j] >> 4) - 8);
        }
      }
      return;
    case WeightType::Q4_1:
      for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
        const uint8_t* block = row + b * kQ4_1BlockBytes;
        const float d = load_fp16(block), m = load_fp16(block + 2);
        const uint8_t* qs = block + 4;
        float* o = out + b * kQuantBlock;
        for (int j = 0; j < kQuantBlock / 2; ++j) {
          o[j] = d * float(qs[j] & 0x0F) + m;
          o[j + kQuantBlock / 2] = d * float(qs[j] >> 4) + m;
        }
      }
      return;
  }
}

}  // namespace kvserve
