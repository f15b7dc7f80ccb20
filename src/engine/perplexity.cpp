#include "engine/perplexity.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"
#include "util/timer.h"

namespace kvserve {

double negative_log_likelihood(const float* logits, int32_t vocab, int32_t target) {
  float max_logit = logits[0];
  for (int32_t i = 1; i < vocab; ++i) max_logit = std::max(max_logit, logits[i]);
  double sum = 0;
  for (int32_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - max_logit);
  return std::log(sum) - (double(logits[target]) - max_logit);
}

PerplexityResult perplexity(Transformer& transformer, KvCache& cache, std::span<const int32_t> tokens,
                            int32_t bos_id, const PerplexityOptions& options,
                            const ProgressCallback& progress) {
  const ModelConfig& c = transformer.config();
  const int32_t ctx = options.ctx;
  if (ctx < 4 || ctx > c.seq_len) fail("--ctx {} is out of range (4..{}, the model's context length)", ctx, c.seq_len);
  if (options.batch <= 0) fail("perplexity batch must be positive");
  if (!cache.fits(ctx)) fail("the KV cache cannot hold a chunk of {} tokens; raise --kv-blocks", ctx);
  const int32_t available = int32_t(tokens.size() / size_t(ctx));
  if (available == 0) fail("the text has {} tokens, fewer than one chunk of {}", tokens.size(), ctx);
  const int32_t n_chunks = options.chunks < 0 ? available : std::min(options.chunks, available);
  if (n_chunks == 0) fail("--chunks must be positive");

  PerplexityResult r;
  Timer timer;
  const int32_t first = ctx / 2;
  std::vector<int32_t> chunk(static_cast<size_t>(ctx));
  std::vector<BatchEntry> batch(1);
  Logits logits;
  double nll = 0;
  for (int32_t i = 0; i < n_chunks; ++i) {
    std::copy_n(tokens.begin() + int64_t(i) * ctx, ctx, chunk.begin());
    chunk[0] = bos_id;
    BlockTable table;
    batch[0].table = &table;
    batch[0].all_logits = true;
    for (int32_t start = 0; start < ctx; start += options.batch) {
      const int32_t n = std::min(options.batch, ctx - start);
      if (!cache.reserve(table, n)) fail("out of KV blocks while scoring a chunk");
      batch[0].tokens = std::span<const int32_t>(chunk.data() + start, size_t(n));
      transformer.forward(batch, cache, logits);
      // Row k of this pass is position start + k; score positions first .. ctx-2.
      for (int32_t k = 0; k < n; ++k) {
        const int32_t pos = start + k;
        if (pos < first || pos > ctx - 2) continue;
        nll += negative_log_likelihood(logits.row(k), logits.vocab, chunk[size_t(pos) + 1]);
        ++r.tokens_scored;
      }
    }
    if (i == 0) r.kv = cache.stats();
    cache.release(table);
    r.chunk_ppl.push_back(std::exp(nll / double(r.tokens_scored)));
    if (progress) progress(i + 1, n_chunks);
  }
  r.chunks = n_chunks;
  r.nll_mean = nll / double(r.tokens_scored);
  r.ppl = std::exp(r.nll_mean);
  r.seconds = timer.seconds();
  return r;
}

}  // namespace kvserve
