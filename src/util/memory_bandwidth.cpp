#include "util/memory_bandwidth.h"

#include "util/simd.h"

#include <algorithm>
#include <cstring>

#include "util/aligned_buffer.h"
#include "util/thread_pool.h"
#include "util/timer.h"

namespace kvserve {

float sum_floats(const float* data, int64_t n) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(data + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(data + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(data + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(data + i + 48));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
  // Four independent sums: one scalar chain of dependent adds ran at 5-13
  // GB/s, a third of what the memory gives (BENCHMARKS.md, "AVX2 machines").
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(data + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(data + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(data + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(data + i + 24));
  }
  float s = simd::hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float s = 0;
  int64_t i = 0;
#endif
  for (; i < n; ++i) s += data[i];
  return s;
}

float sum_buffer(ThreadPool& pool, const float* data, size_t n) {
  std::vector<float> sinks(size_t(pool.num_threads()) * 16, 0.0f);
  pool.parallel_for(int64_t(n), 4096, [&](int64_t begin, int64_t end, int thread) {
    // one cache line per thread: no false sharing
    sinks[size_t(thread) * 16] += sum_floats(data + begin, end - begin);
  });
  float total = 0;
  for (float s : sinks) total += s;
  return total;
}

double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes, int repeats) {
  const size_t n = bytes / sizeof(float) / 64 * 64;
  AlignedBuffer<float> buf(n);
  for (size_t i = 0; i < n; i += 1024) buf[i] = float(i);  // commit every page
  double best = 0;
  volatile float keep = 0;
  for (int r = 0; r < repeats; ++r) {
    Timer t;
    keep = keep + sum_buffer(pool, buf.data(), n);
    best = std::max(best, double(n * sizeof(float)) / t.seconds() / 1e9);
  }
  return best;
}

}  // namespace kvserve
