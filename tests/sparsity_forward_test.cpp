// Sparsity policies in the real forward pass (stories260K): a policy that
// keeps everything changes nothing, compacting changes no logit (eager and
// lazy compaction agree but for summation order, keys before or after RoPE),
// attention weights reach the policy, sinks run far past the context length,
// evicting policies free blocks as generation runs, and streaming perplexity
// with full attention equals the plain protocol.
#include <gtest/gtest.h>

#include <mutex>

#include <cmath>
#include <fstream>
#include <sstream>

#include "engine/generator.h"
#include "engine/perplexity.h"
#include "engine/transformer.h"
#include "test_support.h"

namespace kvserve {
namespace {

// Each test runs on the model as trained and stretched by YaRN x4 (every
// pair's angle but the fastest ones changed, the queries scaled), so the
// compaction, span and read-time paths are held to the scaled rotations too.
class StoriesSparsity : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    ModelOverrides rope;
    if (std::string(GetParam()) == "yarn4") {
      rope.rope_scaling = RopeScalingType::Yarn;
      rope.rope_scale = 4.0f;
    }
    model = Model::load(testing_files::kStoriesGguf, "", rope);
    tf = std::make_unique<Transformer>(*model, pool);
    const std::string text =
        "Once upon a time, there was a little dog named Max. He liked to run in the park with his friend Lily. "
        "One day, Max saw a big red ball under a tree. He ran to the ball and pushed it with his nose. Lily "
        "laughed and threw the ball far away.";
    tokens = model->require_tokenizer().encode(text, true);
  }

  // Logits of every token, run one token per forward pass with `policy`, as
  // decode steps or as 1-token prefill chunks.
  std::vector<float> decode_all(KvCache& cache, SparsityPolicy* policy, bool decode = true) {
    BlockTable table;
    std::vector<BatchEntry> batch(1);
    batch[0].table = &table;
    batch[0].policy = policy;
    batch[0].decode = decode;
    Logits logits;
    std::vector<float> all;
    for (size_t i = 0; i < tokens.size(); ++i) {
      EXPECT_TRUE(cache.reserve(table, 1));
      batch[0].tokens = std::span<const int32_t>(tokens.data() + i, 1);
      tf->forward(batch, cache, logits);
      all.insert(all.end(), logits.values.begin(), logits.values.end());
    }
    cache.release(table);
    return all;
  }

  KvCacheOptions kv_options(bool pre_rope = false, int rope_span = 1) const {
    KvCacheOptions o;
    o.num_blocks = 40;
    o.k.pre_rope = pre_rope;
    o.k.rope_span = rope_span;
    return o;
  }
  static float worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    float worst = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    return worst;
  }

  ThreadPool pool{2};
  std::unique_ptr<Model> model;
  std::unique_ptr<Transformer> tf;
  std::vector<int32_t> tokens;
};

