// Kernels against their scalar references, with explicit error bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/interleaved_weights.h"
#include "kernels/matmul.h"
#include "kernels/quantize_q8.h"
#include "kernels/rope_table.h"
#include "kernels/vector_ops.h"
#include "kernels/weight_matrix.h"
#include "kernels/weight_quantize.h"
#include "util/half.h"
#include "util/simd.h"
#include "util/thread_pool.h"

namespace kvserve {
namespace {

// ---- Weight formats ----

void put_fp16(std::vector<uint8_t>& bytes, size_t at, float v) {
  const fp16_t h = fp32_to_fp16(v);
  std::memcpy(bytes.data() + at, &h, 2);
}

TEST(WeightMatrix, NamesAndRowBytes) {
  EXPECT_EQ(weight_type_name(WeightType::F32), "F32");
  EXPECT_EQ(weight_type_name(WeightType::F16), "F16");
  EXPECT_EQ(weight_type_name(WeightType::Q8_0), "Q8_0");
  EXPECT_EQ(weight_type_name(WeightType::Q4_0), "Q4_0");
  EXPECT_EQ(weight_type_name(WeightType::Q4_1), "Q4_1");
  EXPECT_EQ(weight_row_bytes(WeightType::F32, 96), 384u);
  EXPECT_EQ(weight_row_bytes(WeightType::F16, 96), 192u);
  EXPECT_EQ(weight_row_bytes(WeightType::Q8_0, 96), 102u);
  EXPECT_EQ(weight_row_bytes(WeightType::Q4_0, 96), 54u);
  EXPECT_EQ(weight_row_bytes(WeightType::Q4_1, 96), 60u);
  WeightMatrix w{WeightType::Q8_0, nullptr, 10, 64};
  EXPECT_EQ(w.row_bytes(), 68u);
  EXPECT_EQ(w.bytes(), 680u);
}

TEST(WeightMatrix, DequantizeF32AndF16) {
  const float f32[3] = {1.5f, -2.25f, 0.0f};
  WeightMatrix w32{WeightType::F32, f32, 1, 3};
  float out[3];
  dequantize_row(w32, 0, out);
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.25f);
  EXPECT_EQ(out[2], 0.0f);

  const fp16_t f16[2][3] = {{0x3C00, 0xC000, 0x3800}, {0x0000, 0x4200, 0xBC00}};  // 1,-2,.5 / 0,3,-1
  WeightMatrix w16{WeightType::F16, f16, 2, 3};
  dequantize_row(w16, 1, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 3.0f);
  EXPECT_EQ(out[2], -1.0f);
}

TEST(WeightMatrix, DequantizeQ8_0) {
  // Two rows of two blocks; row 1 block 1 has d = 0.5 and q[j] = j - 16.
  std::vector<uint8_t> bytes(2 * 2 * 34, 0);
  const size_t block = (1 * 2 + 1) * 34;
  put_fp16(bytes, block, 0.5f);
  for (int j = 0; j < 32; ++j) bytes[block + 2 + size_t(j)] = uint8_t(int8_t(j - 16));
  put_fp16(bytes, 2 * 34, 4.0f);  // row 1 block 0: d = 4, q = 0
  bytes[2 * 34 + 2 + 31] = uint8_t(int8_t(-128));
  WeightMatrix w{WeightType::Q8_0, bytes.data(), 2, 64};
  std::vector<float> out(64);
  dequantize_row(w, 1, out.data());
  for (int j = 0; j < 31; ++j) EXPECT_EQ(out[size_t(j)], 0.0f);
  EXPECT_EQ(out[31], -512.0f);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[size_t(32 + j)], 0.5f * float(j - 16)) << j;
}

TEST(WeightMatrix, DequantizeQ4_0) {
  // Element j < 16 is the low nibble of qs[j], element j + 16 the high nibble.
  std::vector<uint8_t> bytes(2 * 18, 0);
  put_fp16(bytes, 18, 2.0f);
  for (int j = 0; j < 16; ++j) bytes[18 + 2 + size_t(j)] = uint8_t(j | (15 - j) << 4);
  WeightMatrix w{WeightType::Q4_0, bytes.data(), 2, 32};
  std::vector<float> out(32);
  dequantize_row(w, 1, out.data());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[size_t(j)], 2.0f * float(j - 8)) << j;
    EXPECT_EQ(out[size_t(j + 16)], 2.0f * float(7 - j)) << j;
  }
}

TEST(WeightMatrix, DequantizeQ4_1) {
  // Q4_0's nibble order; x = d * nibble + m.
  std::vector<uint8_t> bytes(2 * 20, 0);
  put_fp16(bytes, 20, 0.5f);
  put_fp16(bytes, 22, -3.25f);
  for (int j = 0; j < 16; ++j) bytes[20 + 4 + size_t(j)] = uint8_t(j | (15 - j) << 4);
  WeightMatrix w{WeightType::Q4_1, bytes.data(), 2, 32};
  std::vector<float> out(32);
  dequantize_row(w, 1, out.data());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[size_t(j)], 0.5f * float(j) - 3.25f) << j;
    EXPECT_EQ(out[size_t(j + 16)], 0.5f * float(15 - j) - 3.25f) << j;
  }
}

