// Elementwise and reduction kernels of the transformer, each with a scalar
// reference (suffix _reference) that tests compare against.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace kvserve {

// out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i], for n values. out may alias x.
void rmsnorm(float* out, const float* x, const float* weight, int64_t n, float eps);
void rmsnorm_reference(float* out, const float* x, const float* weight, int64_t n, float eps);

// In-place softmax over n values.
void softmax(float* x, int64_t n);
// softmax without the division: x_i := exp(x_i - max x), in [0, 1]; returns
// their sum. Attention divides its n_q outputs once instead of every weight.
// max_out, when given, receives max x (its -inf for an all -inf row).
float exp_shifted(float* x, int64_t n, float* max_out = nullptr);
void softmax_reference(float* x, int64_t n);

// SwiGLU: gate[i] = silu(gate[i]) * up[i], for n values.
void silu_mul(float* gate, const float* up, int64_t n);
void silu_mul_reference(float* gate, const float* up, int64_t n);

// Rotary embedding on interleaved pairs (x[2i], x[2i+1]) of each head, as in
// Llama / llama2.c: pair i turns by angle pos * freqs[i] (head_dim / 2 of
// them; rope_frequencies() in model/rope_scaling.h applies a checkpoint's
// RoPE scaling). x: (n_heads, head_dim) floats, rotated in place.
void rope(float* x, int n_heads, int head_dim, int pos, const float* freqs);
// Unscaled: freqs[i] = rope_frequency(theta, i, head_dim).
void rope(float* x, int n_heads, int head_dim, int pos, float theta);
// theta^(-2 pair / head_dim), in the float expression llama2.c uses.
inline float rope_frequency(float theta, int pair, int head_dim) {
  return 1.0f / std::pow(theta, float(2 * pair) / float(head_dim));
}
// All head_dim / 2 of them.
std::vector<float> unscaled_rope_frequencies(int head_dim, float theta);

// Dot product of n floats.
float dot(const float* a, const float* b, int64_t n);
float dot_reference(const float* a, const float* b, int64_t n);

// y[i] += a * x[i] for n floats.
void axpy(float a, const float* x, float* y, int64_t n);

}  // namespace kvserve
