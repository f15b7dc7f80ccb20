#include "kernels/interleaved_weights.h"
#include "model/model.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <vector>

#include "model/gguf_reader.h"
#include "model/gguf_writer.h"
#include "model/ggml_quantize.h"
#include "model/synthetic_model.h"
#include "util/error.h"
#include "util/half.h"
#include "test_support.h"

namespace kvserve {
namespace {

using namespace testing_files;

const std::string kVocabOnlyGguf = KVSERVE_SHARED_DIR "/vocab/ggml-vocab-llama-spm.gguf";
constexpr size_t kHeaderBytes = 7 * sizeof(int32_t);

std::string temp_path(const std::string& name) { return testing::TempDir() + "kvserve_loader_" + name; }

// The seven header fields of a llama2.c legacy checkpoint, in file order.
struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

// Floats a llama2.c file of header h holds after the header.
int64_t llama2c_floats(const Llama2cHeader& h) {
  const int64_t dim = h.dim, kv_dim = int64_t(h.dim) / h.n_heads * h.n_kv_heads;
  const int64_t vocab = h.vocab_size < 0 ? -int64_t(h.vocab_size) : h.vocab_size;
  const int64_t per_layer = 2 * dim + 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * h.hidden_dim;
  return vocab * dim * (h.vocab_size < 0 ? 2 : 1) + h.n_layers * per_layer + dim +
         int64_t(h.seq_len) * (dim / h.n_heads);
}

// A llama2.c file: header, then float i = i * 0.001 (so every weight is
// distinct and its position is recoverable from its value).
std::string llama2c_file(const Llama2cHeader& h, int64_t floats) {
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  for (int64_t i = 0; i < floats; ++i) {
    const float v = float(i) * 0.001f;
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  return out;
}

std::string with_header(std::string file, const Llama2cHeader& h) {
  std::memcpy(file.data(), &h, sizeof h);
  return file;
}

Llama2cHeader stories_header() { return {64, 172, 5, 8, 4, 512, 512}; }

// A header-sized file and nothing more, for header validation alone.
void expect_llama2c_error(const std::string& name, const Llama2cHeader& h, const std::string& needle) {
  const std::string path = temp_path(name);
  write_all(path, std::string(reinterpret_cast<const char*>(&h), sizeof h));
  expect_error_containing([&] { (void)Model::load(path); }, needle);
}

std::vector<float> row(const WeightMatrix& m, int64_t r) {
  std::vector<float> out(size_t(m.cols));
  dequantize_row(m, r, out.data());
  return out;
}

// ---- the real llama2.c checkpoint -------------------------------------------

TEST(ModelLoader, LoadsStories260KBin) {
  auto m = Model::load(kStoriesBin, kTok512);
  EXPECT_EQ(m->format(), CheckpointFormat::Llama2c);
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.kv_dim(), 32);
  const Weights& w = m->weights();
  EXPECT_EQ(w.classifier.data, w.token_embedding.data);  // shared classifier
  ASSERT_EQ(w.layers.size(), 5u);
  EXPECT_EQ(w.layers[0].wk.rows, 32);
  EXPECT_EQ(w.layers[0].w_down.cols, 172);
  ASSERT_NE(m->tokenizer(), nullptr);
  EXPECT_EQ(m->tokenizer()->vocab_size(), 512);
  EXPECT_EQ(llama2c_floats(stories_header()) * 4 + int64_t(kHeaderBytes), int64_t(read_all(kStoriesBin).size()));

  // Without a tokenizer a llama2.c checkpoint has none, and says how to give one.
  auto bare = Model::load(kStoriesBin);
  EXPECT_EQ(bare->tokenizer(), nullptr);
  expect_error_containing([&] { (void)bare->require_tokenizer(); }, "pass --tokenizer");
}

TEST(ModelLoader, GgufAndBinHoldIdenticalWeights) {
  auto bin = Model::load(kStoriesBin);
  auto gguf = Model::load(kStoriesGguf);
  EXPECT_EQ(gguf->format(), CheckpointFormat::Gguf);
  const ModelConfig& a = bin->config();
  const ModelConfig& b = gguf->config();
  EXPECT_EQ(std::tie(a.dim, a.hidden_dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.seq_len),
            std::tie(b.dim, b.hidden_dim, b.n_layers, b.n_heads, b.n_kv_heads, b.vocab_size, b.seq_len));
  ASSERT_NE(gguf->tokenizer(), nullptr);
  EXPECT_EQ(gguf->tokenizer()->vocab_size(), 512);

  const Weights& x = bin->weights();
  const Weights& y = gguf->weights();
  EXPECT_EQ(row(x.token_embedding, 5), row(y.token_embedding, 5));
  EXPECT_EQ(row(x.token_embedding, 511), row(y.token_embedding, 511));
  EXPECT_EQ(row(x.classifier, 100), row(y.classifier, 100));
  for (int l : {0, 2, 4}) {
    EXPECT_EQ(row(x.layers[l].wk, 3), row(y.layers[l].wk, 3)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].wq, 7), row(y.layers[l].wq, 7)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].wv, 31), row(y.layers[l].wv, 31)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].wo, 0), row(y.layers[l].wo, 0)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].w_gate, 171), row(y.layers[l].w_gate, 171)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].w_down, 63), row(y.layers[l].w_down, 63)) << "layer " << l;
    EXPECT_EQ(row(x.layers[l].w_up, 1), row(y.layers[l].w_up, 1)) << "layer " << l;
    EXPECT_EQ(std::memcmp(x.layers[l].attn_norm, y.layers[l].attn_norm, 64 * 4), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(x.layers[l].ffn_norm, y.layers[l].ffn_norm, 64 * 4), 0) << "layer " << l;
  }
  EXPECT_EQ(std::memcmp(x.final_norm, y.final_norm, 64 * 4), 0);
  EXPECT_EQ(x.bytes(), y.bytes() - y.classifier.bytes());  // the GGUF stores output.weight apart
}

