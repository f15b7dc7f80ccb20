// Precomputed RoPE rotations, (position, pair) -> (cos, sin), with exactly the
// expressions rope() uses. Attention over pre-RoPE keys rotates the query to
// every key's position, which would otherwise cost a sincos per key and pair.
#pragma once

#include <cstddef>
#include <vector>

namespace kvserve {

class RopeTable {
 public:
  // Positions [0, max_pos). head_dim even.
  RopeTable(int max_pos, int head_dim, float theta);

  // (head_dim / 2, {cos, sin}) floats for position pos.  REQUIRES: pos < max_pos.
  const float* at(int pos) const { return table_.data() + size_t(pos) * size_t(head_dim_); }
  int max_pos() const { return max_pos_; }

  // out (head_dim) = q rotated by -pos: then dot(out, k) == dot(q, rope(k, pos)).
  void rotate_back(const float* q, int pos, float* out) const;

 private:
  int max_pos_, head_dim_;
  std::vector<float> table_;  // (max_pos, head_dim / 2, 2)
};

}  // namespace kvserve