TEST(WeightQuantize, Q4_1RoundTripsWithinHalfAStep) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(-0.7f, 0.3f);
  std::vector<float> x(96);
  for (auto& v : x) v = u(rng);
  std::vector<uint8_t> bytes;
  quantize_row(WeightType::Q4_1, x.data(), 96, bytes);
  ASSERT_EQ(bytes.size(), weight_row_bytes(WeightType::Q4_1, 96));
  std::vector<float> y(96);
  dequantize_row(WeightMatrix{WeightType::Q4_1, bytes.data(), 1, 96}, 0, y.data());
  for (int b = 0; b < 3; ++b) {
    const auto [lo, hi] = std::minmax_element(x.begin() + 32 * b, x.begin() + 32 * b + 32);
    // Half a step of (max - min) / 15, plus the fp16 rounding of d and m.
    const float step = (*hi - *lo) / 15.0f;
    for (int j = 32 * b; j < 32 * b + 32; ++j)
      EXPECT_NEAR(y[size_t(j)], x[size_t(j)], step * (0.5f + 16.0f / 2048.0f) + std::fabs(*lo) / 2048.0f) << j;
  }
}

// ---- Activation quantization ----

TEST(QuantizeQ8, ErrorAtMostHalfAStepAndPaddingZero) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int64_t n = 3, cols = 96;  // 3 blocks, padded to 4
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (auto& v : x) v = dist(rng);
  for (int64_t i = 0; i < 32; ++i) x[size_t(i)] = 0.0f;  // an all-zero block: d = 0
  QuantizedRows q;
  quantize_rows_q8(x.data(), n, cols, nullptr, q);
  ASSERT_EQ(q.blocks, 3);
  ASSERT_EQ(q.padded_blocks, 4);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < 3; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[size_t(t * cols + b * 32 + j)]));
      EXPECT_FLOAT_EQ(q.row_d(t)[b], amax / 127.0f);
      for (int j = 0; j < 32; ++j) {
        const float orig = x[size_t(t * cols + b * 32 + j)];
        const float back = q.row_d(t)[b] * float(q.row_qs(t)[b * 32 + j]);
        EXPECT_LE(std::fabs(orig - back), amax / 254.0f * 1.0001f);
      }
    }
    EXPECT_EQ(q.row_d(t)[3], 0.0f);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(q.row_qs(t)[3 * 32 + j], 0);
  }
}

// The integer kernels rely on q != -128 (AVX2 multiplies |w| by q sign(w)),
// so no input may produce it: extremes, NaN, infinities, subnormals.
TEST(QuantizeQ8, NeverWritesMinus128) {
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  const float tiny = std::numeric_limits<float>::denorm_min(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> specials = {
      {-1.0f, 1.0f}, {-big, big}, {-big, 1.0f}, {-inf, 1.0f}, {inf, -inf}, {nan, -1.0f}, {-tiny, tiny},
      {-tiny, 0.0f}, {-1e-38f, 1e-45f}, {-127.5f, 127.0f}, {-3.0e38f, -2.9e38f}};
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> pick(0, 31);
  for (const auto& values : specials)
    for (int trial = 0; trial < 64; ++trial) {
      float x[32];
      for (float& v : x) v = values[size_t(pick(rng)) % values.size()];
      x[pick(rng)] = values[0];  // the first value is always in the block
      alignas(64) int8_t q[32];
      float d = 0;
      quantize_block_q8(x, q, &d);
      for (int j = 0; j < 32; ++j) ASSERT_GE(int(q[j]), -127) << "input " << x[j] << " trial " << trial;
    }
}

// ---- Matmul ----

struct TestMatrix {
  WeightType type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  WeightMatrix view() const { return {type, bytes.data(), rows, cols}; }
};

TestMatrix random_matrix(WeightType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  TestMatrix m{type, rows, cols, std::vector<uint8_t>(weight_row_bytes(type, cols) * size_t(rows))};
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.002f, 0.05f);
  std::uniform_int_distribution<int> byte(0, 255);
  const size_t values = size_t(rows * cols);
  switch (type) {
    case WeightType::F32: {
      std::vector<float> v(values);
      for (auto& f : v) f = val(rng);
      std::memcpy(m.bytes.data(), v.data(), m.bytes.size());
      break;
    }
    case WeightType::F16:
      for (size_t i = 0; i < values; ++i) put_fp16(m.bytes, 2 * i, val(rng));
      break;
    case WeightType::Q8_0:
    case WeightType::Q4_0: {
      const size_t block_bytes = type == WeightType::Q8_0 ? 34 : 18;
      for (size_t b = 0; b < values / 32; ++b) {
        put_fp16(m.bytes, b * block_bytes, scale(rng));
        // Any byte: for Q8_0 this includes q = -128, legal though quantizers never write it.
        for (size_t j = 2; j < block_bytes; ++j) m.bytes[b * block_bytes + j] = uint8_t(byte(rng));
      }
      break;
    }
    case WeightType::Q4_1:
      for (size_t b = 0; b < values / 32; ++b) {
        // Mins around the -8 d of a symmetric block, so that sums cancel as
        // real ones do, and past it both ways.
        const float d = scale(rng);
        put_fp16(m.bytes, b * 20, d);
        put_fp16(m.bytes, b * 20 + 2, -d * 16.0f * float(byte(rng)) / 255.0f);
        for (size_t j = 4; j < 20; ++j) m.bytes[b * 20 + j] = uint8_t(byte(rng));
      }
      break;
  }
  return m;
}