// ---- malformed llama2.c checkpoints ------------------------------------------

TEST(ModelLoader, TruncatedBinNamesTruncation) {
  const std::string full = read_all(kStoriesBin);
  const std::string path = temp_path("trunc.bin");
  for (size_t n : {size_t(0), size_t(3)}) {
    write_all(path, full.substr(0, n));
    expect_error_containing([&] { (void)Model::load(path); }, "too small");
  }
  for (size_t n : {size_t(4), size_t(27)}) {
    write_all(path, full.substr(0, n));
    expect_error_containing([&] { (void)Model::load(path); }, "too small for a llama2.c header");
  }
  const int64_t floats = llama2c_floats(stories_header());
  for (size_t n : {kHeaderBytes, kHeaderBytes + 1000, full.size() / 2, full.size() - 4, full.size() - 1}) {
    write_all(path, full.substr(0, n));
    expect_error_containing([&] { (void)Model::load(path); },
                            "truncated llama2.c checkpoint: header implies " + std::to_string(floats) + " floats");
  }
  // More than the header implies is an error too: a header whose shape is
  // off (a helper set hidden_dim 171, or 4 layers) read the floats as other
  // tensors and generated gibberish.
  write_all(path, full + "extra");
  expect_error_containing([&] { (void)Model::load(path); }, "implies " + std::to_string(floats) + " floats");
  for (int field : {1, 2, 3}) {  // hidden_dim - 1, n_layers - 1, n_kv_heads / 2
    Llama2cHeader h = stories_header();
    if (field == 1) h.hidden_dim -= 1;
    if (field == 2) h.n_layers -= 1;
    if (field == 3) h.n_kv_heads /= 2;
    write_all(path, with_header(full, h));
    expect_error_containing([&] { (void)Model::load(path); }, "a wrong header or a file of another format");
  }
}

