// Perplexity follows llama.cpp's protocol: the same model, text and settings
// give the number llama.cpp reports (6.1586, F32 KV, ctx 512, 100 chunks).
#include "engine/perplexity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "util/error.h"

namespace kvserve {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The real model, the TinyStories head as its tokens, and an FP32 cache of
// `blocks` blocks: what the perplexity runs below score.
struct StoriesRun {
  explicit StoriesRun(int64_t blocks, int threads)
      : model(Model::load(std::string(KVSERVE_SOURCE_DIR) + "/models/stories260K.gguf")),
        tokens(model->require_tokenizer().encode(read(std::string(KVSERVE_SHARED_DIR) + "/data/tinystories_train_head.txt"),
                                                 true)),
        pool(threads),
        cache(model->config(), [&] {
          KvCacheOptions o;
          o.num_blocks = blocks;
          return o;
        }()),
        tf(*model, pool) {}
  std::unique_ptr<Model> model;
  std::vector<int32_t> tokens;
  ThreadPool pool;
  KvCache cache;
  Transformer tf;
};

TEST(NegativeLogLikelihood, MatchesClosedForm) {
  const float logits[] = {1.0f, 2.0f, 3.0f};
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(negative_log_likelihood(logits, 3, 0), lse - 1.0, 1e-12);
  EXPECT_NEAR(negative_log_likelihood(logits, 3, 2), lse - 3.0, 1e-12);
}

TEST(Perplexity, MatchesLlamaCppOnStories260K) {
  StoriesRun run(32, 2);
  PerplexityOptions p;
  p.ctx = 512;
  p.chunks = 100;
  const PerplexityResult r = perplexity(run.tf, run.cache, run.tokens, run.model->require_tokenizer().bos_id(), p);
  EXPECT_EQ(r.chunks, 100);
  EXPECT_EQ(r.tokens_scored, 100 * (512 - 1 - 256));
  EXPECT_NEAR(r.ppl, 6.1586, 6.1586 * 0.001);
  EXPECT_EQ(r.kv.tokens_stored, 512);
  EXPECT_EQ(r.kv.bytes_per_token, 1280);
  EXPECT_EQ(run.cache.stats().blocks_used, 0);  // every chunk's blocks came back
}

// kv_tokens_kept_mean counts, per scored position, the tokens its prediction
// saw: without a policy pos + 1, whatever the batch, as streaming counts it
// (the count was taken once per pass, only when the pass's last position was
// scored: 0 at a batch of ctx, 400 at 100 for ctx 512).
TEST(Perplexity, TokensKeptDoNotDependOnTheBatch) {
  StoriesRun run(16, 1);
  PerplexityOptions p;
  p.ctx = 256;
  p.chunks = 1;
  const double expected = (129 + 255) / 2.0;  // positions 128..254 scored, each seeing pos + 1 tokens
  for (const int32_t batch : {256, 100, 7}) {
    p.batch = batch;
    EXPECT_DOUBLE_EQ(perplexity(run.tf, run.cache, run.tokens, 1, p).kv_tokens_kept_mean, expected) << batch;
  }
  p.streaming = true;
  EXPECT_DOUBLE_EQ(perplexity(run.tf, run.cache, run.tokens, 1, p).kv_tokens_kept_mean, expected);
}

TEST(Perplexity, RejectsTextShorterThanOneChunk) {
  auto model = Model::load(std::string(KVSERVE_SOURCE_DIR) + "/models/stories260K.gguf");
  ThreadPool pool(1);
  KvCache cache(model->config(), KvCacheOptions{});
  Transformer tf(*model, pool);
  const std::vector<int32_t> tokens(100, 5);
  PerplexityOptions p;
  EXPECT_THROW(perplexity(tf, cache, tokens, 1, p), Error);
  p.ctx = 1024;
  EXPECT_THROW(perplexity(tf, cache, tokens, 1, p), Error);
}

}  // namespace
}  // namespace kvserve