std::vector<float> random_activations(int64_t n, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (auto& v : x) v = dist(rng);
  // An outlier per row, as real activations have: stresses per-block scaling.
  for (int64_t t = 0; t < n; ++t) x[size_t(t * cols + (t * 7) % cols)] = 20.0f;
  return x;
}

// Allowed |matmul - reference| for output (t, r).
// Float math: the kernels sum in fp32 with at most cols/16 + 16 dependent adds,
// so the rounding error is far below `rel` * sum |w||x| for these sizes.
// Quantized weights add the activation quantization error, which is exactly
// bounded: |x - d q| <= max|x_block| / 254 per value, so
//   |sum w (x - x~)| <= sum_blocks max|x_block| / 254 * sum_block |w|.
std::vector<double> error_bounds(const WeightMatrix& w, const std::vector<float>& x, int64_t n,
                                 double rel) {
  const bool quantized = w.type == WeightType::Q8_0 || w.type == WeightType::Q4_0 || w.type == WeightType::Q4_1;
  std::vector<double> bound(static_cast<size_t>(n * w.rows));
  std::vector<float> row(static_cast<size_t>(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w, r, row.data());
    for (int64_t t = 0; t < n; ++t) {
      const float* xt = x.data() + t * w.cols;
      double abs_sum = 0.0, quant = 0.0;
      for (int64_t b = 0; b * 32 < w.cols; ++b) {
        double amax = 0.0, wsum = 0.0;
        for (int64_t k = b * 32; k < std::min<int64_t>(w.cols, b * 32 + 32); ++k) {
          abs_sum += std::fabs(double(row[size_t(k)]) * double(xt[k]));
          amax = std::max(amax, std::fabs(double(xt[k])));
          wsum += std::fabs(double(row[size_t(k)]));
        }
        quant += amax / 254.0 * wsum;
      }
      bound[size_t(t * w.rows + r)] = rel * abs_sum + (quantized ? quant * 1.001 : 0.0) + 1e-30;
    }
  }
  return bound;
}

double relative_tolerance(WeightType t) {
  switch (t) {
    case WeightType::F32: return 1e-5;
    case WeightType::F16: return 1e-4;
    default: return 1e-5;  // on top of the quantization bound
  }
}

struct Shape {
  int64_t rows, cols;
};

// interleave: run the Q8_0/Q4_0/Q4_1 matrix through its interleaved copy.
void check_matmul(WeightType type, Shape s, int64_t n, int threads, bool interleave = false) {
  std::mt19937 rng(uint32_t(s.rows * 1000 + s.cols * 10 + n));
  const TestMatrix m = random_matrix(type, s.rows, s.cols, rng);
  WeightMatrix w = m.view();
  std::unique_ptr<InterleavedWeights> packed;
  if (interleave) {
    packed = make_interleaved(w);
    ASSERT_NE(packed, nullptr);
    w.interleaved = packed.get();
  }
  const std::vector<float> x = random_activations(n, s.cols, rng);
  std::vector<float> want(static_cast<size_t>(n * s.rows)), got(size_t(n * s.rows), NAN);
  matmul_reference(w, x.data(), want.data(), n);
  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(threads);
  matmul(w, x.data(), got.data(), n, pool.get());
  const std::vector<double> bound = error_bounds(w, x, n, relative_tolerance(type));
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    const double err = std::fabs(double(got[i]) - double(want[i]));
    if (!(err <= bound[i])) {
      ++failures;
      ADD_FAILURE() << weight_type_name(type) << (interleave ? " interleaved" : "") << " rows=" << s.rows << " cols=" << s.cols
                    << " n=" << n << " threads=" << threads << " token=" << i / size_t(s.rows)
                    << " row=" << i % size_t(s.rows) << ": got " << got[i] << " want " << want[i]
                    << " bound " << bound[i];
    }
  }
}

class MatmulTest : public ::testing::TestWithParam<WeightType> {};

TEST_P(MatmulTest, MatchesReferenceWithinBound) {
  const WeightType type = GetParam();
  const bool quantized = type == WeightType::Q8_0 || type == WeightType::Q4_0 || type == WeightType::Q4_1;
  // Rows off the 4-row tile and the 32-row thread grain; odd and even block counts.
  std::vector<Shape> shapes = {{1, 32}, {3, 64}, {5, 96}, {37, 160}, {130, 256}, {67, 544}};
  if (!quantized) {
    shapes.push_back({9, 1});
    shapes.push_back({6, 17});
    shapes.push_back({70, 95});
  }
  for (Shape s : shapes)
    for (int64_t n : {1, 3, 7, 64, 70})
      for (int threads : {1, 2, 3}) check_matmul(type, s, n, threads);
}

TEST_P(MatmulTest, ThreadedResultIsIdenticalToSingleThreaded) {
  // Each output is computed by one thread with the same code, so the split must
  // not change a single bit.
  std::mt19937 rng(11);
  const TestMatrix m = random_matrix(GetParam(), 203, 320, rng);
  const std::vector<float> x = random_activations(9, 320, rng);
  std::vector<float> y1(9 * 203), y3(9 * 203);
  matmul(m.view(), x.data(), y1.data(), 9, nullptr);
  ThreadPool pool(3);
  matmul(m.view(), x.data(), y3.data(), 9, &pool);
  EXPECT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatmulTest,
                         ::testing::Values(WeightType::F32, WeightType::F16, WeightType::Q8_0,
                                           WeightType::Q4_0, WeightType::Q4_1),
                         [](const auto& info) { return std::string(weight_type_name(info.param)); });

