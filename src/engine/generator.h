// Generation of one sequence: chunked prefill of the prompt, then decode one
// token per forward pass until a stop token or the length limit. The library
// entry point behind `kvserve generate`.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/sampler.h"
#include "engine/transformer.h"
#include "kv/kv_cache.h"

namespace kvserve {

struct GenerateOptions {
  // Length limit as llama2.c's `-n`: positions run through the model, prompt
  // (BOS included) plus generated; the output then holds up to max_tokens
  // tokens after BOS. 0 means the model's context length.
  int32_t max_tokens = 256;
  SamplerOptions sampling;
  int32_t prefill_chunk = 512;  // prompt tokens per forward pass
  bool stop_at_eos = true;      // stop when BOS or EOS is sampled, as llama2.c does for BOS
  std::vector<int32_t> stop_token_ids;  // also stop when one is sampled (a chat model's end of turn)
  // KV sparsity of the sequence (issue 4). With positions within the cache
  // (sinks), max_tokens may exceed the model's context length.
  SparsityOptions sparsity;
};

struct GenerateResult {
  std::vector<int32_t> tokens;   // prompt followed by generated tokens
  int32_t prompt_tokens = 0;
  int32_t generated_tokens = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  KvStats kv_peak;               // cache statistics at the end (the whole sequence, or what the policy kept)
  std::vector<int64_t> kv_bytes_used;  // KV bytes in use after every forward pass (prefill chunks, then decode steps)
  int64_t kv_bytes_used_peak = 0;      // the most KV bytes in use at once (new tokens written, before eviction)
  double kv_tokens_kept_mean = 0;      // tokens kept after each decode step, mean (per layer and KV head)
  SparsityStats sparsity;              // the policy's counters
};

// Called for every token of the output as it becomes known (prompt tokens
// after the first included), with its predecessor, so a caller can stream text.
using TokenCallback = std::function<void(int32_t prev, int32_t token)>;

// Throws kvserve::Error when the prompt is empty, longer than the context or
// does not fit in the KV cache. The sequence's blocks are returned to the cache
// before returning.
GenerateResult generate(Transformer& transformer, KvCache& cache, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options, const TokenCallback& on_token,
                        int32_t bos_id, int32_t eos_id);

}  // namespace kvserve
