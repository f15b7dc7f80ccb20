// Fixture paths, whole-file helpers and error checks shared by the tests.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "model/model_config.h"
#include "util/error.h"

namespace kvserve::testing_files {

inline const std::string kStoriesBin = KVSERVE_SOURCE_DIR "/models/stories260K.bin";
inline const std::string kStoriesGguf = KVSERVE_SOURCE_DIR "/models/stories260K.gguf";
inline const std::string kTok512 = KVSERVE_SOURCE_DIR "/models/tok512.bin";
inline const std::string kTinyStories = KVSERVE_SHARED_DIR "/data/tinystories_train_head.txt";

// The whole file as bytes; fails the test when it cannot be read.
inline std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out) << "cannot write " << path;
}

// Runs f and expects a kvserve::Error whose message contains needle.
template <class F>
void expect_error_containing(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error, expected '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

}  // namespace kvserve::testing_files

namespace kvserve::testing_shapes {

// The shape of stories260K (dim 64, 8 query heads over 4 KV heads of dim 8,
// 512-token context) with n_layers layers: what cache-level tests size their
// caches by, with no weights behind it.
inline ModelConfig stories_shape(int32_t n_layers = 5) {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = n_layers;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 512;
  return c;
}

}  // namespace kvserve::testing_shapes
