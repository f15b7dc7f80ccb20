#include "model/gguf_reader.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>

#include "model/gguf_writer.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "util/error.h"
#include "test_support.h"

namespace kvserve {
namespace {

using namespace testing_files;


std::string temp_path(const std::string& name) { return testing::TempDir() + "kvserve_gguf_" + name; }

// Hand-encoded GGUF bytes, for files GgufWriter refuses to produce.
struct Raw {
  std::string bytes;

  template <class T>
  Raw& put(T v) {
    bytes.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Raw& u32(uint32_t v) { return put(v); }
  Raw& u64(uint64_t v) { return put(v); }
  Raw& str(const std::string& s) {
    u64(s.size());
    bytes += s;
    return *this;
  }
  // "GGUF", version, tensor count, metadata count.
  Raw& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return u32(0x46554747).u32(version).u64(n_tensors).u64(n_kv);
  }
  Raw& key(const std::string& k, GgufType t) { return str(k).u32(uint32_t(t)); }
  Raw& tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, uint64_t offset) {
    str(name).u32(uint32_t(dims.size()));
    for (uint64_t d : dims) u64(d);
    return u32(type).u64(offset);
  }
  Raw& pad(size_t alignment = 32) {
    bytes.resize((bytes.size() + alignment - 1) / alignment * alignment, '\0');
    return *this;
  }
};

// Expects opening `bytes` as a GGUF to throw kvserve::Error whose message
// contains `needle`.
void expect_gguf_error(const std::string& name, const std::string& bytes, const std::string& needle) {
  const std::string path = temp_path(name);
  write_all(path, bytes);
  try {
    GgufFile f(path);
    ADD_FAILURE() << name << ": opened without error, expected '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << name << ": message '" << e.what() << "' lacks '" << needle << "'";
  }
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = uint8_t(seed + i * 7);
  return out;
}

// ---- the real checkpoint ----------------------------------------------------

TEST(GgufReader, ParsesStories260K) {
  GgufFile f(kStoriesGguf);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.tensors().size(), 48u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.embedding_length"), 64);
  EXPECT_EQ(f.get_int("llama.feed_forward_length"), 172);
  EXPECT_EQ(f.get_int("llama.block_count"), 5);
  EXPECT_EQ(f.get_int("llama.attention.head_count"), 8);
  EXPECT_EQ(f.get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(f.get_int("llama.context_length"), 512);
  EXPECT_EQ(f.get_int("llama.rope.dimension_count"), 8);
  EXPECT_FLOAT_EQ(float(f.get_float_or("llama.attention.layer_norm_rms_epsilon", 0)), 1e-5f);
  EXPECT_EQ(f.get_int("tokenizer.ggml.padding_token_id"), 0xFFFFFFFF);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 512u);
  EXPECT_EQ(tokens[1], "<s>");
  EXPECT_EQ(f.get_float_array("tokenizer.ggml.scores").size(), 512u);
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type")[0], 2);
  EXPECT_FALSE(f.has("llama.vocab_size"));

  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->dims, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(emb->ggml_type, uint32_t(GgmlType::F32));
  EXPECT_EQ(emb->offset, 0u);
  EXPECT_EQ(emb->bytes, 64u * 512 * 4);
  EXPECT_EQ(f.find_tensor("blk.0.attn_k.weight")->dims, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f.find_tensor("blk.4.ffn_down.weight")->dims, (std::vector<int64_t>{172, 64}));
  EXPECT_EQ(f.find_tensor("output_norm.weight")->dims, (std::vector<int64_t>{64}));
  EXPECT_EQ(f.find_tensor("blk.5.attn_q.weight"), nullptr);
  for (const auto& t : f.tensors()) {
    EXPECT_NE(t.data, nullptr) << t.name;
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
  }
  WeightMatrix wk = f.matrix("blk.2.attn_k.weight", 32, 64);
  EXPECT_EQ(wk.type, WeightType::F32);
  EXPECT_EQ(wk.bytes(), 32u * 64 * 4);
  EXPECT_NE(f.vector_f32("output_norm.weight", 64), nullptr);
}

// ---- round trip through GgufWriter ------------------------------------------

TEST(GgufReader, RoundTripsEveryWriterMetadataType) {
  GgufWriter w;
  w.set_string("s", "hello \xE2\x96\x81world");
  w.set_string("empty", "");
  w.set_u32("u", 0xFFFFFFFFu);
  w.set_u32("zero", 0);
  w.set_f32("f", -1.5f);
  w.set_bool("yes", true);
  w.set_bool("no", false);
  w.set_strings("strs", {"a", "", "\xE2\x96\x81t3"});
  w.set_f32s("floats", {0.25f, -3.0f, 1e30f});
  w.set_i32s("ints", {-2147483647 - 1, 0, 7});
  const std::string path = temp_path("meta.gguf");
  w.write(path);

  GgufFile f(path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.get_string("s"), "hello \xE2\x96\x81world");
  EXPECT_EQ(f.get_string("empty"), "");
  EXPECT_EQ(f.get_int("u"), 0xFFFFFFFFll);
  EXPECT_EQ(f.find("u")->type, GgufType::U32);
  EXPECT_EQ(f.get_int("zero"), 0);
  EXPECT_EQ(f.get_float_or("f", 0.0), -1.5);
  EXPECT_TRUE(f.get_bool_or("yes", false));
  EXPECT_FALSE(f.get_bool_or("no", true));
  EXPECT_EQ(f.get_string_array("strs"), (std::vector<std::string>{"a", "", "\xE2\x96\x81t3"}));
  EXPECT_EQ(f.find("strs")->element_type, GgufType::STRING);
  EXPECT_EQ(f.get_float_array("floats"), (std::vector<double>{0.25, -3.0, double(1e30f)}));
  EXPECT_EQ(f.get_int_array("ints"), (std::vector<int64_t>{-2147483648ll, 0, 7}));
  EXPECT_EQ(f.find("ints")->element_type, GgufType::I32);
  // Fallbacks apply only to missing keys.
  EXPECT_EQ(f.get_int_or("missing", 42), 42);
  EXPECT_EQ(f.get_string_or("missing", "x"), "x");
  EXPECT_EQ(f.get_float_or("missing", 2.5), 2.5);
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(GgufReader, RoundTripsTensorsOfEveryType) {
  struct Case {
    std::string name;
    std::vector<int64_t> dims;
    GgmlType type;
    size_t bytes;
    WeightType weight;
  };
  // F32 first: 60 bytes, so the next tensor starts after 4 bytes of padding.
  const std::vector<Case> cases = {
      {"f32", {5, 3}, GgmlType::F32, 5 * 3 * 4, WeightType::F32},
      {"f16", {32, 3}, GgmlType::F16, 32 * 3 * 2, WeightType::F16},
      {"q8", {64, 2}, GgmlType::Q8_0, 2 * 2 * 34, WeightType::Q8_0},
      {"q4", {32, 5}, GgmlType::Q4_0, 5 * 18, WeightType::Q4_0},
      {"norm", {7}, GgmlType::F32, 7 * 4, WeightType::F32},
  };
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  for (size_t i = 0; i < cases.size(); ++i)
    w.add_tensor(cases[i].name, cases[i].dims, cases[i].type, pattern(cases[i].bytes, uint8_t(i * 31)));
  const std::string path = temp_path("tensors.gguf");
  w.write(path);

  GgufFile f(path);
  ASSERT_EQ(f.tensors().size(), cases.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const GgufTensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.name, c.name);
    EXPECT_EQ(t.dims, c.dims);
    EXPECT_EQ(t.ggml_type, uint32_t(c.type));
    EXPECT_EQ(t.offset, offset);
    ASSERT_EQ(t.bytes, c.bytes) << c.name;
    const auto expected = pattern(c.bytes, uint8_t(i * 31));
    EXPECT_EQ(std::memcmp(t.data, expected.data(), c.bytes), 0) << c.name;
    EXPECT_EQ(weight_type_from_ggml(t.ggml_type), c.weight);
    offset = (offset + c.bytes + 31) / 32 * 32;
  }
  EXPECT_EQ(f.tensors()[0].offset, 0u);
  EXPECT_EQ(f.tensors()[1].offset, 64u);

  WeightMatrix q8 = f.matrix("q8", 2, 64);
  EXPECT_EQ(q8.type, WeightType::Q8_0);
  EXPECT_EQ(q8.rows, 2);
  EXPECT_EQ(q8.cols, 64);
  EXPECT_EQ(q8.bytes(), 136u);
  EXPECT_EQ(q8.data, f.find_tensor("q8")->data);
  EXPECT_EQ(f.matrix("q4", 5, 32).row(1), f.find_tensor("q4")->data + 18);
  EXPECT_EQ(f.matrix("f16", 3, 32).type, WeightType::F16);
  const float* norm = f.vector_f32("norm", 7);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(norm) % alignof(float), 0u);
  EXPECT_EQ(std::memcmp(norm, pattern(28, uint8_t(4 * 31)).data(), 28), 0);
}

