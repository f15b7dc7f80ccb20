// Logits of every position of a token run, fed to the transformer in chunks:
// what the forward-pass tests compare (one pass, chunked prefill, decode).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/transformer.h"
#include "kv/kv_cache.h"

namespace kvserve::testing_files {

// (tokens, vocab) logits of `tokens` run in chunks of `chunk` tokens in one
// sequence of `cache`, released afterwards.
inline std::vector<float> chunked_logits(Transformer& tf, KvCache& cache, const std::vector<int32_t>& tokens,
                                         size_t chunk) {
  BlockTable table;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].all_logits = true;
  std::vector<float> all;
  Logits logits;
  for (size_t done = 0; done < tokens.size(); done += chunk) {
    const size_t n = std::min(chunk, tokens.size() - done);
    EXPECT_TRUE(cache.reserve(table, int32_t(n)));
    batch[0].tokens = std::span<const int32_t>(tokens.data() + done, n);
    tf.forward(batch, cache, logits);
    all.insert(all.end(), logits.values.begin(), logits.values.end());
  }
  cache.release(table);
  return all;
}

}  // namespace kvserve::testing_files