TEST(ModelLoader, RejectsBadHeaderSizes) {
  struct Case {
    const char* name;
    Llama2cHeader h;
    const char* needle;
  };
  const Case cases[] = {
      {"dim0", {0, 172, 5, 8, 4, 512, 512}, "dim = 0 is out of range"},
      {"dimneg", {-64, 172, 5, 8, 4, 512, 512}, "dim = -64 is out of range"},
      {"dimhuge", {INT32_MAX, 172, 5, 8, 4, 512, 512}, "dim = 2147483647 is out of range"},
      {"hidden0", {64, 0, 5, 8, 4, 512, 512}, "hidden_dim = 0 is out of range"},
      {"hiddenhuge", {64, 1 << 30, 5, 8, 4, 512, 512}, "hidden_dim = 1073741824 is out of range"},
      {"layersneg", {64, 172, -1, 8, 4, 512, 512}, "n_layers = -1 is out of range"},
      {"layershuge", {64, 172, 100000, 8, 4, 512, 512}, "n_layers = 100000 is out of range"},
      {"heads0", {64, 172, 5, 0, 4, 512, 512}, "n_heads = 0 is out of range"},
      {"kvheads0", {64, 172, 5, 8, 0, 512, 512}, "n_kv_heads = 0 is out of range"},
      {"vocab0", {64, 172, 5, 8, 4, 0, 512}, "vocab_size = 0 is out of range"},
      {"vocabmin", {64, 172, 5, 8, 4, INT32_MIN, 512}, "vocab_size = 0 is out of range"},
      {"vocabhuge", {64, 172, 5, 8, 4, INT32_MAX, 512}, "vocab_size = 2147483647 is out of range"},
      {"vocabneghuge", {64, 172, 5, 8, 4, -INT32_MAX, 512}, "vocab_size = 2147483647 is out of range"},
      {"seq0", {64, 172, 5, 8, 4, 512, 0}, "seq_len = 0 is out of range"},
      {"seqneg", {64, 172, 5, 8, 4, 512, -512}, "seq_len = -512 is out of range"},
      {"headsdiv", {64, 172, 5, 6, 3, 512, 512}, "dim 64 is not a multiple of n_heads 6"},
      {"kvdiv", {64, 172, 5, 8, 3, 512, 512}, "n_heads 8 is not a multiple of n_kv_heads 3"},
      {"oddhead", {72, 172, 5, 8, 4, 512, 512}, "head dimension 9 is odd"},
      // Every field in range, their product far beyond the 28-byte file.
      {"allmax", {1 << 16, 1 << 18, 1024, 1024, 1024, 1 << 22, 1 << 24}, "truncated llama2.c checkpoint"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    expect_llama2c_error(std::string(c.name) + ".bin", c.h, c.needle);
  }
  expect_llama2c_error("ak42.bin", {0x616b3432, 1, 64, 172, 5, 8, 4}, "versioned export (magic 'ak42')");
}

TEST(ModelLoader, SeparateClassifierLoadsItsOwnWeights) {
  // stories260K with a negative vocab size and a classifier appended.
  Llama2cHeader h = stories_header();
  h.vocab_size = -512;
  std::string file = with_header(read_all(kStoriesBin), h);
  std::vector<float> classifier(512 * 64);
  for (size_t i = 0; i < classifier.size(); ++i) classifier[i] = float(i % 1000) * -0.5f;
  file.append(reinterpret_cast<const char*>(classifier.data()), classifier.size() * sizeof(float));
  const std::string path = temp_path("classifier.bin");
  write_all(path, file);

  auto m = Model::load(path, kTok512);
  EXPECT_EQ(m->config().vocab_size, 512);
  const Weights& w = m->weights();
  EXPECT_NE(w.classifier.data, w.token_embedding.data);
  EXPECT_EQ(w.classifier.rows, 512);
  EXPECT_EQ(w.classifier.cols, 64);
  EXPECT_EQ(std::memcmp(w.classifier.data, classifier.data(), classifier.size() * sizeof(float)), 0);
  auto shared = Model::load(kStoriesBin);
  EXPECT_EQ(row(w.token_embedding, 5), row(shared->weights().token_embedding, 5));
  EXPECT_EQ(w.bytes(), shared->weights().bytes() + classifier.size() * sizeof(float));

  // Without the appended classifier the same header is a truncated file.
  write_all(path, with_header(read_all(kStoriesBin), h));
  expect_error_containing([&] { (void)Model::load(path); }, "truncated llama2.c checkpoint");
}

TEST(ModelLoader, SyntheticLlama2cFileLaysOutSectionsInOrder) {
  const Llama2cHeader h = {8, 16, 2, 2, 1, 6, 4};  // head 4, kv_dim 4
  const std::string path = temp_path("tiny.bin");
  write_all(path, llama2c_file(h, llama2c_floats(h)));
  auto m = Model::load(path);
  const Weights& w = m->weights();
  auto at = [](const float* p) { return int64_t(std::lround(double(*p) / 0.001)); };
  auto first = [&](const WeightMatrix& x) { return at(static_cast<const float*>(x.data)); };
  // token_embedding 6*8, attn_norm 2*8, wq 2*64, wk 2*32, wv 2*32, wo 2*64,
  // ffn_norm 2*8, w1 2*128, w2 2*128, w3 2*128, final_norm 8.
  EXPECT_EQ(first(w.token_embedding), 0);
  EXPECT_EQ(at(w.layers[1].attn_norm), 48 + 8);
  EXPECT_EQ(first(w.layers[0].wq), 64);
  EXPECT_EQ(first(w.layers[1].wk), 64 + 128 + 32);
  EXPECT_EQ(first(w.layers[0].wv), 256);
  EXPECT_EQ(first(w.layers[0].wo), 320);
  EXPECT_EQ(at(w.layers[0].ffn_norm), 448);
  EXPECT_EQ(first(w.layers[0].w_gate), 464);
  EXPECT_EQ(first(w.layers[0].w_down), 720);
  EXPECT_EQ(first(w.layers[1].w_up), 976 + 128);
  EXPECT_EQ(at(w.final_norm), 1232);
  EXPECT_EQ(w.classifier.data, w.token_embedding.data);
  EXPECT_EQ(llama2c_floats(h), 1232 + 8 + 4 * 4);
}

// Random header values on a tiny llama2.c file: each loads or throws
// kvserve::Error, and what loads fits inside the file.
TEST(ModelLoader, RandomLlama2cHeadersLoadOrThrowError) {
  const Llama2cHeader h = {8, 16, 2, 2, 1, 6, 4};
  const std::string body = llama2c_file(h, llama2c_floats(h) + 64);
  const int32_t interesting[] = {0, 1, 2, 3, 4, 6, 8, 16, -1, -6, INT32_MIN, INT32_MAX, 1 << 16, 1 << 22};
  std::mt19937_64 rng(77);
  const std::string path = temp_path("random_header.bin");
  int loaded = 0, rejected = 0;
  constexpr int kIterations = 2000;
  for (int it = 0; it < kIterations; ++it) {
    std::string bytes = body;
    const int changes = 1 + int(rng() % 3);
    for (int k = 0; k < changes; ++k) {
      const int32_t v = rng() % 2 ? interesting[rng() % std::size(interesting)] : int32_t(rng() % 33) - 8;
      std::memcpy(&bytes[4 * (rng() % 7)], &v, 4);
    }
    write_all(path, bytes);
    try {
      auto m = Model::load(path);
      const Weights& w = m->weights();
      const auto* begin = reinterpret_cast<const uint8_t*>(w.token_embedding.data) - kHeaderBytes;
      const auto* end = begin + bytes.size();
      auto inside = [&](const void* p, size_t n) {
        const auto* q = static_cast<const uint8_t*>(p);
        return q >= begin && q + n <= end;
      };
      EXPECT_TRUE(inside(w.classifier.data, w.classifier.bytes())) << "iteration " << it;
      EXPECT_TRUE(inside(w.final_norm, size_t(m->config().dim) * 4)) << "iteration " << it;
      for (const auto& l : w.layers) EXPECT_TRUE(inside(l.w_up.data, l.w_up.bytes())) << "iteration " << it;
      ++loaded;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << it << ": non-kvserve exception: " << e.what();
    }
  }
  std::cout << "[ headers  ] " << loaded << " loaded, " << rejected << " rejected of " << kIterations << "\n";
  EXPECT_GT(loaded, 0);
  EXPECT_GT(rejected, 0);
}

// ---- GGUF checkpoints -------------------------------------------------------

TEST(ModelLoader, VocabOnlyGgufHasNoTensors) {
  expect_error_containing([] { (void)Model::load(kVocabOnlyGguf); }, "no tensors");
}

TEST(ModelLoader, SyntheticGgufLoadsEachWeightType) {
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::Q8_0, WeightType::Q4_0}) {
    SCOPED_TRACE(std::string(weight_type_name(t)));
    SyntheticModelOptions o;
    o.dim = 64;
    o.hidden_dim = 96;
    o.n_layers = 2;
    o.n_heads = 4;
    o.n_kv_heads = 2;
    o.vocab_size = 40;
    o.seq_len = 64;
    o.weights = ggml_type_of(t);
    const std::string path = temp_path("synth_" + std::string(weight_type_name(t)) + ".gguf");
    write_synthetic_gguf(path, o);
    auto m = Model::load(path);
    const ModelConfig& c = m->config();
    EXPECT_EQ(c.dim, 64);
    EXPECT_EQ(c.hidden_dim, 96);
    EXPECT_EQ(c.n_layers, 2);
    EXPECT_EQ(c.kv_dim(), 32);
    EXPECT_EQ(c.vocab_size, 40);
    EXPECT_EQ(c.seq_len, 64);
    const Weights& w = m->weights();
    EXPECT_EQ(w.token_embedding.type, t);
    EXPECT_EQ(w.classifier.type, t);
    EXPECT_NE(w.classifier.data, w.token_embedding.data);
    // Q8_0/Q4_0 projections run from interleaved copies where the build has the kernel.
    const bool interleaved =
        (t == WeightType::Q8_0 || t == WeightType::Q4_0) && loads_interleaved_weights();
    EXPECT_EQ(w.classifier.interleaved != nullptr, interleaved);
    EXPECT_EQ(w.token_embedding.interleaved, nullptr);
    for (const auto& l : w.layers) {
      for (const WeightMatrix* x : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up})
        EXPECT_EQ(x->interleaved != nullptr, interleaved);
      EXPECT_EQ(l.wq.type, t);
      EXPECT_EQ(l.wk.type, t);
      EXPECT_EQ(l.w_down.type, t);
      EXPECT_EQ(l.w_down.cols, 96);
    }
    ASSERT_NE(m->tokenizer(), nullptr);
    EXPECT_EQ(m->tokenizer()->vocab_size(), 40);
  }
}