// When every activation block has max |x| = 127 and integer values, the Q8
// activation quantization is exact (d = 1), so quantized matmul must agree with
// the reference to float rounding: this pins the block layout exactly.
TEST(MatmulQuantized, ExactWhenActivationsAreRepresentable) {
  for (WeightType type : {WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1}) {
    std::mt19937 rng(5);
    const int64_t rows = 13, cols = 160, n = 6;
    const TestMatrix m = random_matrix(type, rows, cols, rng);
    std::uniform_int_distribution<int> q(-127, 127);
    std::vector<float> x(static_cast<size_t>(n * cols));
    for (size_t i = 0; i < x.size(); ++i) x[i] = i % 32 == 5 ? (i % 64 == 5 ? 127.0f : -127.0f) : float(q(rng));
    std::vector<float> want(static_cast<size_t>(n * rows)), got(static_cast<size_t>(n * rows));
    matmul_reference(m.view(), x.data(), want.data(), n);
    matmul(m.view(), x.data(), got.data(), n, nullptr);
    for (size_t i = 0; i < got.size(); ++i) {
      double abs_sum = 0;
      const int64_t t = int64_t(i) / rows, r = int64_t(i) % rows;
      std::vector<float> row(static_cast<size_t>(cols));
      dequantize_row(m.view(), r, row.data());
      for (int64_t k = 0; k < cols; ++k) abs_sum += std::fabs(double(row[size_t(k)]) * x[size_t(t * cols + k)]);
      EXPECT_NEAR(got[i], want[i], 1e-6 * abs_sum) << weight_type_name(type) << " i=" << i;
    }
  }
}

// Whether this build makes interleaved copies of type t.
bool interleaves(WeightType t) {
  return t == WeightType::Q4_1 ? native_q4_1_supported() : interleaved_weights_supported();
}
const char* const kNoInterleavedKernel =
    "no interleaved kernel for this type in this build (needs AVX2; Q4_1: the 256-bit kernel)";

// The interleaved Q8_0/Q4_0/Q4_1 copies (AVX-512 VNNI and AVX2 builds; Q4_1
// on AVX2 only): rows off the 16- and 8-row groups, token counts off the
// 16-token tile and the 64-token chunk.
class MatmulInterleaved : public ::testing::TestWithParam<WeightType> {};

TEST_P(MatmulInterleaved, MatchesReferenceWithinBound) {
  if (!interleaves(GetParam())) GTEST_SKIP() << kNoInterleavedKernel;
  for (Shape s : std::vector<Shape>{{1, 32}, {13, 64}, {16, 96}, {37, 160}, {130, 256}, {67, 544}})
    for (int64_t n : {1, 3, 15, 16, 17, 64, 70, 130})
      for (int threads : {1, 2, 3}) check_matmul(GetParam(), s, n, threads, true);
}

TEST_P(MatmulInterleaved, ExactWhenActivationsAreRepresentable) {
  if (!interleaves(GetParam())) GTEST_SKIP() << kNoInterleavedKernel;
  std::mt19937 rng(5);
  const int64_t rows = 29, cols = 160, n = 19;
  const TestMatrix m = random_matrix(GetParam(), rows, cols, rng);
  std::uniform_int_distribution<int> q(-127, 127);
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 32 == 5 ? (i % 64 == 5 ? 127.0f : -127.0f) : float(q(rng));
  const auto packed = make_interleaved(m.view());
  WeightMatrix w = m.view();
  w.interleaved = packed.get();
  std::vector<float> want(static_cast<size_t>(n * rows)), got(static_cast<size_t>(n * rows), NAN);
  matmul_reference(m.view(), x.data(), want.data(), n);
  matmul(w, x.data(), got.data(), n, nullptr);
  std::vector<float> row(static_cast<size_t>(cols));
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t t = int64_t(i) / rows, r = int64_t(i) % rows;
    dequantize_row(m.view(), r, row.data());
    double abs_sum = 0;
    for (int64_t k = 0; k < cols; ++k) abs_sum += std::fabs(double(row[size_t(k)]) * x[size_t(t * cols + k)]);
    EXPECT_NEAR(got[i], want[i], 1e-6 * abs_sum) << "i=" << i;
  }
}

