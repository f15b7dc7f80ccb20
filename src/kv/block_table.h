// One sequence's map from logical token positions to physical KV blocks:
// token at position p lives in block blocks[p / block_size], slot p % block_size.
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

struct BlockTable {
  std::vector<int32_t> blocks;   // physical block ids, in logical order
  // For quantized caches with a residual window: the FP16 staging slot that
  // holds each block's recent tokens until the block is encoded, or -1 (same
  // length as blocks). Empty for caches without a residual window.
  std::vector<int32_t> staging;
  int32_t num_tokens = 0;        // tokens whose K/V are written, in tokens

  // Tokens the table's blocks can hold (block_size each).
  int32_t capacity(int32_t block_size) const { return int32_t(blocks.size()) * block_size; }
};

}  // namespace kvserve