// A small synthetic checkpoint of weight type t (dims multiples of 256, as
// the K-quants need).
SyntheticModelOptions small_synthetic(GgmlType t, int32_t n_layers) {
  SyntheticModelOptions o;
  o.dim = 256;
  o.hidden_dim = 512;
  o.n_layers = n_layers;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.vocab_size = 40;
  o.seq_len = 64;
  o.weights = t;
  return o;
}

// Every type converted at load: the matrices become Q8_0 (F32 for BF16;
// Q4_1 for Q4_1 and Q4_K where the build runs Q4_1 natively), hold what the
// file's rows decode to, are listed by conversions(), and get the
// interleaved treatment native Q8_0 gets (their row-major copy freed).
TEST(ModelLoader, SyntheticGgufConvertsOtherTypesAtLoad) {
  for (GgmlType t : {GgmlType::BF16, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q2_K, GgmlType::Q3_K,
                     GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    const std::string type_name = ggml_type_name(uint32_t(t));
    SCOPED_TRACE(type_name);
    const SyntheticModelOptions o = small_synthetic(t, 2);
    const std::string path = temp_path("synth_" + type_name + ".gguf");
    write_synthetic_gguf(path, o);
    auto m = Model::load(path);
    const bool q4_1 = (t == GgmlType::Q4_1 || t == GgmlType::Q4_K) && loads_q4_1_natively();
    const WeightType to = t == GgmlType::BF16 ? WeightType::F32 : q4_1 ? WeightType::Q4_1 : WeightType::Q8_0;
    const std::vector<TensorConversion> conv = m->conversions();
    ASSERT_EQ(conv.size(), 2u + 7u * 2u);
    EXPECT_EQ(conv[0].name, "token_embd.weight");
    EXPECT_EQ(conv[1].name, "output.weight");
    EXPECT_EQ(conv[2].name, "blk.0.attn_q.weight");
    for (const TensorConversion& c : conv) {
      EXPECT_EQ(c.from, uint32_t(t)) << c.name;
      EXPECT_EQ(c.to, to) << c.name;
    }
    const Weights& w = m->weights();
    const bool interleaved = to != WeightType::F32 && loads_interleaved_weights();
    EXPECT_EQ(w.token_embedding.type, to);
    EXPECT_NE(w.token_embedding.data, nullptr);  // lookups read it
    EXPECT_EQ(w.token_embedding.interleaved, nullptr);
    EXPECT_EQ(w.classifier.interleaved != nullptr, interleaved);
    for (const auto& l : w.layers)
      for (const WeightMatrix* x : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up}) {
        EXPECT_EQ(x->type, to);
        EXPECT_EQ(x->interleaved != nullptr, interleaved);
        EXPECT_EQ(x->data == nullptr, interleaved);  // only the interleaved copy is kept
      }
    EXPECT_EQ(w.bytes(), (2 * 40 * 256 + 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 512)) *
                                 weight_row_bytes(to, 32) / 32 +
                             5 * 256 * sizeof(float));

    // The embedding's rows are the file's rows decoded (exactly for BF16),
    // re-encoded: within half a Q8_0 step d = amax / 127, plus the fp16
    // rounding of d times codes up to 127 (127 * 2^-11 d). Q4_1 is copied
    // (exact); Q4_K's sub-block scales and mins rounded to fp16: 2^-11 of
    // 15 |d| + |m| (ggml_dequantize.h), measured on the stored d and m.
    GgufFile f(path);
    const GgufTensorInfo& emb = *f.find_tensor("token_embd.weight");
    const size_t src_row = emb.bytes / 40;
    std::vector<float> want(256), got(256);
    for (int64_t r = 0; r < 40; r += 13) {
      dequantize_ggml_row(t, emb.data + size_t(r) * src_row, 256, want.data());
      dequantize_row(w.token_embedding, r, got.data());
      for (int b = 0; b < 256; b += 32) {
        float amax = 0;
        for (int i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(want[size_t(i)]));
        float tol = to == WeightType::F32 ? 0.0f : amax / 127.0f * (0.5f + 127.0f / 2048.0f) + 1e-7f;
        if (to == WeightType::Q4_1) {
          const uint8_t* block = w.token_embedding.row(r) + b / 32 * 20;
          fp16_t d, mn;
          std::memcpy(&d, block, 2);
          std::memcpy(&mn, block + 2, 2);
          tol = t == GgmlType::Q4_1
                    ? 0.0f
                    : (15.0f * std::fabs(fp16_to_fp32(d)) + std::fabs(fp16_to_fp32(mn))) * (1.0f / 2048.0f) * 1.001f +
                          1e-7f;
        }
        for (int i = b; i < b + 32; ++i) ASSERT_NEAR(got[size_t(i)], want[size_t(i)], tol) << "row " << r << " value " << i;
      }
    }
    // Its fingerprint hashes the file's bytes: stable across loads (the
    // freed row-major copies are not read).
    EXPECT_EQ(m->fingerprint(), Model::load(path)->fingerprint());
  }
}

