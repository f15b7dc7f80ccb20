// 8-bit (scale, min) pairs for integer KV codes. At 4 and 2 bits per value an
// fp16 pair per group is a large share of the bytes (per-channel key groups
// of 16 tokens: 2 bits per value, as much as INT2's codes). Here a run of
// groups (a KV head's channels for one token group, or a head's tokens in one
// block) shares a header of two fp16 units, and each group stores one byte
// for its scale and one for its min:
//   scale_g = fp16(d * 2^(-k_g / 16))   (k_g in 0..255: 4.4% apart, 16 binades)
//   min_g   = fp16(dm * m_g)            (m_g in -128..127, dm = max_g |lo_g| / 127)
// Scales are logarithmic because a head's channels differ by orders of
// magnitude (outlier channels); mins are linear because they sit on either
// side of zero. The encoder rounds each min down and each scale up, so the
// group's codes still cover [lo, hi] without clipping, then quantizes against
// the decoded pair: what decode returns is exactly what the codes mean. A
// group more than 2^16 times narrower than the run's widest gets the
// smallest scale, d * 2^(-255/16): still no clipping, just coarser codes.
// Run layout: d, dm (fp16), k[count] (uint8), m[count] (int8).
#pragma once

#include <cstddef>
#include <cstdint>

#include "util/half.h"

namespace kvserve::scale8 {

constexpr size_t kHeaderBytes = 2 * sizeof(fp16_t);
inline size_t run_bytes(int count) { return kHeaderBytes + 2 * size_t(count); }

// Stores the pairs of `count` groups, group g spanning [lo[g], hi[g]] with
// `levels` steps, into dst (run_bytes(count) bytes); scale/min receive the
// decoded pairs, which satisfy min_g <= lo_g and min_g + levels * scale_g >= hi_g
// (for finite inputs within fp16 range).
void encode_run(const float* lo, const float* hi, int count, int levels, uint8_t* dst, float* scale, float* min);
// The decoded pairs of a run, as floats.
void decode_run(const uint8_t* src, int count, float* scale, float* min);
// The same as interleaved fp16 (scale, min) pairs: the layout of 16-bit
// metadata, so kernels written for it read a decoded run unchanged.
void decode_run_pairs(const uint8_t* src, int count, fp16_t* pairs);
// Group g's decoded pair alone.
void decode_one(const uint8_t* src, int count, int g, float* scale, float* min);

}  // namespace kvserve::scale8
