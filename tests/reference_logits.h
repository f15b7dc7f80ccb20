// The logits of every position of a token sequence in one forward pass from
// an empty FP32 cache: the reference the log-probabilities a server or the
// engine reports are checked against.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "engine/transformer.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "util/thread_pool.h"

namespace kvserve::testing_files {

inline Logits every_position_logits(const Model& model, const std::vector<int32_t>& tokens) {
  ThreadPool pool(1);
  KvCache cache(model.config(), KvCacheOptions{});
  Transformer tf(model, pool);
  BlockTable table;
  EXPECT_TRUE(cache.reserve(table, int32_t(tokens.size())));
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].tokens = tokens;
  batch[0].all_logits = true;
  Logits logits;
  tf.forward(batch, cache, logits);
  cache.release(table);
  return logits;
}

}  // namespace kvserve::testing_files