// The kernels' 16-bit partial sums at their largest: Q8_0 q = -128 and 127,
// Q4_0 nibbles of 15 (q = 7), Q4_1 nibbles of 15 (with no offset taken off,
// the same int16 pair sums: 8 pairs of 2 * 15 * 127), against x = +-127 of
// one sign, and against alternating signs, through the interleaved copy and
// the checkpoint layout. Integer activations with max |x| = 127 quantize
// exactly, so the result must equal the reference to float rounding.
TEST_P(MatmulInterleaved, ExactAtTheLargestPartialSums) {
  const WeightType type = GetParam();
  const int64_t rows = 19, cols = 128, n = 6;
  TestMatrix m{type, rows, cols, std::vector<uint8_t>(weight_row_bytes(type, cols) * size_t(rows))};
  const size_t block_bytes = type == WeightType::Q8_0 ? 34 : type == WeightType::Q4_0 ? 18 : 20;
  const size_t header = type == WeightType::Q4_1 ? 4 : 2;
  for (size_t b = 0; b < m.bytes.size() / block_bytes; ++b) {
    put_fp16(m.bytes, b * block_bytes, 1.0f);
    // Q4_1's min: -8 (Q4_0's values) in odd rows, 0.25 in even ones.
    const bool odd_row = (b / size_t(cols / 32)) % 2 == 1;
    if (type == WeightType::Q4_1) put_fp16(m.bytes, b * block_bytes + 2, odd_row ? -8.0f : 0.25f);
    // Q8_0: q = -128 in even rows, 127 in odd ones (the largest |q| and the
    // largest q + 128); Q4_0, Q4_1: every nibble 15 in odd blocks, 0 in even ones.
    const uint8_t fill = type == WeightType::Q8_0 ? (odd_row ? 0x7F : 0x80) : (b % 2 ? 0xFF : 0x00);
    std::memset(m.bytes.data() + b * block_bytes + header, fill, block_bytes - header);
  }
  std::vector<float> x(size_t(n * cols));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < cols; ++k)
      x[size_t(t * cols + k)] = t == 0 ? 127.0f : t == 1 ? -127.0f : t == 2 ? (k % 2 ? 127.0f : -127.0f)
                                                                    : float((t * 37 + k * 11) % 255 - 127);
  for (int64_t t = 3; t < n; ++t) x[size_t(t * cols)] = 127.0f;  // max |x| = 127 in each row's first block
  for (int64_t t = 3; t < n; ++t)
    for (int64_t b = 1; b < cols / 32; ++b) x[size_t(t * cols + b * 32)] = -127.0f;
  std::vector<float> want(size_t(n * rows));
  matmul_reference(m.view(), x.data(), want.data(), n);
  for (bool interleave : {false, true}) {
    if (interleave && !interleaves(type)) continue;
    const auto packed = interleave ? make_interleaved(m.view()) : nullptr;
    WeightMatrix w = m.view();
    w.interleaved = packed.get();
    std::vector<float> got(size_t(n * rows), NAN);
    matmul(w, x.data(), got.data(), n, nullptr);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-3)
          << weight_type_name(type) << (interleave ? " interleaved" : "") << " i=" << i;
  }
}

