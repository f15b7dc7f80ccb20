// Quest's per-block key summaries: for every block of `block_size` keys and
// every KV head, the per-channel minimum and maximum of the keys. For a query
// q, sum_c max(q_c * min_c, q_c * max_c) bounds q·k from above for every key
// k of the block, so the blocks with the largest bounds are the ones that can
// hold the largest attention scores; reading only those saves reads (not
// memory: every key is kept).
//
// Keys arrive as they are written — a token at a time during decode, a block
// or a whole prompt at a time during prefill — and the summary of the last,
// partly filled block is kept exact for the tokens it has. Raw float arrays
// only: no dependency on the KV cache's blocks or codecs, so the summaries of
// quantized keys are the summaries of whatever floats the caller hands in
// (the keys before encoding, the usual choice, or the decoded ones).
//
// Thread safety: const methods may run concurrently; append/clear need
// exclusive access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvserve {

struct BlockSummaryOptions {
  int block_size = 16;  // keys per summarised block, in tokens (Quest's page size; use the KV cache's block size)
  int n_kv_heads = 1;   // KV heads summarised side by side
  int head_dim = 64;    // channels per KV head
};

// How the bounds of a GQA group's query heads combine into one score per
// block, since the group shares one KV head and so one block choice.
enum class GroupCombine : uint8_t {
  // The largest bound over the group: a block is chosen when any query head
  // may attend to it strongly (keeps each head's heavy blocks; the default).
  Max,
  // The sum of the bounds: blocks good for the whole group first.
  Sum,
};

class BlockSummary {
 public:
  // Throws kvserve::Error when a size is not positive.
  explicit BlockSummary(const BlockSummaryOptions& options);

  const BlockSummaryOptions& options() const { return options_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_blocks() const { return (num_tokens_ + options_.block_size - 1) / options_.block_size; }

  // Appends the keys of the next tokens, in token order:
  //   keys: (n, n_kv_heads, head_dim) floats — n rows of kv_dim
  // Any n, including ones that end or start mid-block. Throws kvserve::Error
  // when keys.size() is not a multiple of n_kv_heads * head_dim.
  void append(std::span<const float> keys);
  // Forgets every key (the next append starts block 0).
  void clear();

  // The per-channel bounds of block `block` for KV head `kv_head`: head_dim
  // floats each. REQUIRES: block < num_blocks(), kv_head < n_kv_heads.
  const float* block_min(int64_t block, int kv_head) const;
  const float* block_max(int64_t block, int kv_head) const;

  // Upper bounds of q·k over each block's keys for the query heads sharing
  // KV head `kv_head`, combined over the group:
  //   q:      (group, head_dim) floats
  //   bounds: (num_blocks()) floats, overwritten
  // bound_i(b) = sum_c max(q_ic * min_bc, q_ic * max_bc) >= max_{k in b} q_i·k.
  // No 1/sqrt(head_dim) scale: a positive scale does not change the order.
  // AVX-512 when available.
  void upper_bounds(int kv_head, const float* q, int group, GroupCombine combine, float* bounds) const;
  // Scalar reference of upper_bounds, in double precision.
  void upper_bounds_reference(int kv_head, const float* q, int group, GroupCombine combine,
                              double* bounds) const;

  // The k blocks with the largest combined bound (ties: the lower block id),
  // in ascending block order so the caller reads memory forwards; all blocks
  // when k >= num_blocks(). bounds is scratch, left holding every block's
  // bound. Throws kvserve::Error when k < 1, group < 1 or kv_head is out of
  // range.
  void select(int kv_head, const float* q, int group, int k, GroupCombine combine, std::vector<int32_t>& blocks,
              std::vector<float>& bounds) const;
  [[nodiscard]] std::vector<int32_t> select(int kv_head, const float* q, int group, int k,
                                            GroupCombine combine = GroupCombine::Max) const;

  // Bytes held by the summaries (capacity, not size).
  size_t memory_bytes() const;

 private:
  void check_head(int kv_head, int group) const;

  BlockSummaryOptions options_;
  int64_t num_tokens_ = 0;
  // Per KV head: (block, 2, head_dim) floats — the block's minimum row, then
  // its maximum row. One KV head's summaries are contiguous, so scoring them
  // is one forward sweep.
  std::vector<std::vector<float>> bounds_;
};

}  // namespace kvserve
