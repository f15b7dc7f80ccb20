// Sharing KV changes no output: on the real model (stories260K), a prompt
// served from the prefix cache and forked sequences give bit for bit the
// logits of runs that compute everything, with fp32 KV and with the int4
// preset (residual window of two blocks, where the block before a hit's
// boundary must come with its FP16 form).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "engine/transformer.h"
#include "kv/kv_spec.h"
#include "kv/prefix_cache.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::kStoriesGguf;
using testing_files::kTinyStories;

struct Request {
  std::vector<int32_t> tokens;
  CacheScope scope;
  std::vector<BlockKey> keys;
  BlockTable table;
  PrefixMatch match;
  std::vector<float> logits;  // (positions computed here, vocab): from match.cached_tokens on
};

int32_t argmax(const float* row, int32_t n) { return int32_t(std::max_element(row, row + n) - row); }

// Bitwise equality of float rows, with the largest difference on failure.
void expect_same(std::span<const float> got, std::span<const float> want) {
  ASSERT_EQ(got.size(), want.size());
  if (std::memcmp(got.data(), want.data(), got.size_bytes()) == 0) return;
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  ADD_FAILURE() << "logits differ, by up to " << worst;
}

class PrefixCacheModel : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    model = Model::load(kStoriesGguf);
    tf = std::make_unique<Transformer>(*model, threads);
    options.block_size = 16;
    options.num_blocks = 64;
    apply_kv_preset(options, GetParam(), /*keep_block_size=*/true);
    cache = std::make_unique<KvCache>(model->config(), options);
    PrefixCacheOptions po;
    po.model_id = "stories260K";
    pc = std::make_unique<PrefixCache>(*cache, po, clock);
    text = model->require_tokenizer().encode(testing_files::read_all(kTinyStories).substr(0, 4000), true);
    ASSERT_GT(text.size(), 200u);
  }

  std::vector<int32_t> slice(size_t begin, size_t end) const {
    return std::vector<int32_t>(text.begin() + long(begin), text.begin() + long(end));
  }

  // The no-cache reference: logits of every position of tokens, one pass on a
  // cache of its own.
  std::vector<float> reference(const std::vector<int32_t>& tokens) {
    KvCache fresh(model->config(), options);
    BlockTable t;
    EXPECT_TRUE(fresh.reserve(t, int32_t(tokens.size())));
    std::vector<BatchEntry> batch = {{&t, tokens, true}};
    Logits out;
    tf->forward(batch, fresh, out);
    return out.values;
  }

  // Runs tokens [begin, end) of r and publishes, as the engine does after every forward.
  void run(Request& r, size_t begin, size_t end) {
    ASSERT_TRUE(cache->reserve(r.table, int32_t(end - begin)));
    std::vector<BatchEntry> batch = {{&r.table, std::span<const int32_t>(r.tokens.data() + begin, end - begin), true}};
    Logits out;
    tf->forward(batch, *cache, out);
    r.logits.insert(r.logits.end(), out.values.begin(), out.values.end());
    pc->block_keys(r.scope, std::span<const int32_t>(r.tokens.data(), end), r.keys);
    pc->publish(r.scope, r.table, r.keys);
  }

  // Admission and prefill: match, then the rest, ending a chunk at the checkpoint.
  Request serve(std::vector<int32_t> tokens, const CacheScope& scope = {}) {
    Request r;
    r.tokens = std::move(tokens);
    r.scope = scope;
    pc->block_keys(scope, r.tokens, r.keys);
    r.match = pc->match(scope, r.keys, int32_t(r.tokens.size()), r.table);
    size_t done = size_t(r.match.cached_tokens);
    if (r.match.checkpoint_tokens > r.match.cached_tokens) {
      run(r, done, size_t(r.match.checkpoint_tokens));
      done = size_t(r.match.checkpoint_tokens);
    }
    run(r, done, r.tokens.size());
    return r;
  }

  // Greedy decode of `steps` tokens.
  void decode(Request& r, int steps) {
    const int32_t vocab = model->config().vocab_size;
    for (int i = 0; i < steps; ++i) {
      r.tokens.push_back(argmax(r.logits.data() + r.logits.size() - size_t(vocab), vocab));
      run(r, r.tokens.size() - 1, r.tokens.size());
    }
  }

  // r's logits equal the reference's rows for the same positions.
  void expect_matches_reference(const Request& r) {
    const std::vector<float> want = reference(r.tokens);
    const size_t vocab = size_t(model->config().vocab_size);
    expect_same(r.logits, std::span(want).subspan(size_t(r.match.cached_tokens) * vocab));
  }

  ThreadPool threads{2};
  ManualClock clock;
  std::unique_ptr<Model> model;
  std::unique_ptr<Transformer> tf;
  KvCacheOptions options;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<PrefixCache> pc;
  std::vector<int32_t> text;
};

