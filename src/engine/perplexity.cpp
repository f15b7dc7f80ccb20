#include "engine/perplexity.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"
#include "util/timer.h"

namespace kvserve {
namespace {

int32_t argmax_index(const float* x, int32_t n) { return int32_t(std::max_element(x, x + n) - x); }

}  // namespace

double negative_log_likelihood(const float* logits, int32_t vocab, int32_t target) {
  float max_logit = logits[0];
  for (int32_t i = 1; i < vocab; ++i) max_logit = std::max(max_logit, logits[i]);
  double sum = 0;
  for (int32_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - max_logit);
  return std::log(sum) - (double(logits[target]) - max_logit);
}

double kl_divergence(const float* p_logits, const float* q_logits, int32_t vocab) {
  auto log_normalizer = [vocab](const float* x) {
    float m = x[0];
    for (int32_t i = 1; i < vocab; ++i) m = std::max(m, x[i]);
    double sum = 0;
    for (int32_t i = 0; i < vocab; ++i) sum += std::exp(double(x[i]) - m);
    return m + std::log(sum);
  };
  const double zp = log_normalizer(p_logits), zq = log_normalizer(q_logits);
  double kl = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    const double lp = p_logits[i] - zp, lq = q_logits[i] - zq;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(0.0, kl);
}

namespace {

// Runs one chunk through the model with a fresh table in `cache` and, when
// given, a fresh policy; calls on_row(position, logits) for every scored
// position and kept(tokens) with the tokens in the cache when it was scored
// (those its prediction saw: a pass's later positions excluded, so the
// count does not depend on the batch size).
template <class OnRow, class OnKept>
void run_chunk(Transformer& transformer, KvCache& cache, const std::vector<int32_t>& chunk, int32_t batch_size,
               int32_t first, SparsityPolicy* policy, KvStats* stats, OnRow&& on_row, OnKept&& kept) {
  const int32_t ctx = int32_t(chunk.size());
  BlockTable table;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].all_logits = true;
  batch[0].policy = policy;
  Logits logits;
  for (int32_t start = 0; start < ctx; start += batch_size) {
    const int32_t n = std::min(batch_size, ctx - start);
    if (!cache.reserve(table, n)) {
      cache.release(table);
      fail("out of KV blocks while scoring a chunk");
    }
    batch[0].tokens = std::span<const int32_t>(chunk.data() + start, size_t(n));
    batch[0].decode = n == 1;  // scoring token by token is decoding: read-time choices apply
    transformer.forward(batch, cache, logits);
    // Row k of this pass is position start + k; score positions first .. ctx-2.
    for (int32_t k = 0; k < n; ++k) {
      const int32_t pos = start + k;
      if (pos < first || pos > ctx - 2) continue;
      on_row(pos, logits.row(k));
      kept(table.live_tokens() - (n - 1 - k));
    }
  }
  if (stats != nullptr) *stats = cache.stats();
  cache.release(table);
}

}  // namespace