TEST_P(MatmulInterleaved, ThreadedResultIsIdenticalToSingleThreaded) {
  if (!interleaves(GetParam())) GTEST_SKIP() << kNoInterleavedKernel;
  std::mt19937 rng(12);
  const TestMatrix m = random_matrix(GetParam(), 203, 320, rng);
  const auto packed = make_interleaved(m.view());
  WeightMatrix w = m.view();
  w.interleaved = packed.get();
  const std::vector<float> x = random_activations(21, 320, rng);
  std::vector<float> y1(21 * 203), y3(21 * 203);
  matmul(w, x.data(), y1.data(), 21, nullptr);
  ThreadPool pool(3);
  matmul(w, x.data(), y3.data(), 21, &pool);
  EXPECT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(QuantizedTypes, MatmulInterleaved,
                         ::testing::Values(WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1),
                         [](const auto& info) { return std::string(weight_type_name(info.param)); });

// Q4_1's min term is added per call tile of up to 4 tokens (AVX2): every
// token count from 1 to 20 and past the 64-token chunk, odd block counts,
// rows off the 8-row group.
TEST(MatmulInterleavedQ4_1, EveryTokenCountAndOddBlockCounts) {
  if (!native_q4_1_supported()) GTEST_SKIP() << kNoInterleavedKernel;
  std::vector<int64_t> counts;
  for (int64_t n = 1; n <= 20; ++n) counts.push_back(n);
  for (int64_t n : {63, 64, 65, 67, 129}) counts.push_back(n);
  for (Shape s : std::vector<Shape>{{3, 96}, {11, 224}, {21, 352}})
    for (int64_t n : counts) check_matmul(WeightType::Q4_1, s, n, n % 3 == 0 ? 2 : 1, true);
}

// Q, K and V (and a fourth) in one call: each output bit-identical to its
// own matmul, with and without the interleaved copies, for shapes off the
// 16-row group and a mix of Q8_0, Q4_0 and Q4_1.
TEST(MatmulSharedInput, EqualsOneMatmulPerMatrix) {
  std::mt19937 rng(21);
  const int64_t cols = 192, n = 18;
  std::vector<TestMatrix> ms;
  ms.push_back(random_matrix(WeightType::Q8_0, 64, cols, rng));
  ms.push_back(random_matrix(WeightType::Q4_0, 21, cols, rng));
  ms.push_back(random_matrix(WeightType::Q8_0, 37, cols, rng));
  ms.push_back(random_matrix(WeightType::Q4_1, 19, cols, rng));
  const std::vector<float> x = random_activations(n, cols, rng);
  for (bool interleave : {false, true}) {
    std::vector<std::unique_ptr<InterleavedWeights>> packed;
    std::vector<WeightMatrix> w;
    for (const TestMatrix& m : ms) {
      w.push_back(m.view());
      if (interleave && interleaves(m.type)) {
        packed.push_back(make_interleaved(w.back()));
        w.back().interleaved = packed.back().get();
      }
    }
    std::vector<std::vector<float>> one(4), many(4);
    ThreadPool pool(2);
    for (size_t i = 0; i < 4; ++i) {
      one[i].resize(size_t(n * w[i].rows));
      many[i].assign(size_t(n * w[i].rows), NAN);
      matmul(w[i], x.data(), one[i].data(), n, &pool);
    }
    matmul_shared_input({&w[0], &w[1], &w[2], &w[3]}, {many[0].data(), many[1].data(), many[2].data(), many[3].data()},
                        x.data(), n, &pool);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(std::memcmp(one[i].data(), many[i].data(), one[i].size() * sizeof(float)), 0)
          << "matrix " << i << (interleave ? " interleaved" : "");
  }
}

TEST(MatmulInterleavedTypes, OnlyBlockQuantizedTypesAreInterleaved) {
  std::mt19937 rng(3);
  for (WeightType type : {WeightType::F32, WeightType::F16})
    EXPECT_EQ(make_interleaved(random_matrix(type, 4, 64, rng).view()), nullptr) << weight_type_name(type);
  for (WeightType type : {WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1})
    EXPECT_EQ(make_interleaved(random_matrix(type, 4, 64, rng).view()) != nullptr, interleaves(type))
        << weight_type_name(type);
}

TEST(Matmul, ZeroTokensWritesNothing) {
  std::mt19937 rng(1);
  const TestMatrix m = random_matrix(WeightType::Q8_0, 4, 64, rng);
  float y = 42.0f;
  matmul(m.view(), nullptr, &y, 0, nullptr);
  EXPECT_EQ(y, 42.0f);
}

// ---- Vector ops ----

std::vector<float> normal_vector(int64_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = dist(rng);
  return v;
}

const int64_t kSizes[] = {1, 7, 16, 31, 64, 100, 288, 4097};

TEST(VectorOps, RmsnormMatchesReference) {
  // Float sum of squares with relative error <= ~n/32 * 2^-24; 2e-6 relative per element.
  for (int64_t n : kSizes) {
    const auto x = normal_vector(n, 2.0f, uint32_t(n));
    const auto weight = normal_vector(n, 1.0f, uint32_t(n + 1));
    std::vector<float> got(static_cast<size_t>(n)), want(static_cast<size_t>(n));
    rmsnorm(got.data(), x.data(), weight.data(), n, 1e-5f);
    rmsnorm_reference(want.data(), x.data(), weight.data(), n, 1e-5f);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(got[size_t(i)], want[size_t(i)], 2e-6 * std::fabs(want[size_t(i)]) + 1e-30) << n;
    // In place.
    std::vector<float> inplace = x;
    rmsnorm(inplace.data(), inplace.data(), weight.data(), n, 1e-5f);
    EXPECT_EQ(inplace, got);
  }
}

TEST(VectorOps, SoftmaxMatchesReferenceAndIsStable) {
  for (bool outlier : {false, true})
    for (int64_t n : kSizes) {
      auto got = normal_vector(n, 5.0f, uint32_t(n));
      if (outlier) got[size_t(n / 2)] = 1000.0f;  // would overflow expf without subtracting the max
      auto want = got;
      softmax(got.data(), n);
      softmax_reference(want.data(), n);
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(got[size_t(i)]));
        // x - max is rounded to float and exp is within 2 ulp (1e-6 covers
        // both at this spread); the sum runs in 16 lanes of n / 16 values
        // combined in 4 steps, so it is within (n / 16 + 4) * 2^-24 relative
        // (worst case), or n * 2^-24 for a plain sum.
        const double rel = 1e-6 + double(std::min<int64_t>(n, n / 16 + 5)) * 6e-8;
        EXPECT_NEAR(got[size_t(i)], want[size_t(i)], rel * want[size_t(i)] + 1e-12) << n << " " << i;
        sum += got[size_t(i)];
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  float all_neg[3] = {-1000.0f, -1001.0f, -1000.0f};
  softmax(all_neg, 3);
  EXPECT_NEAR(all_neg[0], 0.4223188, 1e-6);
  EXPECT_NEAR(all_neg[1], 0.1553624, 1e-6);
}

// exp_shifted is softmax before its division: the largest value becomes
// exactly 1, and the returned sum divides every value back into softmax.
TEST(VectorOps, ExpShiftedIsSoftmaxTimesItsSum) {
  for (int64_t n : kSizes) {
    auto x = normal_vector(n, 5.0f, uint32_t(n) + 7);
    auto want = x;
    softmax(want.data(), n);
    const float sum = exp_shifted(x.data(), n);
    ASSERT_EQ(*std::max_element(x.begin(), x.end()), 1.0f) << n;
    ASSERT_GE(sum, 1.0f);
    ASSERT_LE(sum, float(n));
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[size_t(i)] / sum, want[size_t(i)]) << n << " " << i;
  }
  EXPECT_EQ(exp_shifted(nullptr, 0), 0.0f);
}

