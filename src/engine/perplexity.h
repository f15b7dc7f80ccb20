// Perplexity with llama.cpp's protocol, so numbers compare across engines:
// the token stream (BOS first) is cut into chunks of `ctx` tokens; each chunk
// starts from an empty KV cache with its first token replaced by BOS; the
// logits of the second half of each chunk are scored against the next token
// (positions ctx/2 .. ctx-2, so ctx - 1 - ctx/2 tokens per chunk).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/transformer.h"
#include "kv/kv_cache.h"

namespace kvserve {

struct PerplexityOptions {
  int32_t ctx = 512;     // tokens per chunk
  int32_t chunks = -1;   // chunks to score; -1 = all that fit
  int32_t batch = 512;   // tokens per forward pass (a chunk may take several)
  // Score token by token, as generation runs, so a sparsity policy's early
  // evictions affect later predictions (a prefill of the chunk would hide
  // them). Required by every policy but full.
  bool streaming = false;
  SparsityOptions sparsity;  // a fresh policy per chunk
};

struct PerplexityResult {
  double ppl = 0;                 // exp(mean negative log-likelihood)
  double nll_mean = 0;            // in nats per scored token
  int64_t tokens_scored = 0;
  int32_t chunks = 0;
  double seconds = 0;
  KvStats kv;                     // cache statistics at the end of the first chunk
  double kv_tokens_kept_mean = 0; // tokens in the cache when each position was scored, mean (per layer and KV head)
  double kv_read_fraction = 1;    // keys attention read / keys kept, over all chunks (read-time policies)
  SparsityStats sparsity;         // the policies' counters, summed over chunks
  std::vector<double> chunk_ppl;  // running estimate after each chunk, as llama.cpp prints
  // Against a reference cache (usually FP32), over the same scored tokens:
  bool has_reference = false;
  double reference_ppl = 0;
  double kl_divergence = 0;       // mean KL(reference || tested) in nats
  double top1_agreement = 0;      // fraction of positions with the same argmax
};

// progress(chunks_done, chunks_total) after each chunk.
using ProgressCallback = std::function<void(int32_t, int32_t)>;

// Throws kvserve::Error when ctx is out of range, the text is shorter than
// one chunk, or a policy other than full is asked for without streaming. With a reference cache, every chunk also runs against it and the
// result compares the two distributions token by token (KL, top-1).
// bos_id >= 0: each chunk's first token becomes BOS (llama.cpp's protocol
// for vocabularies that add BOS); -1: chunks start as the text does.
PerplexityResult perplexity(Transformer& transformer, KvCache& cache, std::span<const int32_t> tokens,
                            int32_t bos_id, const PerplexityOptions& options,
                            const ProgressCallback& progress = nullptr, KvCache* reference = nullptr);

// KL(p || q) of the softmax distributions of two logit rows, in nats.
double kl_divergence(const float* p_logits, const float* q_logits, int32_t vocab);

// -log softmax(logits)[target], computed in double. logits: (vocab) floats.
double negative_log_likelihood(const float* logits, int32_t vocab, int32_t target);

}  // namespace kvserve
