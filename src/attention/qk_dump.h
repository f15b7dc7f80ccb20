// Real queries, keys and values captured from a model (kvserve bench
// --dump-qk), per (layer, head), so attention-level experiments run on real
// statistics without the model.
//
// File layout (little-endian):
//   magic      8 bytes "KVQKDUMP"
//   version    u32 = 2 (1 is read too: no rope_freqs, RoPE unscaled)
//   n_layers, n_heads, n_kv_heads, head_dim, chunk   5 × i32
//   rope_theta f32  the model's RoPE base (interleaved pairs, as rope())
//   n_tokens   i64  tokens per head
//   rope_freqs f32 (head_dim / 2)  RoPE's angle per position of each pair,
//                   the model's scaling applied (version 2)
//   q          f32 (n_layers, n_heads, n_tokens, head_dim)     after RoPE (and
//                                                               YaRN's score factor)
//   k          f32 (n_layers, n_kv_heads, n_tokens, head_dim)  after RoPE
//   v          f32 (n_layers, n_kv_heads, n_tokens, head_dim)
// Tokens come in chunks of `chunk` run as separate sequences: token t sat at
// position t % chunk (its RoPE angle) and attended to its chunk only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvserve {

struct QkDump {
  int32_t n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int32_t chunk = 0;     // tokens per captured sequence
  float rope_theta = 10000.0f;
  std::vector<float> rope_freqs;  // (head_dim / 2); empty when written: unscaled from rope_theta
  int64_t n_tokens = 0;  // tokens per head
  std::vector<float> q;  // (n_layers, n_heads, n_tokens, head_dim)
  std::vector<float> k;  // (n_layers, n_kv_heads, n_tokens, head_dim)
  std::vector<float> v;  // (n_layers, n_kv_heads, n_tokens, head_dim)

  // Allocates q, k, v (zeroed) for the shape fields.
  void allocate();
  // rope_freqs, or unscaled RoPE of rope_theta where none were given.
  std::vector<float> frequencies() const;
  // (n_tokens, head_dim) rows of one head. REQUIRES: indices in range.
  const float* queries(int layer, int head) const { return q.data() + offset(layer, head, n_heads); }
  const float* keys(int layer, int kv_head) const { return k.data() + offset(layer, kv_head, n_kv_heads); }
  const float* values(int layer, int kv_head) const { return v.data() + offset(layer, kv_head, n_kv_heads); }
  float* queries(int layer, int head) { return q.data() + offset(layer, head, n_heads); }
  float* keys(int layer, int kv_head) { return k.data() + offset(layer, kv_head, n_kv_heads); }
  float* values(int layer, int kv_head) { return v.data() + offset(layer, kv_head, n_kv_heads); }

 private:
  size_t offset(int layer, int head, int heads) const {
    return (size_t(layer) * size_t(heads) + size_t(head)) * size_t(n_tokens) * size_t(head_dim);
  }
};

// Throws kvserve::Error when the file cannot be written.
void write_qk_dump(const std::string& path, const QkDump& dump);
// Throws kvserve::Error naming the problem for a missing, truncated or
// implausible file (bad magic or version, non-positive or oversized shape,
// size not matching the header).
[[nodiscard]] QkDump read_qk_dump(const std::string& path);

}  // namespace kvserve
