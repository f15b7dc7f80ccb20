#include "engine/generator.h"

#include <algorithm>

#include "util/error.h"
#include "util/timer.h"

namespace kvserve {

GenerateResult generate(Transformer& transformer, KvCache& cache, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options, const TokenCallback& on_token,
                        int32_t bos_id, int32_t eos_id) {
  const ModelConfig& c = transformer.config();
  if (prompt.empty()) fail("the prompt has no tokens");
  if (options.max_tokens < 0) fail("--max-tokens must be >= 0 (got {})", options.max_tokens);
  if (options.prefill_chunk <= 0) fail("prefill chunk must be positive");
  const int32_t limit = options.max_tokens == 0 ? c.seq_len : options.max_tokens;
  if (limit > c.seq_len)
    fail("--max-tokens {} exceeds the model's context length of {}", limit, c.seq_len);
  if (int32_t(prompt.size()) > limit)
    fail("the prompt has {} tokens, more than the limit of {} positions (--max-tokens / context length)",
         prompt.size(), limit);
  if (!cache.fits(std::max<int64_t>(limit, int64_t(prompt.size()))))
    fail("the KV cache ({} blocks of {} tokens) cannot hold {} tokens; raise --kv-blocks",
         cache.pool().num_blocks(), cache.block_size(), std::max<int64_t>(limit, int64_t(prompt.size())));

  GenerateResult result;
  result.tokens = prompt;
  result.prompt_tokens = int32_t(prompt.size());
  Sampler sampler(options.sampling);
  BlockTable table;
  Logits logits;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;

  for (size_t i = 1; i < prompt.size(); ++i) on_token(prompt[i - 1], prompt[i]);

  // Prefill all prompt tokens, in chunks; the logits of the last one give the
  // first generated token.
  Timer timer;
  for (size_t done = 0; done < prompt.size();) {
    const size_t n = std::min(prompt.size() - done, size_t(options.prefill_chunk));
    if (!cache.reserve(table, int32_t(n))) {
      cache.release(table);
      fail("out of KV blocks during prefill");
    }
    batch[0].tokens = std::span<const int32_t>(prompt.data() + done, n);
    transformer.forward(batch, cache, logits);
    done += n;
  }
  result.prefill_seconds = timer.seconds();

  timer.reset();
  // As llama2.c: `limit` positions are run, so the output holds up to `limit`
  // tokens after BOS, the last of which is sampled but never fed back.
  int32_t token = prompt.back();
  while (int32_t(result.tokens.size()) <= limit) {
    const int32_t next = sampler.sample(logits.row(0), logits.vocab);
    if (options.stop_at_eos && (next == bos_id || next == eos_id)) break;
    result.tokens.push_back(next);
    ++result.generated_tokens;
    on_token(token, next);
    token = next;
    if (int32_t(result.tokens.size()) > limit) break;
    if (!cache.reserve(table, 1)) {
      cache.release(table);
      fail("out of KV blocks during decode");
    }
    batch[0].tokens = std::span<const int32_t>(&result.tokens.back(), 1);
    transformer.forward(batch, cache, logits);
  }
  result.decode_seconds = timer.seconds();
  result.kv_peak = cache.stats();
  cache.release(table);
  return result;
}

}  // namespace kvserve