TEST(GgufReader, ReadsEveryScalarAndArrayType) {
  Raw r;
  r.header(0, 13);
  r.key("u8", GgufType::U8).put<uint8_t>(255);
  r.key("i8", GgufType::I8).put<int8_t>(-128);
  r.key("u16", GgufType::U16).put<uint16_t>(65535);
  r.key("i16", GgufType::I16).put<int16_t>(-32768);
  r.key("i32", GgufType::I32).put<int32_t>(-5);
  r.key("u64", GgufType::U64).put<uint64_t>(uint64_t(1) << 40);
  r.key("u64max", GgufType::U64).put<uint64_t>(std::numeric_limits<uint64_t>::max());
  r.key("i64", GgufType::I64).put<int64_t>(std::numeric_limits<int64_t>::min());
  r.key("f64", GgufType::F64).put<double>(0.1);
  r.key("bools", GgufType::ARRAY).u32(uint32_t(GgufType::BOOL)).u64(3);
  r.put<uint8_t>(1).put<uint8_t>(0).put<uint8_t>(2);
  r.key("u8s", GgufType::ARRAY).u32(uint32_t(GgufType::U8)).u64(2).put<uint8_t>(9).put<uint8_t>(200);
  r.key("f64s", GgufType::ARRAY).u32(uint32_t(GgufType::F64)).u64(1).put<double>(-2.5);
  r.key("none", GgufType::ARRAY).u32(uint32_t(GgufType::U32)).u64(0);
  const std::string path = temp_path("scalars.gguf");
  write_all(path, r.bytes);

  GgufFile f(path);
  EXPECT_EQ(f.get_int("u8"), 255);
  EXPECT_EQ(f.get_int("i8"), -128);
  EXPECT_EQ(f.get_int("u16"), 65535);
  EXPECT_EQ(f.get_int("i16"), -32768);
  EXPECT_EQ(f.get_int("i32"), -5);
  EXPECT_EQ(f.get_int("u64"), int64_t(1) << 40);
  EXPECT_EQ(f.get_int("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.get_float_or("f64", 0), 0.1);
  EXPECT_EQ(f.get_float_or("i32", 0), -5.0);
  EXPECT_EQ(f.get_int_array("bools"), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.get_int_array("u8s"), (std::vector<int64_t>{9, 200}));
  EXPECT_EQ(f.get_float_array("f64s"), (std::vector<double>{-2.5}));
  EXPECT_TRUE(f.get_int_array("none").empty());
  expect_error_containing([&] { (void)f.get_int("u64max"); }, "'u64max' is out of range");
}

// ---- malformed files --------------------------------------------------------

TEST(GgufReader, RejectsBadMagic) {
  expect_gguf_error("magic.gguf", Raw().u32(0x46554746).u32(3).u64(0).u64(0).bytes, "bad magic");
  expect_gguf_error("empty.gguf", "", "bad magic");
  expect_gguf_error("tiny.gguf", "GG", "bad magic");
}

TEST(GgufReader, RejectsUnsupportedVersion) {
  expect_gguf_error("v1.gguf", Raw().header(0, 0, 1).bytes, "unsupported GGUF version 1");
  expect_gguf_error("v4.gguf", Raw().header(0, 0, 4).bytes, "unsupported GGUF version 4");
  EXPECT_NO_THROW(GgufFile([] {
    const std::string p = temp_path("v2.gguf");
    write_all(p, Raw().header(0, 0, 2).bytes);
    return p;
  }()));
}

TEST(GgufReader, RejectsHugeStringLength) {
  Raw r;
  r.header(0, 1).u64(uint64_t(1) << 40).pad(64);
  expect_gguf_error("hugekey.gguf", r.bytes, "metadata key length 1099511627776 is implausible");
  Raw value;
  value.header(0, 1).key("k", GgufType::STRING).u64(std::numeric_limits<uint64_t>::max());
  expect_gguf_error("hugestr.gguf", value.bytes, "implausible");
  // Below the cap but past the end of the file.
  Raw past;
  past.header(0, 1).key("k", GgufType::STRING).u64(1000).str("short");
  expect_gguf_error("paststr.gguf", past.bytes, "truncated while reading metadata string");
}

TEST(GgufReader, RejectsHugeArrayCount) {
  Raw ints;
  ints.header(0, 1).key("a", GgufType::ARRAY).u32(uint32_t(GgufType::U32)).u64(uint64_t(1) << 60).u32(1);
  expect_gguf_error("hugearr.gguf", ints.bytes, "array 'a' claims 1152921504606846976 elements");
  Raw strs;
  strs.header(0, 1).key("t", GgufType::ARRAY).u32(uint32_t(GgufType::STRING)).u64(uint64_t(1) << 62).str("x");
  expect_gguf_error("hugestrs.gguf", strs.bytes, "array 't' claims 4611686018427387904 strings");
  Raw nested;
  nested.header(0, 1).key("n", GgufType::ARRAY).u32(uint32_t(GgufType::ARRAY)).u64(1);
  expect_gguf_error("nested.gguf", nested.bytes, "unsupported element type 9");
}

TEST(GgufReader, RejectsHugeCounts) {
  expect_gguf_error("hugetensors.gguf", Raw().header(uint64_t(1) << 40, 0).bytes, "tensor count 1099511627776");
  // Under the absolute cap, yet far more records than 24 bytes can hold: must
  // be refused before the tensor table is reserved.
  expect_gguf_error("manytensors.gguf", Raw().header(1000000, 0).bytes, "tensor count 1000000 is implausible");
  expect_gguf_error("hugekv.gguf", Raw().header(0, uint64_t(1) << 63).bytes, "metadata count");
  expect_gguf_error("manykv.gguf", Raw().header(0, 100000).u64(0).bytes, "metadata count 100000 is implausible");
}

TEST(GgufReader, RejectsUnknownMetadataType) {
  Raw r;
  r.header(0, 1).key("k", GgufType(13)).u64(0);
  expect_gguf_error("kvtype.gguf", r.bytes, "metadata 'k' has unknown type 13");
}

TEST(GgufReader, RejectsDuplicateMetadataKeys) {
  Raw r;
  r.header(0, 2).key("k", GgufType::U32).u32(1).key("k", GgufType::U32).u32(2);
  expect_gguf_error("dupkey.gguf", r.bytes, "duplicate metadata key 'k'");
}

TEST(GgufReader, RejectsTensorOffsetPastEnd) {
  Raw r;
  r.header(1, 0).tensor("w", {4}, uint32_t(GgmlType::F32), 1024).pad();
  r.bytes.append(16, '\0');
  expect_gguf_error("pastend.gguf", r.bytes, "tensor 'w' lies past the end of the file");
  // Offset so large that offset + data start would overflow 64 bits.
  Raw wrap;
  wrap.header(1, 0).tensor("w", {4}, uint32_t(GgmlType::F32), uint64_t(-32)).pad();
  wrap.bytes.append(16, '\0');
  expect_gguf_error("wrap.gguf", wrap.bytes, "tensor 'w' lies past the end of the file");
  // In bounds at its offset but longer than what remains.
  Raw longer;
  longer.header(1, 0).tensor("w", {64}, uint32_t(GgmlType::F32), 0).pad();
  longer.bytes.append(255, '\0');
  expect_gguf_error("short.gguf", longer.bytes, "tensor 'w' lies past the end of the file");
}

TEST(GgufReader, RejectsMisalignedOffset) {
  Raw r;
  r.header(1, 0).tensor("w", {4}, uint32_t(GgmlType::F32), 4).pad();
  r.bytes.append(64, '\0');
  expect_gguf_error("misaligned.gguf", r.bytes, "tensor 'w' offset 4 is not aligned");
}

TEST(GgufReader, RejectsBadAlignment) {
  auto file = [](uint32_t alignment) {
    Raw r;
    r.header(0, 1).key("general.alignment", GgufType::U32).u32(alignment);
    return r.bytes;
  };
  expect_gguf_error("align0.gguf", file(0), "general.alignment 0 is not a power of two");
  expect_gguf_error("align24.gguf", file(24), "general.alignment 24 is not a power of two");
  expect_gguf_error("align4.gguf", file(4), "general.alignment 4 is not a multiple of 8");
  const std::string ok = temp_path("align64.gguf");
  write_all(ok, file(64));
  EXPECT_EQ(GgufFile(ok).get_int("general.alignment"), 64);
}

TEST(GgufReader, RejectsBadTensorShapes) {
  Raw rank0;
  rank0.header(1, 0).str("w").u32(0).u32(0).u64(0).pad();
  expect_gguf_error("rank0.gguf", rank0.bytes, "tensor 'w' has rank 0");
  Raw rank5;
  rank5.header(1, 0).tensor("w", {1, 1, 1, 1, 1}, 0, 0);
  expect_gguf_error("rank5.gguf", rank5.bytes, "tensor 'w' has rank 5");
  Raw zero;
  zero.header(1, 0).tensor("w", {4, 0}, 0, 0);
  expect_gguf_error("dim0.gguf", zero.bytes, "tensor 'w' has an implausible dimension 0");
  // Each dimension is plausible; their product is not.
  Raw product;
  product.header(1, 0).tensor("w", {uint64_t(1) << 30, uint64_t(1) << 30}, 0, 0);
  expect_gguf_error("product.gguf", product.bytes, "more than 2^40 elements (1073741824 so far, then a dimension of 1073741824)");
  Raw q8;
  q8.header(1, 0).tensor("w", {48, 2}, uint32_t(GgmlType::Q8_0), 0).pad();
  q8.bytes.append(200, '\0');
  expect_gguf_error("q8row.gguf", q8.bytes, "row of 48 values is not a multiple of 32");
}

TEST(GgufReader, RejectsDuplicateTensorNames) {
  GgufWriter w;
  w.add_tensor("w", {4}, GgmlType::F32, pattern(16, 1));
  w.add_tensor("w", {4}, GgmlType::F32, pattern(16, 2));
  const std::string path = temp_path("duptensor.gguf");
  w.write(path);
  expect_error_containing([&] { GgufFile f(path); }, "duplicate tensor 'w'");
}

TEST(GgufReader, UnknownTensorTypeFailsOnlyWhenUsed) {
  GgufWriter w;
  w.add_tensor("iq2", {256, 2}, GgmlType(16), pattern(132, 3));  // IQ2_XXS: parsed, not readable
  w.add_tensor("f32", {4}, GgmlType::F32, pattern(16, 4));
  const std::string path = temp_path("iq2.gguf");
  w.write(path);
  GgufFile f(path);
  EXPECT_EQ(f.find_tensor("iq2")->ggml_type, 16u);
  EXPECT_EQ(f.find_tensor("iq2")->data, nullptr);  // no known size, so no bytes to point at
  EXPECT_FALSE(weight_type_from_ggml(16));
  EXPECT_NE(f.vector_f32("f32", 4), nullptr);
  const std::string message =
      "tensor 'iq2' has unsupported type IQ2_XXS (ggml type 16) (kvserve reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
      "Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)";
  expect_error_containing([&] { (void)f.matrix("iq2", 2, 256); }, message);
  expect_error_containing([&] { (void)f.matrix_tensor("iq2", 2, 256); }, message);
  expect_error_containing([&] { (void)f.vector_f32("iq2", 512); }, "tensor 'iq2' must be F32, not IQ2_XXS (ggml type 16)");
}

// The types converted at load: their byte sizes place every tensor, and the
// matrix view refuses them (Model::load converts them).
TEST(GgufReader, SizesTensorsOfConvertedTypes) {
  struct Case {
    GgmlType type;
    int64_t cols;
    size_t row_bytes;
  };
  const Case cases[] = {
      {GgmlType::BF16, 40, 80},       {GgmlType::Q4_1, 64, 2 * 20},  {GgmlType::Q5_0, 64, 2 * 22},
      {GgmlType::Q5_1, 64, 2 * 24},   {GgmlType::Q2_K, 512, 2 * 84}, {GgmlType::Q3_K, 256, 110},
      {GgmlType::Q4_K, 512, 2 * 144}, {GgmlType::Q5_K, 256, 176},    {GgmlType::Q6_K, 256, 210},
  };
  GgufWriter w;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    w.add_tensor(ggml_type_name(uint32_t(c.type)), {c.cols, 3}, c.type, pattern(3 * c.row_bytes, uint8_t(i)));
  }
  const std::string path = temp_path("converted_types.gguf");
  w.write(path);
  GgufFile f(path);
  uint64_t offset = 0;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const std::string name = ggml_type_name(uint32_t(c.type));
    const GgufTensorInfo& t = f.matrix_tensor(name, 3, c.cols);
    EXPECT_EQ(t.bytes, 3 * c.row_bytes) << name;
    EXPECT_EQ(t.offset, offset) << name;
    EXPECT_EQ(std::memcmp(t.data, pattern(3 * c.row_bytes, uint8_t(i)).data(), 3 * c.row_bytes), 0) << name;
    offset = (offset + t.bytes + 31) / 32 * 32;
    expect_error_containing([&] { (void)f.matrix(name, 3, c.cols); },
                            "tensor '" + name + "' is " + ggml_type_label(uint32_t(c.type)) +
                                ", which is converted at load");
  }
}

