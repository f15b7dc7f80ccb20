// A weight matrix as it lies in the checkpoint: row-major (rows = outputs,
// cols = inputs), possibly block-quantized. Weights stay in this form in memory;
// matmul kernels dequantize on the fly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvserve {

enum class WeightType : uint8_t {
  F32,   // 4 bytes per value
  F16,   // 2 bytes per value (IEEE half)
  Q8_0,  // blocks of 32: fp16 scale d, int8 q[32]; x = d * q          (34 bytes)
  Q4_0,  // blocks of 32: fp16 scale d, uint8 qs[16]; x = d * (nib - 8) (18 bytes)
         // element j < 16 is the low nibble of qs[j], element j + 16 the high one
  Q4_1,  // blocks of 32: fp16 scale d, fp16 min m, uint8 qs[16] as Q4_0's;
         // x = d * nib + m (20 bytes; ggml's Q4_1 block, byte for byte)
};

constexpr int kQuantBlock = 32;  // values per Q8_0 / Q4_0 / Q4_1 block

struct InterleavedWeights;

std::string_view weight_type_name(WeightType t);

// Bytes of one row of `cols` values. REQUIRES: cols % 32 == 0 for Q8_0/Q4_0/Q4_1.
size_t weight_row_bytes(WeightType t, int64_t cols);

struct WeightMatrix {
  WeightType type = WeightType::F32;
  const void* data = nullptr;  // (rows, cols) in `type`'s layout; null when only the
                               // interleaved copy is kept (a tensor converted at load)
  int64_t rows = 0;            // output features
  int64_t cols = 0;            // input features
  // Optional copy of a Q8_0/Q4_0/Q4_1 matrix laid out for the batched kernels
  // (kernels/interleaved_weights.h); matmul uses it when set. Owned elsewhere.
  const InterleavedWeights* interleaved = nullptr;

  size_t row_bytes() const { return weight_row_bytes(type, cols); }
  size_t bytes() const { return row_bytes() * size_t(rows); }
  const uint8_t* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) + size_t(r) * row_bytes();
  }
};

// Dequantizes row r of w into out (cols floats). Used for embedding lookup.
void dequantize_row(const WeightMatrix& w, int64_t r, float* out);

}  // namespace kvserve
