// Q/K dumps: the file round trip, clear errors for bad files, and a capture
// from the real model whose keys are exactly the keys the KV cache stores and
// whose BOS query is exactly the first layer's projection of BOS.
#include "attention/qk_dump.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>

#include "engine/qk_capture.h"
#include "engine/transformer.h"
#include "kernels/matmul.h"
#include "kernels/vector_ops.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;
using testing_files::read_all;
using testing_files::write_all;

std::string temp_path(const char* name) { return ::testing::TempDir() + name; }

QkDump small_dump() {
  QkDump d;
  d.n_layers = 2;
  d.n_heads = 4;
  d.n_kv_heads = 2;
  d.head_dim = 8;
  d.chunk = 5;
  d.rope_theta = 500.0f;
  d.n_tokens = 10;
  d.allocate();
  std::iota(d.q.begin(), d.q.end(), 0.5f);
  std::iota(d.k.begin(), d.k.end(), -100.25f);
  std::iota(d.v.begin(), d.v.end(), 7.0f);
  return d;
}

TEST(QkDump, RoundTripsExactly) {
  const QkDump d = small_dump();
  const std::string path = temp_path("round_trip.qk");
  write_qk_dump(path, d);
  // 44-byte header, 4 RoPE frequencies, (2*4 + 2*2*2) * 10 tokens * 8 dims floats.
  EXPECT_EQ(read_all(path).size(), 44u + 4 * 4 + size_t(2 * 4 + 2 * 2 * 2) * 10 * 8 * 4);
  const QkDump r = read_qk_dump(path);
  EXPECT_EQ(r.n_layers, 2);
  EXPECT_EQ(r.n_heads, 4);
  EXPECT_EQ(r.n_kv_heads, 2);
  EXPECT_EQ(r.head_dim, 8);
  EXPECT_EQ(r.chunk, 5);
  EXPECT_EQ(r.rope_theta, 500.0f);
  EXPECT_EQ(r.rope_freqs, unscaled_rope_frequencies(8, 500.0f));  // none given: the base's
  EXPECT_EQ(r.n_tokens, 10);
  EXPECT_EQ(r.q, d.q);
  EXPECT_EQ(r.k, d.k);
  EXPECT_EQ(r.v, d.v);
  // (layer, head, token, dim): layer 1, head 3, token 0 starts after 7 heads of 10 tokens.
  EXPECT_EQ(r.queries(1, 3)[0], 0.5f + 7 * 10 * 8);
  EXPECT_EQ(r.keys(1, 0)[8], -100.25f + 2 * 10 * 8 + 8);
  std::remove(path.c_str());
}

// A scaled model's angles travel with the dump; a version 1 file (no
// frequencies) reads as unscaled RoPE of its base.
TEST(QkDump, CarriesTheRopeFrequencies) {
  QkDump d = small_dump();
  d.rope_freqs = {1.0f, 0.5f, 0.125f, 0.01f};
  const std::string path = temp_path("freqs.qk");
  write_qk_dump(path, d);
  EXPECT_EQ(read_qk_dump(path).rope_freqs, d.rope_freqs);
  std::string v1 = read_all(path);
  v1[8] = 1;
  v1.erase(44, 16);
  write_all(path, v1);
  const QkDump r = read_qk_dump(path);
  EXPECT_EQ(r.rope_freqs, unscaled_rope_frequencies(8, 500.0f));
  EXPECT_EQ(r.q, d.q);
  d.rope_freqs.pop_back();
  expect_error_containing([&] { write_qk_dump(path, d); }, "3 RoPE frequencies for head_dim 8");
  std::remove(path.c_str());
}

TEST(QkDump, BadFilesGetClearErrors) {
  const std::string path = temp_path("bad.qk");
  expect_error_containing([&] { (void)read_qk_dump(temp_path("missing.qk")); }, "cannot open qk dump");
  write_qk_dump(path, small_dump());
  const std::string good = read_all(path);

  write_all(path, good.substr(0, good.size() - 1));
  expect_error_containing([&] { (void)read_qk_dump(path); }, "truncated or corrupt");
  std::string bad = good;
  bad[0] = 'X';
  write_all(path, bad);
  expect_error_containing([&] { (void)read_qk_dump(path); }, "bad magic");
  bad = good;
  bad[8] = 3;  // version
  write_all(path, bad);
  expect_error_containing([&] { (void)read_qk_dump(path); }, "version 3 is not supported");
  bad = good;
  bad[16] = 0;  // n_heads = 0
  write_all(path, bad);
  expect_error_containing([&] { (void)read_qk_dump(path); }, "outside [1, 2^20]");
  QkDump odd = small_dump();
  odd.n_heads = 3;  // not a multiple of the 2 KV heads
  odd.allocate();
  write_qk_dump(path, odd);
  expect_error_containing([&] { (void)read_qk_dump(path); }, "3 query heads are not a multiple of 2 KV heads");
  bad = good;
  bad[35] = char(0x80);  // RoPE base -0.0 (sign bit of the f32 at bytes 32..35)
  for (int i = 32; i < 35; ++i) bad[size_t(i)] = 0;
  write_all(path, bad);
  expect_error_containing([&] { (void)read_qk_dump(path); }, "RoPE base");
  write_all(path, good.substr(0, 10));
  expect_error_containing([&] { (void)read_qk_dump(path); }, "too short");

  QkDump wrong = small_dump();
  wrong.k.pop_back();
  expect_error_containing([&] { write_qk_dump(path, wrong); }, "do not match the shape");
  std::remove(path.c_str());
}