// A GGUF `llama` checkpoint with tensors of the given shapes, no vocabulary.
struct TinyGguf {
  int64_t dim = 8, hidden = 16, layers = 1, heads = 2, kv_heads = 1, vocab = 4, seq = 16;
  GgmlType type = GgmlType::F32;  // of the matrices (all-zero bytes); norms are F32
  std::vector<int64_t> wk_dims;   // empty: the right {dim, kv_dim}
  std::vector<int64_t> emb_dims;  // empty: the right {dim, vocab}

  void write(const std::string& path, GgufWriter w = GgufWriter()) const {
    w.set_string("general.architecture", "llama");
    w.set_u32("llama.embedding_length", uint32_t(dim));
    w.set_u32("llama.feed_forward_length", uint32_t(hidden));
    w.set_u32("llama.block_count", uint32_t(layers));
    w.set_u32("llama.attention.head_count", uint32_t(heads));
    w.set_u32("llama.attention.head_count_kv", uint32_t(kv_heads));
    w.set_u32("llama.context_length", uint32_t(seq));
    const int64_t kv = dim / heads * kv_heads;
    auto tensor = [&](const std::string& name, std::vector<int64_t> dims, GgmlType t) {
      int64_t n = 1;
      for (int64_t d : dims) n *= d;
      const GgmlBlock b = ggml_block(uint32_t(t));
      w.add_tensor(name, dims, t, std::vector<uint8_t>(size_t(n / b.values * b.bytes), 0));
    };
    auto f32 = [&](const std::string& name, std::vector<int64_t> dims) {
      tensor(name, dims, dims.size() == 1 ? GgmlType::F32 : type);
    };
    f32("token_embd.weight", emb_dims.empty() ? std::vector<int64_t>{dim, vocab} : emb_dims);
    f32("output_norm.weight", {dim});
    for (int64_t l = 0; l < layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      f32(p + "attn_norm.weight", {dim});
      f32(p + "attn_q.weight", {dim, dim});
      f32(p + "attn_k.weight", wk_dims.empty() ? std::vector<int64_t>{dim, kv} : wk_dims);
      f32(p + "attn_v.weight", {dim, kv});
      f32(p + "attn_output.weight", {dim, dim});
      f32(p + "ffn_norm.weight", {dim});
      f32(p + "ffn_gate.weight", {dim, hidden});
      f32(p + "ffn_down.weight", {hidden, dim});
      f32(p + "ffn_up.weight", {dim, hidden});
    }
    w.write(path);
  }
};

TEST(ModelLoader, TinyGgufLoadsAndSharesItsEmbedding) {
  const std::string path = temp_path("tiny.gguf");
  TinyGguf().write(path);
  auto m = Model::load(path);
  EXPECT_EQ(m->config().vocab_size, 4);
  EXPECT_EQ(m->weights().classifier.data, m->weights().token_embedding.data);  // no output.weight
  EXPECT_EQ(m->tokenizer(), nullptr);
}

