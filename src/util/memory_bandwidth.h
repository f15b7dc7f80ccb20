// Measures the machine's sustainable memory read bandwidth, the ceiling of a
// memory-bound decode step, so benchmarks can report the fraction they reach.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvserve {

class ThreadPool;

// Sums n floats on this thread, with the read loop below (four independent
// sums of 64-byte loads). REQUIRES: data 64-byte aligned.
float sum_floats(const float* data, int64_t n);

// Sums n floats with all of the pool's threads (64-byte aligned loads): the
// read loop behind the bandwidth figures. REQUIRES: data 64-byte aligned.
float sum_buffer(ThreadPool& pool, const float* data, size_t n);

// Reads a buffer of `bytes` (well beyond the last-level cache) `repeats`
// times with all of the pool's threads; returns the best rate in GB/s (1e9).
double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes = size_t(1) << 30, int repeats = 5);

}  // namespace kvserve