INSTANTIATE_TEST_SUITE_P(Rope, StoriesSparsity, ::testing::Values("unscaled", "yarn4"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

SparsityOptions policy(const std::string& name, int32_t budget) {
  SparsityOptions o;
  o.policy = name;
  o.budget = budget;
  return o;
}

TEST_P(StoriesSparsity, PoliciesThatKeepEverythingChangeNothing) {
  ASSERT_GT(tokens.size(), 50u);
  KvCache cache(model->config(), kv_options());
  const std::vector<float> full = decode_all(cache, nullptr);
  for (const std::string name : {"full", "window", "h2o", "snapkv", "topk", "ann"}) {
    auto p = make_sparsity_policy(policy(name, name == "full" ? 0 : 1000), cache);
    EXPECT_EQ(decode_all(cache, p.get()), full) << name;
    EXPECT_EQ(p->stats().tokens_evicted, 0) << name;
  }
}

// A prefill chunk reads every key whatever a read-time policy would choose
// for decode, in tiles of tokens as without a policy: one chunk's logits
// equal a policy-free prefill's, even with a budget far under the chunk.
TEST_P(StoriesSparsity, PrefillChunksUnderReadTimePoliciesReadEverything) {
  KvCache cache(model->config(), kv_options());
  auto prefill = [&](SparsityPolicy* p) {
    BlockTable table;
    EXPECT_TRUE(cache.reserve(table, int32_t(tokens.size())));
    std::vector<BatchEntry> batch = {{&table, tokens, true, p}};
    Logits logits;
    tf->forward(batch, cache, logits);
    cache.release(table);
    return logits.values;
  };
  const std::vector<float> dense = prefill(nullptr);
  for (const std::string name : {"topk", "ann"}) {
    auto p = make_sparsity_policy(policy(name, 16), cache);
    EXPECT_LE(worst_difference(prefill(p.get()), dense), 1e-6f) << name;
  }
  // However short the chunks: a prompt split into 1-token chunks (a budget
  // shared with other sequences can do that) reads everything too, so the
  // KV a prefix cache shares does not depend on the policy. Run as decode
  // steps, the same tokens do choose their reads.
  const std::vector<float> one_by_one = decode_all(cache, nullptr);
  for (const std::string name : {"topk", "ann"}) {
    auto p = make_sparsity_policy(policy(name, 16), cache);
    EXPECT_EQ(decode_all(cache, p.get(), false), one_by_one) << name;
    p = make_sparsity_policy(policy(name, 16), cache);
    EXPECT_NE(decode_all(cache, p.get(), true), one_by_one) << name;
  }
}

// Keys stored before RoPE, or rotated within RoPE spans of 4 or 16 tokens
// (the int2 presets'), score as keys stored after RoPE: only the rotations'
// float rounding differs (FP32 keys, so nothing else does).
TEST_P(StoriesSparsity, KeysBeforeRopeOrInSpansScoreAsKeysAfterRope) {
  KvCache after(model->config(), kv_options());
  const std::vector<float> reference = decode_all(after, nullptr);
  for (int span : {1, 4, 16}) {
    KvCache cache(model->config(), kv_options(true, span));
    EXPECT_LE(worst_difference(decode_all(cache, nullptr), reference), 1e-4f) << "span " << span;
  }
}

// Read-time policies score keys themselves (read_keys: pre-RoPE keys turned
// the rest of the way; on_kv: a pre-RoPE key rotated for the policy): over
// keys before RoPE or in spans they choose what they choose over keys after
// it, so the logits agree but for the rotations' rounding.
TEST_P(StoriesSparsity, ReadTimePoliciesChooseAlikeOverKeysBeforeRope) {
  for (const std::string name : {"topk", "ann"}) {
    KvCache after(model->config(), kv_options());
    auto p = make_sparsity_policy(policy(name, 16), after);
    const std::vector<float> reference = decode_all(after, p.get());
    EXPECT_NE(reference, decode_all(after, nullptr)) << name;  // the budget does bind
    for (int span : {1, 16}) {
      KvCache cache(model->config(), kv_options(true, span));
      auto q = make_sparsity_policy(policy(name, 16), cache);
      EXPECT_LE(worst_difference(decode_all(cache, q.get()), reference), 1e-4f) << name << " span " << span;
    }
  }
}

TEST_P(StoriesSparsity, CompactionChangesNoLogit) {
  // Evicted slots are masked at once; compacting them after every eviction
  // (slack 1) or never (slack larger than the text) must not change the
  // logits: moved tokens keep their positions, scores and bytes (keys in
  // RoPE spans keep the rotation of their position, not of their slot).
  for (auto [pre_rope, span] : {std::pair{false, 1}, std::pair{true, 1}, std::pair{true, 16}}) {
    KvCache cache(model->config(), kv_options(pre_rope, span));
    for (const std::string name : {"window", "h2o", "snapkv"}) {
      SparsityOptions eager = policy(name, 12), lazy = policy(name, 12);
      eager.compact_slack = 1;
      lazy.compact_slack = 1000;
      auto a = make_sparsity_policy(eager, cache), b = make_sparsity_policy(lazy, cache);
      const std::vector<float> la = decode_all(cache, a.get()), lb = decode_all(cache, b.get());
      // Equal but for summation order: masked slots sit between live ones in
      // the SIMD reductions of the lazy run (a different keep set would move
      // logits by far more).
      EXPECT_LE(worst_difference(la, lb), 1e-4f) << name << (pre_rope ? " pre-RoPE keys, span " + std::to_string(span) : "");
      EXPECT_EQ(a->stats().tokens_evicted, int64_t(tokens.size()) - 12);
      EXPECT_EQ(a->stats().compactions, int64_t(tokens.size()) - 12) << name;
      EXPECT_EQ(b->stats().compactions, 0) << name;
      // And eviction did change the predictions.
      EXPECT_NE(la, decode_all(cache, nullptr)) << name;
    }
  }
}

// With positions in the cache (StreamingLLM), a key is rotated by its rank
// among the tokens kept: the slot it takes once compaction closes the gaps.
// So when compaction runs (every eviction, or never: the slack, by default
// a block) changes no logit; with slot positions a helper measured sinks'
// perplexity move from 4.797 (1-token blocks) to 4.778 (64-token blocks).
TEST_P(StoriesSparsity, CachePositionsDoNotDependOnWhenCompactionRuns) {
  for (int span : {1, 16}) {
    KvCache cache(model->config(), kv_options(true, span));
    SparsityOptions sinks = policy("sinks", 12), h2o = policy("h2o", 12);
    h2o.sinks = 2;
    h2o.positions = SparsityPositions::Cache;  // per-head evictions: each head its own ranks
    for (SparsityOptions o : {sinks, h2o}) {
      SparsityOptions eager = o, lazy = o;
      eager.compact_slack = 1;
      lazy.compact_slack = 1000;
      auto a = make_sparsity_policy(eager, cache), b = make_sparsity_policy(lazy, cache);
      const std::vector<float> la = decode_all(cache, a.get()), lb = decode_all(cache, b.get());
      EXPECT_LE(worst_difference(la, lb), 1e-4f) << o.policy << ", span " << span;
      EXPECT_EQ(b->stats().compactions, 0) << o.policy;
      EXPECT_GT(a->stats().compactions, 0) << o.policy;
    }
  }
}

// Records what the forward pass tells a policy.
class SpyPolicy final : public SparsityPolicy {
 public:
  explicit SpyPolicy(int n_kv_heads) : n_kv_heads_(n_kv_heads) {}
  std::string_view name() const override { return "spy"; }
  bool wants_attention_weights() const override { return true; }
  // The forward pass calls observe from its worker threads, one (layer, KV
  // head) each: a policy's own per-head state needs no lock, this log does.
  void observe(int layer, int kv_head, const float* weights, int32_t n_ctx) override {
    double sum = 0;
    for (int32_t s = 0; s < n_ctx; ++s) sum += weights[s];
    std::lock_guard<std::mutex> lock(mu);
    sums.push_back(sum);
    ++calls;
    last_n_ctx = n_ctx;
  }
  std::mutex mu;
  std::vector<double> sums;
  int64_t calls = 0;
  int32_t last_n_ctx = 0;
  int n_kv_heads_;
};

TEST_P(StoriesSparsity, AttentionWeightsReachThePolicy) {
  KvCache cache(model->config(), kv_options());
  SpyPolicy spy(model->config().n_kv_heads);
  BlockTable table;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].policy = &spy;
  Logits logits;
  ASSERT_TRUE(cache.reserve(table, int32_t(tokens.size())));
  batch[0].tokens = tokens;  // a prefill: every query is observed, in order
  tf->forward(batch, cache, logits);
  const ModelConfig& c = model->config();
  EXPECT_EQ(spy.calls, int64_t(tokens.size()) * c.n_layers * c.n_kv_heads);
  // Each query head's softmax sums to 1, and the GQA group's are summed.
  for (double s : spy.sums) EXPECT_NEAR(s, double(c.gqa_group()), 1e-4);
  EXPECT_EQ(spy.last_n_ctx, int32_t(tokens.size()));
  cache.release(table);
}

TEST_P(StoriesSparsity, SinksGenerateFarPastTheContextLength) {
  // Positions within the cache: generation goes on past the 512-token
  // context with finite logits and in-vocabulary tokens, in bounded memory.
  KvCacheOptions o = kv_options(true);
  o.num_blocks = 8;  // 128 tokens: far less than the text
  KvCache cache(model->config(), o);
  auto sinks = make_sparsity_policy(policy("sinks", 64), cache);
  const int32_t vocab = model->config().vocab_size, steps = 2 * model->config().seq_len + 100;
  BlockTable table;
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].policy = sinks.get();
  Logits logits;
  int32_t token = 1;
  int32_t max_blocks = 0;
  for (int32_t i = 0; i < steps; ++i) {
    ASSERT_TRUE(cache.reserve(table, 1)) << "step " << i;
    batch[0].tokens = std::span<const int32_t>(&token, 1);
    tf->forward(batch, cache, logits);
    for (int32_t v = 0; v < vocab; ++v) ASSERT_TRUE(std::isfinite(logits.row(0)[v])) << "step " << i;
    token = argmax(logits.row(0), vocab);
    ASSERT_GE(token, 0);
    ASSERT_LT(token, vocab);
    max_blocks = std::max(max_blocks, cache.stats().blocks_used);
  }
  EXPECT_EQ(table.position_of_new(table.num_tokens), steps);  // the text's length
  EXPECT_LE(table.num_tokens, 64 + 16);                         // slots: the budget and one block
  EXPECT_EQ(table.live_tokens(), 64);
  EXPECT_LE(max_blocks, 5);
  // The first four positions are still there.
  for (int32_t s = 0; s < 4; ++s) EXPECT_EQ(cache.slot_position(table, 2, 1, s), s);
  cache.release(table);
}