TEST(GgufReader, RejectsTruncatedKQuantTensor) {
  // Two Q4_K rows of 256 values: 288 bytes; the file ends 1 byte short.
  Raw r;
  r.header(1, 0).tensor("w", {256, 2}, uint32_t(GgmlType::Q4_K), 0).pad();
  r.bytes.append(287, '\0');
  expect_gguf_error("q4k_short.gguf", r.bytes, "tensor 'w' lies past the end of the file");
  Raw exact;
  exact.header(1, 0).tensor("w", {256, 2}, uint32_t(GgmlType::Q4_K), 0).pad();
  exact.bytes.append(288, '\0');
  const std::string path = temp_path("q4k_exact.gguf");
  write_all(path, exact.bytes);
  EXPECT_EQ(GgufFile(path).find_tensor("w")->bytes, 288u);
  // Q6_K's 210-byte super-blocks: three rows need 630 bytes.
  Raw q6;
  q6.header(1, 0).tensor("w", {256, 3}, uint32_t(GgmlType::Q6_K), 0).pad();
  q6.bytes.append(629, '\0');
  expect_gguf_error("q6k_short.gguf", q6.bytes, "tensor 'w' lies past the end of the file");
}

TEST(GgufReader, RejectsKQuantRowsNotAMultipleOf256) {
  Raw r;
  r.header(1, 0).tensor("w", {288, 2}, uint32_t(GgmlType::Q4_K), 0).pad();
  r.bytes.append(1024, '\0');
  expect_gguf_error("q4k_row.gguf", r.bytes,
                    "tensor 'w' is Q4_K (ggml type 12) but its row of 288 values is not a multiple of 256 (a K-quant "
                    "super-block)");
  Raw q51;
  q51.header(1, 0).tensor("w", {48, 2}, uint32_t(GgmlType::Q5_1), 0).pad();
  q51.bytes.append(1024, '\0');
  expect_gguf_error("q51_row.gguf", q51.bytes, "row of 48 values is not a multiple of 32");
}