// softmax({0, x}) for x < -17 is exp(x) itself (1 + e^x rounds to 1), so this
// checks the exponential on every reduced argument: within 2 ulp of the exact
// value, and 0 (not NaN) once e^x rounds to 0 in float.
TEST(VectorOps, SoftmaxExponentialIsWithinTwoUlp) {
  double worst = 0;
  for (float x = -87.0f; x <= -17.0f; x += 7.7e-4f) {
    float v[2] = {0.0f, x};
    softmax(v, 2);
    const double want = std::exp(double(x));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::fabs(double(v[1]) - want) / ulp);
  }
  EXPECT_LE(worst, 2.0);
  // Subnormal results (AVX2 scales by two powers of two, AVX-512 by scalef):
  // within one step of the subnormal grid (2^-149).
  double worst_sub = 0;
  for (float x = -103.5f; x <= -87.5f; x += 3.1e-3f) {
    float v[2] = {0.0f, x};
    softmax(v, 2);
    worst_sub = std::max(worst_sub, std::fabs(double(v[1]) - std::exp(double(x))) / std::ldexp(1.0, -149));
  }
  EXPECT_LE(worst_sub, 1.0);
  float tiny[4] = {0.0f, -104.0f, -500.0f, -INFINITY};
  softmax(tiny, 4);
  EXPECT_EQ(tiny[0], 1.0f);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(tiny[i], 0.0f) << i;
}

#if defined(__AVX2__) && defined(__FMA__)
// The vector exponential is one sequence of float operations on every tier
// (AVX-512 scales by scalef; AVX2 rounds through 1.5 * 2^23 and adds to the
// exponent field, or takes two powers of two where a lane is subnormal):
// each lane must equal that sequence done in scalar, bit for bit, including
// vectors that mix normal and subnormal lanes.
float exp_nonpositive_sequence(float x) {
  x = std::max(x, -104.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693145751953125f, x);
  r = std::fma(-n, 1.42860676533018708e-6f, r);
  float p = 1.0f / 5040;
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = std::fma(p, r, c);
  return std::ldexp(p, int(n));  // one rounding, subnormal results included
}

TEST(VectorOps, VectorExponentialIsOneSequenceOfOperations) {
  long mismatches = 0, subnormal = 0;
  for (float x = -112.0f; x <= 0.0f; x += 1.7e-4f) {
    // Lane k: x shifted so that some vectors are all normal results, some
    // mixed, some all subnormal or zero.
    alignas(32) float in[8], out[8];
    for (int k = 0; k < 8; ++k) in[k] = std::max(x - 3.5f * float(k), -120.0f);
    _mm256_store_ps(out, simd::exp_nonpositive(_mm256_load_ps(in)));
    for (int k = 0; k < 8; ++k) {
      const float want = exp_nonpositive_sequence(in[k]);
      subnormal += want != 0.0f && want < std::numeric_limits<float>::min();
      if (std::memcmp(&out[k], &want, sizeof want) != 0 && ++mismatches <= 5)
        ADD_FAILURE() << "exp(" << in[k] << ") = " << out[k] << ", the sequence gives " << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(subnormal, 10000);  // the slow path was taken
}
#endif

TEST(VectorOps, SiluMulMatchesReference) {
  for (int64_t n : kSizes) {
    auto gate = normal_vector(n, 4.0f, uint32_t(n));
    const auto up = normal_vector(n, 1.0f, uint32_t(n + 3));
    auto want = gate;
    silu_mul(gate.data(), up.data(), n);
    silu_mul_reference(want.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(gate[size_t(i)], want[size_t(i)], 1e-6 * std::fabs(want[size_t(i)]) + 1e-30);
  }
  // Saturated and underflowing sigmoids (the SIMD path rewrites the
  // expression). The scalar path keeps llama2.c's v / (1 + e^-v), whose e^90
  // overflows to inf and gives 0 where the exact value is -1.1e-37: hence the
  // absolute 1e-36.
  float gate[6] = {90.0f, -90.0f, -200.0f, 0.0f, 20.0f, -20.0f};
  float want[6];
  std::copy(gate, gate + 6, want);
  const float up[6] = {1.5f, 1.5f, 1.5f, 1.5f, -2.0f, -2.0f};
  silu_mul(gate, up, 6);
  silu_mul_reference(want, up, 6);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(gate[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-36) << i;
}

// A query rotated back by pos meets an unrotated key as the query meets the
// key rotated by rope(): dot(rotate_back(q, pos), k) == dot(q, rope(k, pos)),
// for every head of a run (the SIMD lanes and the scalar tail).
TEST(VectorOps, RopeTableRotatesQueriesBack) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int hd : {64, 8, 6}) {
    const RopeTable table(40, hd, 10000.0f);
    for (int pos : {0, 1, 17, 39}) {
      const int n = 3;
      std::vector<float> q(size_t(n) * hd), k(size_t(n) * hd), back(q.size());
      for (auto& x : q) x = normal(rng);
      for (auto& x : k) x = normal(rng);
      table.rotate_back(q.data(), n, pos, back.data());
      std::vector<float> rotated = k;
      rope(rotated.data(), n, hd, pos, 10000.0f);
      for (int h = 0; h < n; ++h) {
        double want = 0, got = 0, scale = 0;
        for (int d = 0; d < hd; ++d) {
          want += double(q[size_t(h * hd + d)]) * rotated[size_t(h * hd + d)];
          got += double(back[size_t(h * hd + d)]) * k[size_t(h * hd + d)];
          scale += std::fabs(double(q[size_t(h * hd + d)]) * k[size_t(h * hd + d)]);
        }
        EXPECT_NEAR(got, want, 1e-5 * scale) << "head_dim " << hd << " pos " << pos << " head " << h;
      }
    }
  }
}

// Past RopeTable::kRows a position turns by two rows (a multiple of kRows,
// then the rest): against the exact rotation in double, it errs no more than
// the float angle itself can (pos * freq rounded: up to 2^-6 rad here).
TEST(VectorOps, RopeTablePastItsRowsTurnsByTwo) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int hd = 16, max_pos = 3 * RopeTable::kRows + 100;
  const RopeTable table(max_pos, hd, 10000.0f);
  EXPECT_EQ(table.rows(), RopeTable::kRows);
  for (int pos : {RopeTable::kRows - 1, RopeTable::kRows, RopeTable::kRows + 1, 40000, max_pos - 1}) {
    std::vector<float> q(hd), k(hd), back(hd);
    for (auto& x : q) x = normal(rng);
    for (auto& x : k) x = normal(rng);
    table.rotate_back(q.data(), 1, pos, back.data());
    double exact = 0, got = 0, scale = 0;
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = double(pos) * std::pow(10000.0, -2.0 * i / hd), c = std::cos(angle), s = std::sin(angle);
      const double k0 = k[2 * i] * c - k[2 * i + 1] * s, k1 = k[2 * i] * s + k[2 * i + 1] * c;
      exact += q[2 * i] * k0 + q[2 * i + 1] * k1;
      scale += std::fabs(q[2 * i]) * std::fabs(k0) + std::fabs(q[2 * i + 1]) * std::fabs(k1);
    }
    for (int d = 0; d < hd; ++d) got += double(back[d]) * k[d];
    EXPECT_NEAR(got, exact, scale / 64) << "pos " << pos;
  }
}