// Sinks with positions within the cache move keys to new slots and new
// rotations; keys in RoPE spans keep their stored rotation, so a moved key
// can sit below it (the query is then rotated forward). Both storages give
// the same logits all the way past the eviction and compaction.
TEST_P(StoriesSparsity, SinksOverKeysInSpansMatchKeysBeforeRope) {
  std::vector<float> runs[2];
  for (int span : {1, 16}) {
    KvCacheOptions o = kv_options(true, span);
    o.num_blocks = 8;
    KvCache cache(model->config(), o);
    SparsityOptions o_sinks = policy("sinks", 20);
    o_sinks.compact_slack = 1;  // compact at every eviction, so attention reads moved keys
    auto sinks = make_sparsity_policy(o_sinks, cache);
    BlockTable table;
    std::vector<BatchEntry> batch(1);
    batch[0].table = &table;
    batch[0].policy = sinks.get();
    Logits logits;
    for (size_t i = 0; i < tokens.size(); ++i) {
      ASSERT_TRUE(cache.reserve(table, 1));
      batch[0].tokens = std::span<const int32_t>(tokens.data() + i, 1);
      tf->forward(batch, cache, logits);
      runs[span == 16].insert(runs[span == 16].end(), logits.values.begin(), logits.values.end());
    }
    EXPECT_GT(sinks->stats().compactions, int64_t(tokens.size()) / 2);
    cache.release(table);
  }
  EXPECT_LE(worst_difference(runs[0], runs[1]), 1e-4f);
}