TEST(GgufReader, MatrixChecksShapeAndName) {
  GgufWriter w;
  w.add_tensor("m", {4, 2}, GgmlType::F32, pattern(32, 5));
  w.add_tensor("h", {32}, GgmlType::F16, pattern(64, 6));
  const std::string path = temp_path("shape.gguf");
  w.write(path);
  GgufFile f(path);
  EXPECT_EQ(f.matrix("m", 2, 4).rows, 2);
  expect_error_containing([&] { (void)f.matrix("m", 3, 4); }, "tensor 'm' has shape [4, 2], expected [4, 3]");
  expect_error_containing([&] { (void)f.matrix("m", 4, 2); }, "has shape [4, 2], expected [2, 4]: it appears transposed");
  try {
    (void)f.matrix("m", 3, 4);
    ADD_FAILURE() << "a wrong shape was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("transposed"), std::string::npos) << e.what();
  }
  expect_error_containing([&] { (void)f.matrix("h", 1, 32); }, "tensor 'h' has shape [32]");
  expect_error_containing([&] { (void)f.matrix("nope", 1, 1); }, "missing tensor 'nope'");
  expect_error_containing([&] { (void)f.vector_f32("m", 8); }, "tensor 'm' has shape [4, 2], expected [8]");
  expect_error_containing([&] { (void)f.vector_f32("h", 32); }, "tensor 'h' must be F32");
}