// RoPE scaling keys as llama.cpp reads them: a factor without a type is
// linear (its default type), "none" ignores the factor, another type is
// refused by name, and rope_freqs.weight must hold one value per pair.
TEST(ModelLoader, RopeScalingKeysReadAsLlamaCppReadsThem) {
  auto with_keys = [&](const std::string& name, auto set) {
    GgufWriter w;
    set(w);
    const std::string path = temp_path(name + ".gguf");
    TinyGguf().write(path, std::move(w));
    return path;
  };
  const RopeScaling s =
      Model::load(with_keys("rope_no_type", [](GgufWriter& w) { w.set_f32("llama.rope.scaling.factor", 2.0f); }))
          ->config()
          .rope_scaling;
  EXPECT_EQ(s.type, RopeScalingType::Linear);
  EXPECT_EQ(s.factor, 2.0f);
  const std::string none = with_keys("rope_none", [](GgufWriter& w) {
    w.set_string("llama.rope.scaling.type", "none");
    w.set_f32("llama.rope.scaling.factor", 2.0f);
  });
  EXPECT_FALSE(Model::load(none)->config().rope_scaling.scales());
  const std::string longrope =
      with_keys("rope_longrope", [](GgufWriter& w) { w.set_string("llama.rope.scaling.type", "longrope"); });
  expect_error_containing([&] { (void)Model::load(longrope); },
                          "RoPE scaling type 'longrope' (llama.rope.scaling.type) is not supported");
  const std::string short_freqs = with_keys("rope_short_freqs", [](GgufWriter& w) {
    w.add_tensor("rope_freqs.weight", {3}, GgmlType::F32, std::vector<uint8_t>(12, 0));
  });
  expect_error_containing([&] { (void)Model::load(short_freqs); }, "tensor 'rope_freqs.weight' has shape [3], expected [2]");
  const std::string zero_freqs = with_keys("rope_zero_freqs", [](GgufWriter& w) {
    w.add_tensor("rope_freqs.weight", {2}, GgmlType::F32, std::vector<uint8_t>(8, 0));
  });
  expect_error_containing([&] { (void)Model::load(zero_freqs); }, "rope_freqs.weight[0] = 0 must be positive and finite");
}