TEST_P(StoriesSparsity, EvictingGenerationFreesBlocks) {
  KvCacheOptions o = kv_options();
  KvCache cache(model->config(), o);
  GenerateOptions g;
  g.max_tokens = 300;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  g.sparsity = policy("window", 32);
  const std::vector<int32_t> prompt = {1};
  const GenerateResult r = generate(*tf, cache, prompt, g, [](int32_t, int32_t) {}, 1, 2);
  ASSERT_EQ(r.kv_bytes_used.size(), 300u);
  const int64_t block = cache.stats().bytes_per_block;
  // 32 tokens and up to 15 evicted slots: never more than 3 blocks after a
  // step; the peak (new token written, before eviction) is 3 blocks too.
  for (size_t i = 48; i < r.kv_bytes_used.size(); ++i) EXPECT_LE(r.kv_bytes_used[i], 3 * block) << i;
  EXPECT_EQ(r.kv_bytes_used_peak, 3 * block);
  EXPECT_EQ(r.kv_peak.tokens_stored, 32);
  // After decode step i the sequence holds min(i + 1, 32) tokens: 9103 over 299 steps.
  EXPECT_DOUBLE_EQ(r.kv_tokens_kept_mean, 9103.0 / 299.0);
  EXPECT_EQ(r.sparsity.tokens_evicted, 300 - 32);
  EXPECT_EQ(cache.stats().blocks_used, 0);  // all returned at the end
  // Full attention grows to 300 tokens: 19 blocks.
  g.sparsity = SparsityOptions{};
  const GenerateResult f = generate(*tf, cache, prompt, g, [](int32_t, int32_t) {}, 1, 2);
  EXPECT_EQ(f.kv_bytes_used.back(), 19 * block);
}

