#include "model/model_config.h"

#include <cmath>

#include "util/error.h"

namespace kvserve {

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](const char* name, int64_t v, int64_t max) {
    if (v <= 0 || v > max) fail("{}: {} = {} is out of range (1..{})", source, name, v, max);
  };
  positive("dim", dim, 1 << 16);
  positive("hidden_dim", hidden_dim, 1 << 18);
  positive("n_layers", n_layers, 1024);
  positive("n_heads", n_heads, 1024);
  positive("n_kv_heads", n_kv_heads, 1024);
  positive("vocab_size", vocab_size, 1 << 22);
  positive("seq_len", seq_len, 1 << 24);
  if (dim % n_heads != 0) fail("{}: dim {} is not a multiple of n_heads {}", source, dim, n_heads);
  if (n_heads % n_kv_heads != 0)
    fail("{}: n_heads {} is not a multiple of n_kv_heads {}", source, n_heads, n_kv_heads);
  if (head_dim() % 2 != 0) fail("{}: head dimension {} is odd (RoPE needs pairs)", source, head_dim());
  // Infinity passes "> 0" but turns every norm into zeros (a uniform output).
  if (!(norm_eps > 0.0f) || !std::isfinite(norm_eps) || !(rope_theta > 0.0f) || !std::isfinite(rope_theta))
    fail("{}: norm_eps ({}) and rope_theta ({}) must be positive and finite", source, norm_eps, rope_theta);
  rope_scaling.validate(source, head_dim());
}

}  // namespace kvserve
