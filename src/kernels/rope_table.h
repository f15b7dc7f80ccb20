// Precomputed RoPE rotations with exactly the expressions rope() uses.
// Attention over pre-RoPE keys rotates the query to every key's position,
// which would otherwise cost a sincos per key and pair. The table is stored
// in the form the SIMD rotation wants: per position, cos duplicated over each
// pair and sin with the sign of each lane's term.
#pragma once

#include <cstddef>
#include <vector>

namespace kvserve {

class RopeTable {
 public:
  // Positions [0, max_pos). head_dim even; freqs: head_dim / 2 angles per
  // position, as rope() takes them.
  RopeTable(int max_pos, int head_dim, const std::vector<float>& freqs);
  // Unscaled RoPE of base theta.
  RopeTable(int max_pos, int head_dim, float theta);

  int max_pos() const { return max_pos_; }

  // out (head_dim) = q rotated by -pos: then dot(out, k) == dot(q, rope(k, pos)).
  // REQUIRES: pos < max_pos.
  void rotate_back(const float* q, int pos, float* out) const { rotate_back(q, 1, pos, out); }
  // The same for n consecutive heads (n * head_dim floats).
  void rotate_back(const float* q, int n, int pos, float* out) const;
  // Row pos of the table (head_dim floats each): cos duplicated over each
  // pair, and sin with each lane's sign, so that rope(k, pos) == k * cos_row
  // - swap_pairs(k) * sin_row and rotate_back(q) == q * cos_row +
  // swap_pairs(q) * sin_row.
  const float* cos_row(int pos) const { return table_.data() + size_t(pos) * 2 * size_t(head_dim_); }
  const float* sin_row(int pos) const { return cos_row(pos) + head_dim_; }
  int head_dim() const { return head_dim_; }

 private:
  int max_pos_, head_dim_;
  // (max_pos, 2, head_dim): [c0 c0 c1 c1 ...] then [s0 -s0 s1 -s1 ...], so
  // out = q * cos_dup + swap_pairs(q) * sin_signed.
  std::vector<float> table_;
};

}  // namespace kvserve