// A Q4_K block whose d times a sub-block scale passes fp16's 65504 (the Q4_1
// path), or whose values pass 127 * 65504 (the Q8_0 path), would compute inf
// or NaN: the load fails naming the tensor. ggml forms d * sc in fp32.
TEST(ModelLoader, ConvertedScalePastFp16IsAnError) {
  const SyntheticModelOptions o = small_synthetic(GgmlType::Q4_K, 1);
  const std::string path = temp_path("q4k_huge_d.gguf");
  write_synthetic_gguf(path, o);
  std::string bytes;
  {
    const GgufFile f(path);
    const GgufTensorInfo* t = f.find_tensor("blk.0.attn_q.weight");
    ASSERT_NE(t, nullptr);
    const std::string first_block(reinterpret_cast<const char*>(t->data), 144);
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
    const size_t at = bytes.find(first_block);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(bytes.find(first_block, at + 1), std::string::npos);
    const uint16_t d = fp32_to_fp16(32768.0f);  // times any scale of 2 or more: past 65504
    std::memcpy(&bytes[at], &d, sizeof d);
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  expect_error_containing([&] { (void)Model::load(path); },
                          "tensor 'blk.0.attn_q.weight' (Q4_K (ggml type 12)) converted to");
  expect_error_containing([&] { (void)Model::load(path); }, "row 0 has a block scale past fp16's range");
}

// The fingerprint is the identity of KV blocks shared through tiers: a Q4_K
// file computed as Q4_1 (AVX2) and as Q8_0 (AVX-512 VNNI hosts, or with
// interleaving off) has other weights, so other fingerprints.
TEST(ModelLoader, FingerprintNamesTheComputedType) {
  if (!native_q4_1_supported()) GTEST_SKIP() << "this build computes Q4_K as Q8_0 only";
  const SyntheticModelOptions o = small_synthetic(GgmlType::Q4_K, 1);
  const std::string path = temp_path("q4k_fingerprint.gguf");
  write_synthetic_gguf(path, o);
  const char* was = std::getenv("KVSERVE_INTERLEAVE_WEIGHTS");
  const std::string saved = was != nullptr ? was : "";
  ::unsetenv("KVSERVE_INTERLEAVE_WEIGHTS");
  const std::string as_q4_1 = Model::load(path)->fingerprint();
  ::setenv("KVSERVE_INTERLEAVE_WEIGHTS", "0", 1);
  auto q8 = Model::load(path);
  const std::string as_q8_0 = q8->fingerprint();
  if (was != nullptr) ::setenv("KVSERVE_INTERLEAVE_WEIGHTS", saved.c_str(), 1);
  else ::unsetenv("KVSERVE_INTERLEAVE_WEIGHTS");
  ASSERT_EQ(q8->conversions().front().to, WeightType::Q8_0);
  EXPECT_NE(as_q4_1, as_q8_0);
  EXPECT_EQ(as_q4_1, Model::load(path)->fingerprint());
}

// A converted embedding with no output.weight: the classifier shares the
// converted copy, which lookups keep reading after the classifier's
// interleaved copy is made.
TEST(ModelLoader, ConvertedEmbeddingIsSharedWithTheClassifier) {
  TinyGguf g;
  g.dim = 256;
  g.hidden = 256;
  g.type = GgmlType::Q4_K;
  const std::string path = temp_path("tiny_q4k.gguf");
  g.write(path);
  auto m = Model::load(path);
  const Weights& w = m->weights();
  EXPECT_EQ(w.token_embedding.type, loads_q4_1_natively() ? WeightType::Q4_1 : WeightType::Q8_0);
  EXPECT_EQ(w.classifier.data, w.token_embedding.data);
  EXPECT_NE(w.token_embedding.data, nullptr);
  EXPECT_EQ(m->conversions().size(), 1u + 7u);  // the embedding once
  std::vector<float> row(256, 1.0f);
  dequantize_row(w.token_embedding, 3, row.data());
  for (float v : row) EXPECT_EQ(v, 0.0f);  // all-zero blocks
  EXPECT_EQ(m->fingerprint().size(), 32u);
}

TEST(ModelLoader, GgufWithWrongShapeNamesTheTensor) {
  TinyGguf g;
  g.wk_dims = {8, 8};
  const std::string path = temp_path("wrongshape.gguf");
  g.write(path);
  expect_error_containing([&] { (void)Model::load(path); }, "tensor 'blk.0.attn_k.weight' has shape [8, 8], expected [8, 4]");
}

// A head count that divides the width but not as the weights were cut gives
// another head dimension: the message names the keys and the tensor.
TEST(ModelLoader, GgufHeadCountInconsistentWithTensorsNamesBoth) {
  const std::string path = temp_path("heads_vs_tensors.gguf");
  TinyGguf g;  // head_count 4 (head dimension 2), but attn_k cut for 1 KV head of 4
  g.heads = 4;
  g.wk_dims = {8, 4};
  g.write(path);
  expect_error_containing([&] { (void)Model::load(path); },
                          "tensor 'blk.0.attn_k.weight' has shape [8, 4], expected [8, 2]: "
                          "llama.attention.head_count = 4 gives a head dimension of 2 (llama.embedding_length 8 / 4), "
                          "times llama.attention.head_count_kv = 1; a head count is inconsistent");
  // With llama.rope.dimension_count, the tensor is still what is named first.
  GgufWriter rope;
  rope.set_u32("llama.rope.dimension_count", 4);
  g.write(path, rope);
  expect_error_containing([&] { (void)Model::load(path); }, "llama.attention.head_count = 4 gives a head dimension");
  // Both counts doubled (4 and 2 for 2 and 1) still fit attn_k's 4 rows; the
  // RoPE width is what shows it, and its message names the head count.
  TinyGguf fits;
  fits.heads = 4;
  fits.kv_heads = 2;
  fits.write(path, rope);
  expect_error_containing([&] { (void)Model::load(path); },
                          "llama.rope.dimension_count = 4 but the head dimension is 2 (llama.embedding_length 8 / "
                          "llama.attention.head_count 4): a wrong head_count");
}

// A head dimension of its own (llama.attention.key_length, as Mistral-Nemo
// has) is named as unsupported, not blamed on the head count; one equal to
// embedding_length / head_count loads.
TEST(ModelLoader, GgufOwnHeadDimensionIsNamedUnsupported) {
  const std::string path = temp_path("key_length.gguf");
  TinyGguf g;  // embedding 8, 2 heads: head dimension 4
  GgufWriter own;
  own.set_u32("llama.attention.key_length", 2);
  g.write(path, own);
  expect_error_containing([&] { (void)Model::load(path); },
                          "llama.attention.key_length = 2 differs from llama.embedding_length / "
                          "llama.attention.head_count = 8 / 2 = 4: a head dimension of its own is not supported");
  GgufWriter same;
  same.set_u32("llama.attention.key_length", 4);
  same.set_u32("llama.attention.value_length", 4);
  g.write(path, same);
  EXPECT_NO_THROW((void)Model::load(path));
}

// GGUF lists dims innermost first: an embedding written [vocab, dim] is
// named as transposed, whether or not llama.vocab_size is given.
TEST(ModelLoader, GgufTransposedEmbeddingIsNamed) {
  const std::string path = temp_path("emb_transposed.gguf");
  TinyGguf g;
  g.emb_dims = {4, 8};
  g.write(path);
  const std::string transposed =
      "tensor 'token_embd.weight' has shape [4, 8]: it appears transposed (expected [8, 4]: "
      "llama.embedding_length first, then the vocabulary size)";
  expect_error_containing([&] { (void)Model::load(path); }, transposed);
  GgufWriter vocab;
  vocab.set_u32("llama.vocab_size", 4);
  g.write(path, vocab);
  expect_error_containing([&] { (void)Model::load(path); }, transposed);
  g.emb_dims = {5, 3};
  g.write(path);
  expect_error_containing([&] { (void)Model::load(path); },
                          "tensor 'token_embd.weight' has shape [5, 3], expected [8, vocabulary size]");
}

TEST(ModelLoader, GgufConfigErrors) {
  auto expect_config_error = [](const std::string& name, GgufWriter extra, TinyGguf g, const std::string& needle) {
    const std::string path = temp_path(name);
    g.write(path, std::move(extra));
    expect_error_containing([&] { (void)Model::load(path); }, needle);
  };
  TinyGguf bad_heads;
  bad_heads.heads = 3;
  expect_config_error("heads.gguf", GgufWriter(), bad_heads,
                      "llama.attention.head_count = 3 does not divide llama.embedding_length = 8");
  TinyGguf bad_kv_heads;
  bad_kv_heads.kv_heads = 4;
  expect_config_error("kv_heads.gguf", GgufWriter(), bad_kv_heads,
                      "llama.attention.head_count = 2 is not a multiple of llama.attention.head_count_kv = 4");
  TinyGguf zero_seq;
  zero_seq.seq = 0;
  expect_config_error("seq0.gguf", GgufWriter(), zero_seq, "seq_len = 0 is out of range");
  // 2^32 - 1 does not fit ModelConfig's int32 fields; it must not wrap to -1.
  GgufWriter big_vocab;
  big_vocab.set_u32("llama.vocab_size", 0xFFFFFFFFu);
  expect_config_error("bigvocab.gguf", big_vocab, TinyGguf(), "'llama.vocab_size' = 4294967295 is out of range");
  GgufWriter twice;
  twice.set_string("general.architecture", "gpt2");
  expect_config_error("dupkey.gguf", twice, TinyGguf(), "duplicate metadata key 'general.architecture'");
  GgufWriter rope;
  rope.set_u32("llama.rope.dimension_count", 2);
  expect_config_error("rope.gguf", rope, TinyGguf(), "partial rotary embedding (2 of 4 dims)");
  GgufWriter eps;
  eps.set_f32("llama.attention.layer_norm_rms_epsilon", 0.0f);
  expect_config_error("eps.gguf", eps, TinyGguf(), "norm_eps (0) and rope_theta (10000) must be positive and finite");
  // Infinity is positive, but every norm then gives zeros: a uniform output.
  GgufWriter inf_eps;
  inf_eps.set_f32("llama.attention.layer_norm_rms_epsilon", INFINITY);
  expect_config_error("inf_eps.gguf", inf_eps, TinyGguf(), "must be positive and finite");
  GgufWriter inf_theta;
  inf_theta.set_f32("llama.rope.freq_base", INFINITY);
  expect_config_error("inf_theta.gguf", inf_theta, TinyGguf(), "must be positive and finite");
  // Tensors the graph would leave out (a layer past block_count, a bias)
  // are refused, not ignored. (RoPE scaling: RopeScalingKeysReadAsLlamaCppReadsThem.)
  for (const std::string name : {"blk.1.attn_q.weight", "blk.0.attn_q.bias"}) {
    GgufWriter extra;
    extra.add_tensor(name, {2}, GgmlType::F32, std::vector<uint8_t>(8, 0));
    expect_config_error("extra.gguf", extra, TinyGguf(), "tensor '" + name + "' is not part of the llama graph");
  }
}

TEST(ModelLoader, GgufArchitectureIsChecked) {
  GgufWriter w;
  w.set_string("general.architecture", "gpt2");
  w.add_tensor("x", {4}, GgmlType::F32, std::vector<uint8_t>(16, 0));
  const std::string path = temp_path("gpt2arch.gguf");
  w.write(path);
  expect_error_containing([&] { (void)Model::load(path); }, "architecture 'gpt2' is not supported");
  GgufWriter none;
  none.add_tensor("x", {4}, GgmlType::F32, std::vector<uint8_t>(16, 0));
  none.write(path);
  expect_error_containing([&] { (void)Model::load(path); }, "missing general.architecture");
}

// ---- tokenizer files --------------------------------------------------------

TEST(ModelLoader, TruncatedTokenizerIsAnError) {
  const std::string tok = read_all(kTok512);
  const std::string path = temp_path("tok_trunc.bin");
  for (size_t n : {size_t(0), size_t(2), size_t(4), size_t(100), tok.size() / 2, tok.size() - 1}) {
    SCOPED_TRACE(n);
    write_all(path, tok.substr(0, n));
    expect_error_containing([&] { (void)Model::load(kStoriesBin, path); }, "truncated tokenizer file");
  }
  std::string zero_len = tok;
  const int32_t zero = 0;
  std::memcpy(zero_len.data(), &zero, 4);
  write_all(path, zero_len);
  expect_error_containing([&] { (void)Model::load(kStoriesBin, path); }, "max_token_length 0 must be positive");
  std::string long_token = tok;
  const int32_t huge = INT32_MAX;
  std::memcpy(long_token.data() + 4 + 4, &huge, 4);  // token 0's length
  write_all(path, long_token);
  expect_error_containing([&] { (void)Model::load(kStoriesBin, path); }, "token 0 has length 2147483647");
  expect_error_containing([&] { (void)Model::load(kStoriesBin, temp_path("no_such_tokenizer.bin")); },
                          "cannot open");
}

TEST(ModelLoader, TokenizerVocabSizeMismatchIsAnError) {
  // A 32000-token GGUF vocabulary for a 512-token model.
  expect_error_containing([] { (void)Model::load(kStoriesBin, kVocabOnlyGguf); },
                          "tokenizer has 32000 tokens but the model's vocabulary is 512");
  // tok512.bin read as the tokenizer of a 256-token model leaves bytes over.
  Llama2cHeader h = stories_header();
  h.vocab_size = 256;
  const std::string path = temp_path("vocab256.bin");
  const std::string full = read_all(kStoriesBin);
  write_all(path, with_header(full.substr(0, full.size() - 256 * 64 * 4), h));  // 256 fewer embedding rows
  expect_error_containing([&] { (void)Model::load(path, kTok512); }, "bytes follow the 256 tokens");
  // ... and as that of a 600-token model runs out.
  h.vocab_size = 600;
  write_all(path, with_header(full + std::string(88 * 64 * 4, '\0'), h));
  expect_error_containing([&] { (void)Model::load(path, kTok512); }, "truncated tokenizer file: token 512 of 600");
}

}  // namespace
}  // namespace kvserve