// Positions within the cache reach the live tokens plus the chunk being
// written: a budget near the context with the default 512-token chunks
// failed mid-prefill ("sequence of N tokens exceeds the model's context
// length"); generate() now writes such prompts in smaller chunks, and a
// budget that leaves no room for a new token is refused before any work.
TEST_P(StoriesSparsity, SinksNearTheContextShrinkPromptChunksToFit) {
  KvCacheOptions o = kv_options(true);
  o.num_blocks = 64;
  KvCache cache(model->config(), o);
  const int32_t ctx = model->config().seq_len;
  std::vector<int32_t> prompt;
  while (int32_t(prompt.size()) < ctx + 100) prompt.insert(prompt.end(), tokens.begin(), tokens.end());
  prompt.resize(size_t(ctx + 100));
  GenerateOptions g;
  g.max_tokens = ctx + 140;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  g.prefill_chunk = 512;
  g.sparsity = policy("sinks", ctx - 12);
  const GenerateResult r = generate(*tf, cache, prompt, g, [](int32_t, int32_t) {}, 1, 2);
  EXPECT_GE(int32_t(r.tokens.size()), ctx + 140);  // past the context, every position computed
  EXPECT_EQ(cache.stats().blocks_used, 0);
  g.sparsity = policy("sinks", ctx);
  testing_files::expect_error_containing([&] { generate(*tf, cache, prompt, g, [](int32_t, int32_t) {}, 1, 2); },
                                         "leaves no room in the context length");
}

TEST_P(StoriesSparsity, StreamingPerplexityWithFullEqualsThePlainProtocol) {
  std::ifstream in(testing_files::kTinyStories);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<int32_t> all = model->require_tokenizer().encode(text.str(), true);
  KvCache cache(model->config(), kv_options());
  PerplexityOptions p;
  p.ctx = 128;
  p.chunks = 4;
  const PerplexityResult plain = perplexity(*tf, cache, all, 1, p);
  p.streaming = true;
  const PerplexityResult streaming = perplexity(*tf, cache, all, 1, p);
  // One token per pass instead of a 128-token prefill: the same arithmetic
  // but for summation order in the matrix products.
  EXPECT_NEAR(streaming.ppl, plain.ppl, plain.ppl * 1e-5);
  EXPECT_EQ(streaming.tokens_scored, plain.tokens_scored);
  EXPECT_DOUBLE_EQ(streaming.kv_read_fraction, 1.0);
  // Scored positions 64..126 keep 65..127 tokens: the mean is 96.
  EXPECT_DOUBLE_EQ(streaming.kv_tokens_kept_mean, 96.0);
  // A window of 16 keeps 16; topk reads a fraction but keeps all.
  p.sparsity = policy("window", 16);
  EXPECT_DOUBLE_EQ(perplexity(*tf, cache, all, 1, p).kv_tokens_kept_mean, 16.0);
  p.sparsity = policy("topk", 32);
  const PerplexityResult topk = perplexity(*tf, cache, all, 1, p);
  EXPECT_LT(topk.kv_read_fraction, 0.6);
  EXPECT_GT(topk.kv_read_fraction, 0.25);
  EXPECT_DOUBLE_EQ(topk.kv_tokens_kept_mean, 96.0);
  // A policy without streaming would hide its evictions in a prefill.
  p.streaming = false;
  testing_files::expect_error_containing([&] { perplexity(*tf, cache, all, 1, p); }, "--streaming");
}

}  // namespace
}  // namespace kvserve