TEST(GgufReader, TypedGettersNameTheMismatch) {
  GgufWriter w;
  w.set_string("name", "x");
  w.set_u32("n", 3);
  w.set_bool("b", true);
  w.set_f32s("fs", {1.0f});
  const std::string path = temp_path("types.gguf");
  w.write(path);
  GgufFile f(path);
  expect_error_containing([&] { (void)f.get_int("name"); }, "metadata 'name' is a string, expected an integer");
  expect_error_containing([&] { (void)f.get_int_or("name", 0); }, "is a string, expected an integer");
  expect_error_containing([&] { (void)f.get_int("b"); }, "'b' is a bool, expected an integer");
  expect_error_containing([&] { (void)f.get_string("n"); }, "metadata 'n' is a integer, expected a string");
  expect_error_containing([&] { (void)f.get_bool_or("n", false); }, "expected a bool");
  expect_error_containing([&] { (void)f.get_float_or("name", 0); }, "expected a number");
  expect_error_containing([&] { (void)f.get_string_array("fs"); }, "'fs' is not an array of strings");
  expect_error_containing([&] { (void)f.get_int_array("fs"); }, "'fs' is not an array of integers");
  expect_error_containing([&] { (void)f.get_float_array("n"); }, "'n' is not an array of floats");
  expect_error_containing([&] { (void)f.get_int("missing"); }, "missing metadata 'missing'");
  // A GGUF alignment key of the wrong type is itself an error, at open time.
  Raw r;
  r.header(0, 1).key("general.alignment", GgufType::STRING).str("32");
  expect_gguf_error("alignstr.gguf", r.bytes, "'general.alignment' is a string");
}

