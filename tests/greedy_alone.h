// The reference the engine's batched greedy output is held to: the tokens
// generate() produces for one prompt run alone.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/generator.h"
#include "engine/transformer.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "util/thread_pool.h"

namespace kvserve::testing_files {

// Greedy tokens after `prompt` (max_tokens new ones) in a cache of kv's
// layout and default capacity. With a sparsity policy, prefill_chunk matters
// (an evicting policy evicts after each pass): the engine's
// max_batch_prefill_tokens.
inline std::vector<int32_t> greedy_alone(const Model& model, const std::vector<int32_t>& prompt, int32_t max_tokens,
                                         const KvCacheOptions& kv, const SparsityOptions& sparsity = {},
                                         int32_t prefill_chunk = 512) {
  ThreadPool pool(1);
  KvCacheOptions o = kv;
  o.num_blocks = 0;
  o.budget_bytes = 0;
  KvCache cache(model.config(), o);
  Transformer tf(model, pool);
  GenerateOptions g;
  g.max_tokens = int32_t(prompt.size()) + max_tokens - 1;  // positions after BOS, as llama2.c
  g.sampling.temperature = 0;
  g.sparsity = sparsity;
  g.prefill_chunk = prefill_chunk;
  const Tokenizer& tok = model.require_tokenizer();
  const GenerateResult r = generate(tf, cache, prompt, g, [](int32_t, int32_t) {}, tok.bos_id(), tok.eos_id());
  return std::vector<int32_t>(r.tokens.begin() + long(prompt.size()), r.tokens.end());
}

}  // namespace kvserve::testing_files
