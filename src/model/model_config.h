// The shape of a Llama-family transformer, whichever file it came from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/rope_scaling.h"

namespace kvserve {

struct ModelConfig {
  std::string architecture = "llama";
  int32_t dim = 0;          // embedding width
  int32_t hidden_dim = 0;   // SwiGLU feed-forward width
  int32_t n_layers = 0;
  int32_t n_heads = 0;      // query heads
  int32_t n_kv_heads = 0;   // key/value heads (GQA when < n_heads)
  int32_t vocab_size = 0;
  int32_t seq_len = 0;      // trained context length, in tokens
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;  // none unless the checkpoint stretches its context
  float norm_eps = 1e-5f;

  int32_t head_dim() const { return dim / n_heads; }
  int32_t kv_dim() const { return head_dim() * n_kv_heads; }
  int32_t gqa_group() const { return n_heads / n_kv_heads; }  // query heads per KV head
  // RoPE's angle per position for each pair of a head, scaling applied.
  std::vector<float> rope_frequencies() const {
    return kvserve::rope_frequencies(head_dim(), rope_theta, rope_scaling, seq_len);
  }

  // Throws kvserve::Error naming the first inconsistent field.
  void validate(const std::string& source) const;
};

}  // namespace kvserve