// Every strict prefix of a valid file is truncated somewhere: in the header,
// the metadata, the tensor table, the padding or the last tensor's data.
TEST(GgufReader, EveryPrefixOfASmallFileThrows) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 1);
  w.set_strings("tokenizer.ggml.tokens", {"a", "bc"});
  w.set_f32s("tokenizer.ggml.scores", {0.0f, -1.0f});
  w.add_tensor("norm", {6}, GgmlType::F32, pattern(24, 7));
  w.add_tensor("q", {32, 1}, GgmlType::Q8_0, pattern(34, 8));
  const std::string full_path = temp_path("prefix_full.gguf");
  w.write(full_path);
  const std::string full = read_all(full_path);
  ASSERT_GT(full.size(), 200u);
  ASSERT_EQ(GgufFile(full_path).tensors().size(), 2u);

  const std::string path = temp_path("prefix.gguf");
  size_t thrown = 0;
  for (size_t n = 0; n < full.size(); ++n) {
    write_all(path, full.substr(0, n));
    try {
      GgufFile f(path);
      ADD_FAILURE() << "prefix of " << n << " of " << full.size() << " bytes opened";
    } catch (const Error&) {
      ++thrown;
    }
  }
  EXPECT_EQ(thrown, full.size());
}

// Hostile bytes in the header region of a real-shaped checkpoint: each
// mutated file loads or throws kvserve::Error, never anything else.
TEST(GgufReader, RandomHeaderCorruptionLoadsOrThrowsError) {
  SyntheticModelOptions o;
  o.dim = 64;
  o.hidden_dim = 128;
  o.n_layers = 2;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.vocab_size = 64;
  o.seq_len = 128;
  o.weights = GgmlType::Q8_0;
  const std::string base_path = temp_path("corrupt_base.gguf");
  write_synthetic_gguf(base_path, o);
  const std::string base = read_all(base_path);
  ASSERT_NO_THROW(Model::load(base_path));
  ASSERT_GT(base.size(), 50000u);
  const size_t region = std::min<size_t>(base.size(), 4096);

  // Values that tend to hit edge cases when they land on a count or offset.
  const uint64_t interesting[] = {0, 1, 2, 31, 32, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
                                  uint64_t(1) << 32, uint64_t(1) << 40, uint64_t(1) << 63, ~uint64_t(0)};
  std::mt19937_64 rng(20240531);
  const std::string path = temp_path("corrupt.gguf");
  int loaded = 0, rejected = 0;
  constexpr int kIterations = 3000;
  for (int it = 0; it < kIterations; ++it) {
    std::string bytes = base;
    const int mutations = 1 + int(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      const size_t at = size_t(rng() % region);
      switch (rng() % 4) {
        case 0: bytes[at] = char(uint8_t(bytes[at]) ^ uint8_t(1u << (rng() % 8))); break;
        case 1: bytes[at] = char(rng() & 0xFF); break;
        case 2: {
          const uint64_t v = interesting[rng() % std::size(interesting)];
          std::memcpy(&bytes[std::min(at, region - 8)], &v, 8);
          break;
        }
        default: {
          const uint32_t v = uint32_t(interesting[rng() % std::size(interesting)]);
          std::memcpy(&bytes[std::min(at, region - 4)], &v, 4);
          break;
        }
      }
    }
    write_all(path, bytes);
    try {
      auto model = Model::load(path);
      // What loaded must be usable: touch the ends of every matrix.
      const Weights& w = model->weights();
      volatile uint8_t sink = 0;
      auto touch = [&](const WeightMatrix& m) {
        const auto* p = static_cast<const uint8_t*>(m.data);
        sink = sink + p[0] + p[m.bytes() - 1];
      };
      touch(w.token_embedding);
      touch(w.classifier);
      for (const auto& l : w.layers) {
        for (const WeightMatrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up}) touch(*m);
      }
      ++loaded;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << it << ": non-kvserve exception: " << e.what();
    }
  }
  std::cout << "[ corrupt  ] " << loaded << " loaded, " << rejected << " rejected of " << kIterations << "\n";
  EXPECT_EQ(loaded + rejected, kIterations);
  EXPECT_GT(loaded, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace kvserve