PerplexityResult perplexity(Transformer& transformer, KvCache& cache, std::span<const int32_t> tokens,
                            int32_t bos_id, const PerplexityOptions& options,
                            const ProgressCallback& progress, KvCache* reference) {
  const ModelConfig& c = transformer.config();
  const int32_t ctx = options.ctx;
  if (ctx < 4 || ctx > c.seq_len) fail("--ctx {} is out of range (4..{}, the model's context length)", ctx, c.seq_len);
  if (options.batch <= 0) fail("perplexity batch must be positive");
  if (!cache.fits(ctx, options.streaming ? 1 : options.batch))
    fail("the KV cache cannot hold a chunk of {} tokens; raise {}", ctx,
         cache.options().budget_bytes > 0 ? "--kv-memory" : "--kv-blocks");  // the one that sized it
  const int32_t available = int32_t(tokens.size() / size_t(ctx));
  if (available == 0) fail("the text has {} tokens, fewer than one chunk of {}", tokens.size(), ctx);
  if (options.chunks == 0 || options.chunks < -1) fail("--chunks must be positive, or -1 for all (got {})", options.chunks);
  const int32_t n_chunks = options.chunks < 0 ? available : std::min(options.chunks, available);
  if (options.sparsity.policy != "full" && !options.streaming)
    fail("--kv-policy {} needs --streaming: a prefill of the whole chunk would hide its evictions",
         options.sparsity.policy);
  const int32_t batch = options.streaming ? 1 : options.batch;
  make_sparsity_policy(options.sparsity, cache);  // bad options fail before any work

  PerplexityResult r;
  r.has_reference = reference != nullptr;
  if (reference != nullptr && !reference->fits(ctx, options.streaming ? 1 : options.batch)) fail("the reference KV cache cannot hold a chunk of {} tokens", ctx);
  Timer timer;
  const int32_t first = ctx / 2;
  const int32_t vocab = c.vocab_size;
  std::vector<int32_t> chunk(static_cast<size_t>(ctx));
  std::vector<float> ref_logits;  // (ctx - 1 - first, vocab) of the reference pass
  double nll = 0, ref_nll = 0, kl = 0, kept_sum = 0;
  int64_t agree = 0, kept_steps = 0;
  auto on_kept = [&](int32_t tokens) {
    kept_sum += tokens;
    ++kept_steps;
  };
  for (int32_t i = 0; i < n_chunks; ++i) {
    std::copy_n(tokens.begin() + int64_t(i) * ctx, ctx, chunk.begin());
    if (bos_id >= 0) chunk[0] = bos_id;  // as llama.cpp, only for vocabularies that add BOS
    if (reference != nullptr) {
      ref_logits.resize(size_t(ctx - 1 - first) * size_t(vocab));
      run_chunk(transformer, *reference, chunk, options.batch, first, nullptr, nullptr,
                [&](int32_t pos, const float* row) {
                  std::copy_n(row, vocab, ref_logits.begin() + int64_t(pos - first) * vocab);
                  ref_nll += negative_log_likelihood(row, vocab, chunk[size_t(pos) + 1]);
                },
                [](int32_t) {});
    }
    const std::unique_ptr<SparsityPolicy> policy = make_sparsity_policy(options.sparsity, cache);
    run_chunk(transformer, cache, chunk, batch, first, policy.get(), i == 0 ? &r.kv : nullptr,
              [&](int32_t pos, const float* row) {
                nll += negative_log_likelihood(row, vocab, chunk[size_t(pos) + 1]);
                ++r.tokens_scored;
                if (reference != nullptr) {
                  const float* ref = ref_logits.data() + int64_t(pos - first) * vocab;
                  kl += kl_divergence(ref, row, vocab);
                  agree += argmax_index(ref, vocab) == argmax_index(row, vocab);
                }
              },
              on_kept);
    const SparsityStats st = policy->stats();
    r.sparsity.forward_passes += st.forward_passes;
    r.sparsity.tokens_evicted += st.tokens_evicted;
    r.sparsity.compactions += st.compactions;
    r.sparsity.tokens_read += st.tokens_read;
    r.sparsity.tokens_available += st.tokens_available;
    r.chunk_ppl.push_back(std::exp(nll / double(r.tokens_scored)));
    if (progress) progress(i + 1, n_chunks);
  }
  if (reference != nullptr) {
    r.reference_ppl = std::exp(ref_nll / double(r.tokens_scored));
    r.kl_divergence = kl / double(r.tokens_scored);
    r.top1_agreement = double(agree) / double(r.tokens_scored);
  }
  r.kv_tokens_kept_mean = kept_steps == 0 ? 0.0 : kept_sum / double(kept_steps);
  r.kv_read_fraction = r.sparsity.read_fraction();
  r.chunks = n_chunks;
  r.nll_mean = nll / double(r.tokens_scored);
  r.ppl = std::exp(r.nll_mean);
  r.seconds = timer.seconds();
  return r;
}

}  // namespace kvserve
