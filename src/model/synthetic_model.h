// Random-weight Llama checkpoints of a realistic shape, for speed and memory
// work only (never for quality claims).
#pragma once

#include <cstdint>
#include <string>

#include "model/ggml_dequantize.h"
#include "model/rope_scaling.h"

namespace kvserve {

struct SyntheticModelOptions {
  int32_t dim = 1536;
  int32_t hidden_dim = 4096;
  int32_t n_layers = 12;
  int32_t n_heads = 24;
  int32_t n_kv_heads = 8;
  int32_t vocab_size = 32000;
  int32_t seq_len = 16384;             // context length written to the file
  GgmlType weights = GgmlType::Q8_0;  // the matrices' type (norms are F32)
  // Write the matrices as F32 holding the values `weights` decodes to (each
  // row encoded, then decoded): the same model as with false, up to F32's
  // exactness, for comparing a converted load with plain floats.
  bool write_dequantized = false;
  uint64_t seed = 1;
  // Written as llama.cpp's converter writes it: the type and factor (and
  // original context) for linear and yarn, attn_factor, and freq_factors as
  // rope_freqs.weight.
  RopeScaling rope_scaling;
};

// Writes a GGUF `llama` checkpoint with uniform random weights scaled by
// 1/sqrt(fan_in), unit norm weights, and a placeholder vocabulary
// (so tokenize/generate work end to end). Throws kvserve::Error on bad shapes.
void write_synthetic_gguf(const std::string& path, const SyntheticModelOptions& options);

}  // namespace kvserve
