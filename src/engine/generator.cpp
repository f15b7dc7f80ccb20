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
  const std::unique_ptr<SparsityPolicy> policy = make_sparsity_policy(options.sparsity, cache);
  const int32_t limit = options.max_tokens == 0 ? c.seq_len : options.max_tokens;
  int32_t chunk = std::min<int32_t>(options.prefill_chunk, int32_t(prompt.size()));
  SparsityLimits limits = sparsity_limits(options.sparsity, cache, chunk);
  if (limits.unbounded_positions && limit > c.seq_len) {
    // Positions within the cache run up to the live tokens (at most the
    // budget) plus the chunk being written, before the policy evicts: smaller
    // prompt chunks keep them inside the context.
    const int32_t budget = options.sparsity.budget;  // resolving never changes it
    if (budget >= c.seq_len)
      fail("with positions within the cache, --kv-budget {} leaves no room in the context length of {} for a new "
           "token; lower --kv-budget", budget, c.seq_len);
    if (budget + chunk > c.seq_len) {
      chunk = c.seq_len - budget;
      limits = sparsity_limits(options.sparsity, cache, chunk);
    }
  }
  if (limit > c.seq_len && !limits.unbounded_positions)
    fail("--max-tokens {} exceeds the model's context length of {} (only positions within the cache, "
         "--kv-policy sinks, run past it)", limit, c.seq_len);
  if (int32_t(prompt.size()) > limit)
    fail("the prompt has {} tokens, more than the limit of {} positions (--max-tokens / context length)",
         prompt.size(), limit);
  // An evicting policy bounds what the sequence holds at once.
  const int64_t held = limits.max_tokens_held;
  const int64_t needed = held < 0 ? std::max<int64_t>(limit, int64_t(prompt.size())) : std::min<int64_t>(held, limit);
  if (!cache.fits(needed, chunk))
    fail("the KV cache ({} blocks of {} tokens) cannot hold {} tokens; raise --kv-blocks",
         cache.pool().num_blocks(), cache.block_size(), needed);

  GenerateResult result;
  result.tokens = prompt;
  result.prompt_tokens = int32_t(prompt.size());
  Sampler sampler(options.sampling);
  BlockTable table;
  Logits logits;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].policy = policy.get();
  // KV bytes in use: the peak right after new tokens are written, the trace after each pass.
  auto step = [&]() {
    result.kv_bytes_used_peak = std::max(result.kv_bytes_used_peak, cache.stats().bytes_used);
    transformer.forward(batch, cache, logits);
    result.kv_bytes_used.push_back(cache.stats().bytes_used);
  };
  double kept_sum = 0;  // tokens kept after each decode step
  int64_t decode_steps = 0;

  for (size_t i = 1; i < prompt.size(); ++i) on_token(prompt[i - 1], prompt[i]);

  // Prefill all prompt tokens, in chunks; the logits of the last one give the
  // first generated token.
  Timer timer;
  for (size_t done = 0; done < prompt.size();) {
    const size_t n = std::min(prompt.size() - done, size_t(chunk));
    if (!cache.reserve(table, int32_t(n))) {
      cache.release(table);
      fail("out of KV blocks during prefill");
    }
    batch[0].tokens = std::span<const int32_t>(prompt.data() + done, n);
    step();
    done += n;
  }
  result.prefill_seconds = timer.seconds();

  timer.reset();
  // As llama2.c: `limit` positions are run, so the output holds up to `limit`
  // tokens after BOS, the last of which is sampled but never fed back.
  int32_t token = prompt.back();
  while (int32_t(result.tokens.size()) <= limit) {
    const std::span<const int32_t> all(result.tokens);
    const int32_t next = sampler.sample(logits.row(0), logits.vocab,
                                        {all.first(size_t(result.prompt_tokens)), all.subspan(size_t(result.prompt_tokens)), {}});
    if (next < 0) fail("the sampling options leave no token that may be sampled");
    if (options.stop_at_eos && (next == bos_id || next == eos_id)) break;
    if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), next) != options.stop_token_ids.end()) break;
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
    batch[0].decode = true;
    step();
    kept_sum += table.live_tokens();
    ++decode_steps;
  }
  result.decode_seconds = timer.seconds();
  result.kv_peak = cache.stats();
  result.kv_bytes_used_peak = std::max(result.kv_bytes_used_peak, result.kv_peak.bytes_used);
  result.kv_tokens_kept_mean = decode_steps == 0 ? double(table.live_tokens()) : kept_sum / double(decode_steps);
  result.sparsity = policy->stats();
  cache.release(table);
  return result;
}

}  // namespace kvserve
