#include "model/rope_scaling.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {

const char* rope_scaling_name(RopeScalingType t) {
  switch (t) {
    case RopeScalingType::None: return "none";
    case RopeScalingType::Linear: return "linear";
    case RopeScalingType::Yarn: return "yarn";
  }
  return "?";
}

std::optional<RopeScalingType> parse_rope_scaling_type(std::string_view name) {
  for (RopeScalingType t : {RopeScalingType::None, RopeScalingType::Linear, RopeScalingType::Yarn})
    if (name == rope_scaling_name(t)) return t;
  return std::nullopt;
}

std::string RopeScaling::describe() const {
  std::vector<std::string> parts;
  if (type != RopeScalingType::None) parts.push_back(fmt::format("{} x{}", rope_scaling_name(type), factor));
  if (type == RopeScalingType::Yarn && original_context > 0)
    parts.back() += fmt::format(" (original context {})", original_context);
  if (attn_factor != 1.0f) parts.push_back(fmt::format("attn factor {}", attn_factor));
  if (!freq_factors.empty()) parts.push_back(fmt::format("freq factors ({})", freq_factors.size()));
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ", "));
}

void RopeScaling::validate(const std::string& source, int head_dim) const {
  auto finite_positive = [&](const char* name, float v) {
    if (!(v > 0.0f) || !std::isfinite(v)) fail("{}: RoPE scaling {} = {} must be positive and finite", source, name, v);
  };
  if (type != RopeScalingType::None) finite_positive("factor", factor);
  finite_positive("attn_factor", attn_factor);
  if (type == RopeScalingType::Yarn) {
    finite_positive("beta_fast", beta_fast);
    finite_positive("beta_slow", beta_slow);
    if (!(ext_factor >= 0.0f && ext_factor <= 1.0f))
      fail("{}: RoPE scaling ext_factor = {} is out of range (0..1)", source, ext_factor);
    if (original_context < 0) fail("{}: RoPE scaling original context {} is negative", source, original_context);
  }
  if (freq_factors.empty()) return;
  if (freq_factors.size() != size_t(head_dim / 2))
    fail("{}: rope_freqs.weight has {} values; the head dimension {} has {} pairs", source, freq_factors.size(),
         head_dim, head_dim / 2);
  for (size_t i = 0; i < freq_factors.size(); ++i)
    if (!(freq_factors[i] > 0.0f) || !std::isfinite(freq_factors[i]))
      fail("{}: rope_freqs.weight[{}] = {} must be positive and finite", source, i, freq_factors[i]);
}

std::vector<float> rope_frequencies(int head_dim, float theta, const RopeScaling& s, int32_t context_length) {
  const int pairs = head_dim / 2;
  std::vector<float> f = unscaled_rope_frequencies(head_dim, theta);
  if (!s.freq_factors.empty())
    for (int i = 0; i < pairs; ++i) f[size_t(i)] /= s.freq_factors[size_t(i)];
  if (s.type == RopeScalingType::None) return f;
  const float interpolate = 1.0f / s.factor;  // llama.cpp's freq_scale
  if (s.type == RopeScalingType::Linear) {
    for (float& v : f) v *= interpolate;
    return f;
  }
  // YaRN: pairs below `low` turn often enough over the original context to
  // keep their angle (extrapolate), pairs above `high` are interpolated, and
  // a linear ramp blends the pairs between. The bounds are the pair indices
  // where a pair turns beta_fast and beta_slow times over that context.
  const float original = float(s.original_context > 0 ? s.original_context : context_length);
  auto pair_turning = [&](float turns) {
    return float(head_dim) * std::log(original / (turns * 2.0f * float(M_PI))) / (2.0f * std::log(theta));
  };
  const float low = std::max(0.0f, std::floor(pair_turning(s.beta_fast)));
  const float high = std::min(float(head_dim - 1), std::ceil(pair_turning(s.beta_slow)));
  for (int i = 0; i < pairs; ++i) {
    const float y = (float(i) - low) / std::max(0.001f, high - low);
    const float mix = (1.0f - std::min(1.0f, std::max(0.0f, y))) * s.ext_factor;
    f[size_t(i)] = f[size_t(i)] * interpolate * (1.0f - mix) + f[size_t(i)] * mix;
  }
  return f;
}

float rope_score_scale(const RopeScaling& s) {
  float mscale = s.attn_factor;
  if (s.type == RopeScalingType::Yarn && s.ext_factor != 0.0f && s.factor > 1.0f)
    mscale *= 1.0f + 0.1f * std::log(s.factor);
  return mscale * mscale;
}

std::vector<float> llama3_freq_factors(int head_dim, float theta, float factor, float low_freq_factor,
                                       float high_freq_factor, int32_t original_context) {
  const double low_wavelength = double(original_context) / low_freq_factor;
  const double high_wavelength = double(original_context) / high_freq_factor;
  std::vector<float> out;
  for (int i = 0; i < head_dim / 2; ++i) {
    const double wavelength = 2.0 * M_PI / double(rope_frequency(theta, i, head_dim));
    if (wavelength < high_wavelength) {
      out.push_back(1.0f);
    } else if (wavelength > low_wavelength) {
      out.push_back(factor);
    } else {
      const double smooth = (double(original_context) / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
      out.push_back(float(1.0 / ((1.0 - smooth) / factor + smooth)));
    }
  }
  return out;
}

}  // namespace kvserve
