// Captures a model's real post-RoPE queries, keys and values over a text, for
// attention-level experiments without the model (kvserve bench --dump-qk).
#pragma once

#include <cstdint>
#include <span>

#include "attention/qk_dump.h"
#include "engine/transformer.h"
#include "kv/kv_cache.h"

namespace kvserve {

struct QkCaptureOptions {
  int32_t chunk = 0;       // tokens per sequence; 0 = the model's context length
  int64_t max_tokens = 0;  // stop after the chunk that reaches this many tokens; 0 = every whole chunk
  int32_t batch = 512;     // tokens per forward pass
};

// Runs the tokens in chunks of `chunk`, each a fresh sequence whose first
// token is replaced by BOS (llama.cpp's perplexity protocol), and records
// every layer's queries and keys after RoPE and its values. A trailing
// partial chunk is dropped. REQUIRES: the cache stores keys after RoPE (no
// --kv-k-pre-rope) and can hold one chunk. Throws kvserve::Error when the
// text holds less than one chunk or a chunk does not fit.
[[nodiscard]] QkDump capture_qk(Transformer& transformer, KvCache& cache, std::span<const int32_t> tokens,
                                int32_t bos_id, const QkCaptureOptions& options);

}  // namespace kvserve