TEST(QkCapture, KeysAreTheCachesAndQueriesTheModels) {
  auto model = Model::load(testing_files::kStoriesGguf);
  const ModelConfig& c = model->config();
  ThreadPool pool(2);
  KvCacheOptions o;
  o.num_blocks = 8;  // one chunk of 64 tokens at block size 16, with room
  KvCache cache(c, o);
  Transformer tf(*model, pool);
  const std::vector<int32_t> tokens = model->require_tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. "
      "One day, she saw a big, red ball in the park. She ran to it and kicked it high into the sky. "
      "Her friend Tom came to play with her, and they laughed all day.", true);
  ASSERT_GE(tokens.size(), 70u);
  QkCaptureOptions opt;
  opt.chunk = 32;
  opt.batch = 7;  // several forward passes per chunk
  const QkDump d = capture_qk(tf, cache, tokens, 1, opt);
  ASSERT_EQ(d.n_tokens, int64_t(tokens.size()) / 32 * 32);
  ASSERT_EQ(d.n_layers, c.n_layers);
  ASSERT_EQ(d.head_dim, c.head_dim());
  ASSERT_EQ(d.rope_theta, c.rope_theta);
  ASSERT_EQ(d.rope_freqs, c.rope_frequencies());
  const int hd = d.head_dim;

  // Chunk 1 again, by hand: the cache's FP32 keys must equal the dump's.
  std::vector<int32_t> chunk(tokens.begin() + 32, tokens.begin() + 64);
  chunk[0] = 1;
  BlockTable table;
  ASSERT_TRUE(cache.reserve(table, 32));
  std::vector<BatchEntry> batch(1);
  batch[0].table = &table;
  batch[0].tokens = chunk;
  Logits logits;
  tf.forward(batch, cache, logits);
  std::vector<float> row(size_t(c.kv_dim()));
  for (int layer = 0; layer < c.n_layers; ++layer)
    for (int32_t t = 0; t < 32; ++t) {
      const KvBlockView view = cache.k_view(layer, table, t / 16, 32);
      view.codec->decode_token(view.data, t % 16, row.data());
      for (int h = 0; h < c.n_kv_heads; ++h)
        for (int j = 0; j < hd; ++j)
          ASSERT_EQ(d.keys(layer, h)[size_t(32 + t) * hd + size_t(j)], row[size_t(h) * hd + size_t(j)])
              << "layer " << layer << " token " << t << " head " << h;
    }
  cache.release(table);

  // BOS sits at position 0 (no rotation) in every chunk: its layer-0 query is
  // Wq · rmsnorm(embedding(BOS)), and identical in both chunks.
  std::vector<float> x(size_t(c.dim)), q(size_t(c.n_heads) * hd);
  dequantize_row(model->weights().token_embedding, 1, x.data());
  rmsnorm(x.data(), x.data(), model->weights().layers[0].attn_norm, c.dim, c.norm_eps);
  matmul(model->weights().layers[0].wq, x.data(), q.data(), 1, nullptr);
  for (int h = 0; h < c.n_heads; ++h)
    for (int j = 0; j < hd; ++j) {
      EXPECT_NEAR(d.queries(0, h)[size_t(j)], q[size_t(h) * hd + size_t(j)], 1e-5f);
      EXPECT_EQ(d.queries(0, h)[size_t(32) * hd + size_t(j)], d.queries(0, h)[size_t(j)]);
    }

  opt.chunk = 1000;
  expect_error_containing([&] { (void)capture_qk(tf, cache, tokens, 1, opt); }, "out of range");
  opt.chunk = 32;
  expect_error_containing([&] { (void)capture_qk(tf, cache, std::vector<int32_t>(10, 5), 1, opt); },
                          "fewer than one chunk");
}

}  // namespace
}  // namespace kvserve