TEST_P(PrefixCacheModel, HitsGiveExactlyTheLogitsOfANoCacheRun) {
  const bool staged = cache->staged_before(4) > 0;
  ASSERT_EQ(staged, std::string(GetParam()) == "int4");
  const std::vector<int32_t> prefix = slice(0, 70);  // 4 full blocks and 6 tokens
  auto prompt = [&](size_t begin, size_t end) {
    std::vector<int32_t> p = prefix;
    const std::vector<int32_t> s = slice(begin, end);
    p.insert(p.end(), s.begin(), s.end());
    return p;
  };
  Request a = serve(prompt(70, 90));
  EXPECT_EQ(a.match.cached_tokens, 0);
  decode(a, 4);
  expect_matches_reference(a);
  pc->release(a.scope, a.table, a.keys);

  // b diverges after block 3. Under the int4 window that block is read in
  // FP16, which a kept only for its last block: b computes everything, ending
  // its first chunk at the checkpoint so the cache keeps b's FP16 form.
  Request b = serve(prompt(100, 117));
  EXPECT_EQ(b.match.cached_tokens, staged ? 0 : 64);
  EXPECT_EQ(b.match.checkpoint_tokens, staged ? 64 : 0);
  expect_matches_reference(b);

  Request c = serve(prompt(130, 155));
  EXPECT_EQ(c.match.cached_tokens, 64);
  expect_matches_reference(c);
  decode(c, 4);
  expect_matches_reference(c);
  pc->release(b.scope, b.table, b.keys);
  pc->release(c.scope, c.table, c.keys);
  const PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.counters.hit_tokens, staged ? 64 : 128);
  EXPECT_EQ(s.sidecars, staged ? 4 : 0);  // a's, b's and c's last full blocks, and b's block 3
}

TEST_P(PrefixCacheModel, NextTurnOfASessionHitsThePreviousTurnExactly) {
  const TenantId t = pc->add_tenant({"t", "tenant secret", -1, 1.0});
  const CacheScope session{CacheScopeKind::Session, t, "conversation-1"};
  Request turn1 = serve(slice(0, 40), session);
  decode(turn1, 12);  // 52 tokens: 3 full blocks
  pc->release(session, turn1.table, turn1.keys);
  std::vector<int32_t> next = turn1.tokens;
  const std::vector<int32_t> user = slice(300, 320);
  next.insert(next.end(), user.begin(), user.end());
  Request turn2 = serve(next, session);
  EXPECT_EQ(turn2.match.cached_tokens, 48);
  expect_matches_reference(turn2);
  // Another session of the same tenant starts from nothing.
  Request other = serve(next, {CacheScopeKind::Session, t, "conversation-2"});
  EXPECT_EQ(other.match.cached_tokens, 0);
  pc->release(session, turn2.table, turn2.keys);
  pc->release(other.scope, other.table, other.keys);
}

TEST_P(PrefixCacheModel, ForkedSequencesEqualIndependentRuns) {
  const std::vector<int32_t> prompt = slice(0, 37);  // open third block
  const std::vector<int32_t> x = slice(50, 65), y = slice(80, 95);
  BlockTable a;
  ASSERT_TRUE(cache->reserve(a, int32_t(prompt.size())));
  Logits out;
  std::vector<BatchEntry> batch = {{&a, prompt, false}};
  tf->forward(batch, *cache, out);
  BlockTable b;
  ASSERT_TRUE(cache->fork(a, b));
  const int32_t open = a.blocks[2];
  // Both continue in one batch, each past the point where the shared full
  // block 1 leaves the int4 window (52 tokens), so both seal it in one pass.
  ASSERT_TRUE(cache->reserve(a, int32_t(x.size())));
  ASSERT_TRUE(cache->reserve(b, int32_t(y.size())));
  EXPECT_NE(a.blocks[2], open);  // a copied the shared open block...
  EXPECT_EQ(b.blocks[2], open);  // ...so b writes in place
  EXPECT_EQ(a.blocks[1], b.blocks[1]);
  batch = {{&a, x, true}, {&b, y, true}};
  tf->forward(batch, *cache, out);
  const size_t vocab = size_t(out.vocab);
  auto rows = [&](size_t entry, size_t n) {
    return std::span<const float>(out.row(out.first_row[entry]), n * vocab);
  };
  std::vector<int32_t> px = prompt, py = prompt;
  px.insert(px.end(), x.begin(), x.end());
  py.insert(py.end(), y.begin(), y.end());
  const std::vector<float> want_x = reference(px), want_y = reference(py);
  expect_same(rows(0, x.size()), std::span(want_x).subspan(prompt.size() * vocab));
  expect_same(rows(1, y.size()), std::span(want_y).subspan(prompt.size() * vocab));
  cache->release(a);
  cache->release(b);
  EXPECT_EQ(cache->stats().blocks_free, int32_t(options.num_blocks));
  EXPECT_EQ(cache->stats().staging_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Presets, PrefixCacheModel, ::testing::Values("fp32", "int4"));

}  // namespace
}  // namespace kvserve
