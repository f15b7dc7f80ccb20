#include "kernels/rope_table.h"

#include <cmath>

namespace kvserve {

RopeTable::RopeTable(int max_pos, int head_dim, float theta)
    : max_pos_(max_pos), head_dim_(head_dim), table_(size_t(max_pos) * size_t(head_dim)) {
  const int pairs = head_dim / 2;
  for (int pos = 0; pos < max_pos; ++pos)
    for (int i = 0; i < pairs; ++i) {
      // The same float expressions as rope(), so both paths rotate identically.
      const float freq = 1.0f / powf(theta, float(2 * i) / float(head_dim));
      const float val = float(pos) * freq;
      table_[size_t(pos) * head_dim + 2 * i] = cosf(val);
      table_[size_t(pos) * head_dim + 2 * i + 1] = sinf(val);
    }
}

void RopeTable::rotate_back(const float* q, int pos, float* out) const {
  const float* cs = at(pos);
  for (int i = 0; i < head_dim_ / 2; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1], q0 = q[2 * i], q1 = q[2 * i + 1];
    out[2 * i] = q0 * c + q1 * s;
    out[2 * i + 1] = q1 * c - q0 * s;
  }
}

}  // namespace kvserve
