// Precomputed RoPE rotations with exactly the expressions rope() uses.
// Attention over pre-RoPE keys rotates the query to every key's position,
// which would otherwise cost a sincos per key and pair. The table is stored
// in the form the SIMD rotation wants: per position, cos duplicated over each
// pair and sin with the sign of each lane's term.
#pragma once

#include <algorithm>
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
  // Positions with a row of their own: the first kRows. Past them,
  // rotate_back turns by two rows, one of a multiple of kRows and one under
  // it (R(a + b) = R(a) R(b) pair by pair), so a long context (Llama 3.1's
  // 131072, 128 MiB as one row each at head_dim 128) costs kRows rows and a
  // few more, not one per position.
  static constexpr int kRows = 16384;
  int rows() const { return std::min(max_pos_, kRows); }

  // out (head_dim) = q rotated by -pos: then dot(out, k) == dot(q, rope(k, pos)).
  // REQUIRES: 0 <= pos < max_pos.
  void rotate_back(const float* q, int pos, float* out) const { rotate_back(q, 1, pos, out); }
  // The same for n consecutive heads (n * head_dim floats).
  void rotate_back(const float* q, int n, int pos, float* out) const;
  // Row pos of the table (head_dim floats each): cos duplicated over each
  // pair, and sin with each lane's sign, so that rope(k, pos) == k * cos_row
  // - swap_pairs(k) * sin_row and rotate_back(q) == q * cos_row +
  // swap_pairs(q) * sin_row. REQUIRES: pos < rows().
  const float* cos_row(int pos) const { return table_.data() + size_t(pos) * 2 * size_t(head_dim_); }
  const float* sin_row(int pos) const { return cos_row(pos) + head_dim_; }
  int head_dim() const { return head_dim_; }

 private:
  int max_pos_, head_dim_;
  // (rows(), 2, head_dim): [c0 c0 c1 c1 ...] then [s0 -s0 s1 -s1 ...], so
  // out = q * cos_dup + swap_pairs(q) * sin_signed.
  std::vector<float> table_;
  // The same rows for positions 0, kRows, 2 kRows, ... below max_pos
  // (empty when max_pos <= kRows).
  std::vector<float> coarse_;
};

}  // namespace kvserve
