#include "model/synthetic_model.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "model/ggml_quantize.h"
#include "model/gguf_writer.h"
#include "model/model_config.h"
#include "util/error.h"

namespace kvserve {
namespace {

// A (rows, cols) matrix of uniform values in +-sqrt(3/cols) (unit variance
// activations stay unit variance), encoded row by row in type t; with
// dequantized, as F32 after a round trip through t.
std::vector<uint8_t> random_matrix(std::mt19937& rng, GgmlType t, bool dequantized, int64_t rows, int64_t cols) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float scale = std::sqrt(3.0f / float(cols));
  const GgmlBlock block = ggml_block(uint32_t(t));
  std::vector<uint8_t> out;
  out.reserve(size_t(rows) * size_t(dequantized ? cols * 4 : cols / block.values * block.bytes));
  std::vector<float> row(static_cast<size_t>(cols));
  std::vector<uint8_t> encoded;
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = u(rng) * scale;
    if (!dequantized) {
      quantize_ggml_row(t, row.data(), cols, out);
      continue;
    }
    encoded.clear();
    quantize_ggml_row(t, row.data(), cols, encoded);
    dequantize_ggml_row(t, encoded.data(), cols, row.data());
    quantize_ggml_row(GgmlType::F32, row.data(), cols, out);
  }
  return out;
}

std::vector<uint8_t> ones(int64_t n) {
  std::vector<uint8_t> out;
  quantize_ggml_row(GgmlType::F32, std::vector<float>(size_t(n), 1.0f).data(), n, out);
  return out;
}

}  // namespace

void write_synthetic_gguf(const std::string& path, const SyntheticModelOptions& o) {
  ModelConfig c;
  c.dim = o.dim;
  c.hidden_dim = o.hidden_dim;
  c.n_layers = o.n_layers;
  c.n_heads = o.n_heads;
  c.n_kv_heads = o.n_kv_heads;
  c.vocab_size = o.vocab_size;
  c.seq_len = o.seq_len;
  c.rope_scaling = o.rope_scaling;
  c.validate("synth");
  const int64_t block = ggml_block(uint32_t(o.weights)).values;
  if (block == 0) fail("synth: weights of {} cannot be written", ggml_type_label(uint32_t(o.weights)));
  // Rows of every matrix are dim or hidden_dim (attn_output's n_heads *
  // head_dim is dim) values long.
  if (c.dim % block != 0 || c.hidden_dim % block != 0)
    fail("synth: --dim and --ffn must be multiples of {} for {} weights", block,
         ggml_type_name(uint32_t(o.weights)));
  if (c.vocab_size < 4) fail("synth: --vocab must be at least 4");

  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", "kvserve-synthetic");
  w.set_u32("llama.context_length", uint32_t(c.seq_len));
  w.set_u32("llama.embedding_length", uint32_t(c.dim));
  w.set_u32("llama.feed_forward_length", uint32_t(c.hidden_dim));
  w.set_u32("llama.block_count", uint32_t(c.n_layers));
  w.set_u32("llama.attention.head_count", uint32_t(c.n_heads));
  w.set_u32("llama.attention.head_count_kv", uint32_t(c.n_kv_heads));
  w.set_u32("llama.rope.dimension_count", uint32_t(c.head_dim()));
  w.set_f32("llama.rope.freq_base", 10000.0f);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  const RopeScaling& rs = o.rope_scaling;
  if (rs.type != RopeScalingType::None) {
    w.set_string("llama.rope.scaling.type", rope_scaling_name(rs.type));
    w.set_f32("llama.rope.scaling.factor", rs.factor);
  }
  if (rs.type == RopeScalingType::Yarn) {
    if (rs.original_context > 0) w.set_u32("llama.rope.scaling.original_context_length", uint32_t(rs.original_context));
    const RopeScaling defaults;
    if (rs.ext_factor != defaults.ext_factor || rs.beta_fast != defaults.beta_fast || rs.beta_slow != defaults.beta_slow)
      fail("synth: YaRN's ext_factor and betas have no key a llama GGUF reads");
  }
  if (rs.attn_factor != 1.0f) w.set_f32("llama.rope.scaling.attn_factor", rs.attn_factor);

  // Placeholder vocabulary: the special tokens, then pieces "▁t<i>".
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int32_t i = 3; i < c.vocab_size; ++i) {
    tokens.push_back("\xE2\x96\x81t" + std::to_string(i));
    scores.push_back(-float(i));
    types.push_back(1);
  }
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_f32s("tokenizer.ggml.scores", scores);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);

  std::mt19937 rng(uint32_t(o.seed));
  const GgmlType gt = o.write_dequantized ? GgmlType::F32 : o.weights;
  auto random = [&](int64_t rows, int64_t cols) {
    return random_matrix(rng, o.weights, o.write_dequantized, rows, cols);
  };
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim(), kv = c.kv_dim(), hid = c.hidden_dim;
  w.add_tensor("token_embd.weight", {dim, c.vocab_size}, gt, random(c.vocab_size, dim));
  w.add_tensor("output_norm.weight", {dim}, GgmlType::F32, ones(dim));
  w.add_tensor("output.weight", {dim, c.vocab_size}, gt, random(c.vocab_size, dim));
  if (!rs.freq_factors.empty()) {
    std::vector<uint8_t> bytes(rs.freq_factors.size() * sizeof(float));
    std::memcpy(bytes.data(), rs.freq_factors.data(), bytes.size());
    w.add_tensor("rope_freqs.weight", {int64_t(rs.freq_factors.size())}, GgmlType::F32, std::move(bytes));
  }
  for (int32_t l = 0; l < c.n_layers; ++l) {
    auto name = [&](const char* what) { return "blk." + std::to_string(l) + "." + what + ".weight"; };
    w.add_tensor(name("attn_norm"), {dim}, GgmlType::F32, ones(dim));
    w.add_tensor(name("attn_q"), {dim, q_dim}, gt, random(q_dim, dim));
    w.add_tensor(name("attn_k"), {dim, kv}, gt, random(kv, dim));
    w.add_tensor(name("attn_v"), {dim, kv}, gt, random(kv, dim));
    w.add_tensor(name("attn_output"), {q_dim, dim}, gt, random(dim, q_dim));
    w.add_tensor(name("ffn_norm"), {dim}, GgmlType::F32, ones(dim));
    w.add_tensor(name("ffn_gate"), {dim, hid}, gt, random(hid, dim));
    w.add_tensor(name("ffn_down"), {hid, dim}, gt, random(dim, hid));
    w.add_tensor(name("ffn_up"), {dim, hid}, gt, random(hid, dim));
  }
  w.write(path);
}

}  // namespace kvserve
