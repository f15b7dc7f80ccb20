// How a checkpoint stretches RoPE past the context it was first trained on:
// linear interpolation, YaRN, and per-frequency factors (Llama 3.1 and 3.2
// ship theirs as the tensor rope_freqs.weight). Every RoPE in kvserve turns
// pair i of a head by pos * f_i, the f_i from rope_frequencies(); YaRN also
// scales attention scores (rope_score_scale). The formulas are llama.cpp's
// (ggml's rope_yarn), so a GGUF file runs as it does there.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

enum class RopeScalingType { None, Linear, Yarn };

const char* rope_scaling_name(RopeScalingType t);  // "none", "linear", "yarn"
std::optional<RopeScalingType> parse_rope_scaling_type(std::string_view name);

struct RopeScaling {
  RopeScalingType type = RopeScalingType::None;
  // Context stretch: Linear and YaRN interpolate frequencies by 1 / factor.
  float factor = 1.0f;
  // YaRN: the context the model was trained on before stretching, which
  // places its ramp (0: the model's context length).
  int32_t original_context = 0;
  float ext_factor = 1.0f;   // YaRN: weight of the unstretched angle where the ramp keeps it
  // Magnitude factor on cos and sin (llama.rope.scaling.attn_factor), any
  // type; YaRN multiplies in its own log correction (rope_score_scale).
  float attn_factor = 1.0f;
  float beta_fast = 32.0f;   // YaRN: pairs turning more than this often over the original context keep their angle
  float beta_slow = 1.0f;    // ... and pairs turning less than this often are fully interpolated
  // Per pair: divides the pair's frequency (rope_freqs.weight); empty: none.
  std::vector<float> freq_factors;

  // Whether any of the above changes a rotation or a score.
  bool scales() const { return type != RopeScalingType::None || !freq_factors.empty() || attn_factor != 1.0f; }
  // E.g. "none", "linear x4", "yarn x4 (original context 4096)", "freq factors (64)".
  std::string describe() const;
  // Throws kvserve::Error naming the first bad field. head_dim: of the model.
  void validate(const std::string& source, int head_dim) const;
};

// Pair i's angle per position, head_dim / 2 of them. Unscaled: theta^(-2i /
// head_dim), with the float expression rope() always used.
std::vector<float> rope_frequencies(int head_dim, float theta, const RopeScaling& s, int32_t context_length);

// The factor the magnitude correction puts on every attention score:
// llama.cpp scales cos and sin of q and k by mscale, so q.k by mscale^2.
// mscale = attn_factor, times YaRN's 1 + 0.1 ln(factor) where it
// extrapolates (ext_factor > 0) and stretches (factor > 1): llama.cpp's rule
// since its PR #17945; before it, a factor under 1 shrank the scores.
float rope_score_scale(const RopeScaling& s);

// Llama 3.1's frequency divisors (its HF config's rope_type "llama3"), as
// llama.cpp's converter writes them to rope_freqs.weight: 1 for pairs whose
// wavelength is under original_context / high_freq_factor, factor for those
// over original_context / low_freq_factor, and a smooth blend between.
std::vector<float> llama3_freq_factors(int head_dim, float theta, float factor, float low_freq_factor,
                                       float high_freq_factor, int32_t original_context);

}  // namespace kvserve