TEST(VectorOps, RopeMatchesHandComputedValues) {
  // Two heads of head_dim 4, pos 3, theta 10000. Pair 0: angle 3; pair 1:
  // freq = 10000^(-2/4) = 0.01, angle 0.03.
  float x[8] = {1, 2, 3, 4, 1, 2, 3, 4};
  rope(x, 2, 4, 3, 10000.0f);
  const double c0 = -0.98999249660044542, s0 = 0.14112000805986721;  // cos 3, sin 3
  const double c1 = 0.99955003374898754, s1 = 0.029995500202495660;  // cos .03, sin .03
  const double want[4] = {1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(x[h * 4 + i], want[i], 2e-6) << h << " " << i;

  float same[4] = {0.5f, -1.5f, 2.0f, 7.0f};
  rope(same, 1, 4, 0, 10000.0f);  // pos 0 is the identity
  EXPECT_EQ(same[0], 0.5f);
  EXPECT_EQ(same[1], -1.5f);
  EXPECT_EQ(same[2], 2.0f);
  EXPECT_EQ(same[3], 7.0f);
}

TEST(VectorOps, RopeUsesLlama2cFloatAngles) {
  // llama2.c evaluates freq and angle in float; with a large pos the float
  // angle differs from the double one, and rope must follow the float one.
  const int head_dim = 64, pos = 1000;
  std::vector<float> x(head_dim);
  for (int i = 0; i < head_dim; ++i) x[size_t(i)] = float(i + 1) * 0.1f;
  std::vector<float> want = x;
  for (int i = 0; i < head_dim; i += 2) {
    const float freq = 1.0f / powf(10000.0f, float(i) / float(head_dim));
    const float val = float(pos) * freq;
    const float fcr = cosf(val), fci = sinf(val);
    const float v0 = want[size_t(i)], v1 = want[size_t(i + 1)];
    want[size_t(i)] = v0 * fcr - v1 * fci;
    want[size_t(i + 1)] = v0 * fci + v1 * fcr;
  }
  rope(x.data(), 1, head_dim, pos, 10000.0f);
  for (int i = 0; i < head_dim; ++i) EXPECT_NEAR(x[size_t(i)], want[size_t(i)], 1e-6f) << i;
}

TEST(VectorOps, DotMatchesReference) {
  for (int64_t n : {0L, 1L, 15L, 16L, 17L, 33L, 100L, 1000L, 4097L}) {
    const auto a = normal_vector(n, 1.0f, uint32_t(n)), b = normal_vector(n, 1.0f, uint32_t(n + 9));
    double abs_sum = 0;
    for (int64_t i = 0; i < n; ++i) abs_sum += std::fabs(double(a[size_t(i)]) * b[size_t(i)]);
    // <= n/32 + 32 dependent float adds: far under 1e-5 * sum |a b| for these n.
    EXPECT_NEAR(dot(a.data(), b.data(), n), dot_reference(a.data(), b.data(), n), 1e-5 * abs_sum + 1e-30)
        << n;
  }
}

TEST(VectorOps, AxpyMatchesScalar) {
  for (int64_t n : kSizes) {
    const auto x = normal_vector(n, 1.0f, uint32_t(n));
    auto y = normal_vector(n, 1.0f, uint32_t(n + 5));
    const std::vector<float> y0 = y;
    axpy(0.37f, x.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double want = double(y0[size_t(i)]) + 0.37 * double(x[size_t(i)]);
      // One rounding (FMA) or two (mul, add): within 2 ulp of the larger term.
      const double scale = std::fabs(y0[size_t(i)]) + std::fabs(0.37 * x[size_t(i)]);
      EXPECT_NEAR(y[size_t(i)], want, 2.5e-7 * scale) << i;
    }
  }
  float y[2] = {1.0f, 2.0f};
  axpy(2.0f, y, y + 1, 0);  // n = 0 touches nothing
  EXPECT_EQ(y[1], 2.0f);
}

}  // namespace
}  // namespace kvserve
