#include "attention/qk_dump.h"

#include <cmath>
#include <cstring>
#include <fstream>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'Q', 'K', 'D', 'U', 'M', 'P'};
constexpr uint32_t kVersion = 2;
constexpr size_t kHeaderBytes = 8 + 4 + 5 * 4 + 4 + 8;  // version 1's; version 2 adds rope_freqs

// Floats of q, then of k (= of v), for a header; fails when the shape is
// implausible or would overflow.
std::pair<uint64_t, uint64_t> float_counts(const QkDump& d) {
  const int32_t dims[] = {d.n_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.chunk};
  for (int32_t x : dims)
    if (x < 1 || x > (1 << 20)) fail("qk dump: shape field {} is outside [1, 2^20]", x);
  if (d.n_tokens < 1 || d.n_tokens > (int64_t(1) << 32)) fail("qk dump: n_tokens {} is outside [1, 2^32]", d.n_tokens);
  const unsigned __int128 per_head = (unsigned __int128)(d.n_tokens) * uint64_t(d.head_dim);
  const unsigned __int128 q = per_head * uint64_t(d.n_layers) * uint64_t(d.n_heads);
  const unsigned __int128 k = per_head * uint64_t(d.n_layers) * uint64_t(d.n_kv_heads);
  if (q + 2 * k > (unsigned __int128)(uint64_t(1) << 40)) fail("qk dump: {} tokens of this shape are too large", d.n_tokens);
  return {uint64_t(q), uint64_t(k)};
}

}  // namespace

void QkDump::allocate() {
  const auto [nq, nk] = float_counts(*this);
  q.assign(nq, 0.0f);
  k.assign(nk, 0.0f);
  v.assign(nk, 0.0f);
}

std::vector<float> QkDump::frequencies() const {
  return rope_freqs.empty() ? unscaled_rope_frequencies(head_dim, rope_theta) : rope_freqs;
}

void write_qk_dump(const std::string& path, const QkDump& d) {
  const auto [nq, nk] = float_counts(d);
  if (d.q.size() != nq || d.k.size() != nk || d.v.size() != nk)
    fail("qk dump: buffers do not match the shape (q {} of {}, k {} and v {} of {} floats)", d.q.size(), nq,
         d.k.size(), d.v.size(), nk);
  const std::vector<float> freqs = d.frequencies();
  if (freqs.size() != size_t(d.head_dim / 2))
    fail("qk dump: {} RoPE frequencies for head_dim {}", freqs.size(), d.head_dim);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("cannot write '{}'", path);
  const int32_t fields[] = {d.n_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.chunk};
  out.write(kMagic, 8);
  out.write(reinterpret_cast<const char*>(&kVersion), 4);
  out.write(reinterpret_cast<const char*>(fields), sizeof(fields));
  out.write(reinterpret_cast<const char*>(&d.rope_theta), 4);
  out.write(reinterpret_cast<const char*>(&d.n_tokens), 8);
  out.write(reinterpret_cast<const char*>(freqs.data()), std::streamsize(freqs.size() * sizeof(float)));
  for (const auto* buf : {&d.q, &d.k, &d.v})
    out.write(reinterpret_cast<const char*>(buf->data()), std::streamsize(buf->size() * sizeof(float)));
  if (!out) fail("failed writing '{}' (disk full?)", path);
}

QkDump read_qk_dump(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail("cannot open qk dump '{}'", path);
  const uint64_t file_bytes = uint64_t(in.tellg());
  in.seekg(0);
  if (file_bytes < kHeaderBytes) fail("'{}' is too short to be a qk dump ({} bytes)", path, file_bytes);
  char magic[8];
  uint32_t version = 0;
  int32_t fields[5];
  QkDump d;
  in.read(magic, 8);
  in.read(reinterpret_cast<char*>(&version), 4);
  in.read(reinterpret_cast<char*>(fields), sizeof(fields));
  in.read(reinterpret_cast<char*>(&d.rope_theta), 4);
  in.read(reinterpret_cast<char*>(&d.n_tokens), 8);
  if (std::memcmp(magic, kMagic, 8) != 0) fail("'{}' is not a qk dump (bad magic)", path);
  if (version != 1 && version != kVersion)
    fail("'{}': qk dump version {} is not supported (expected 1 or {})", path, version, kVersion);
  d.n_layers = fields[0];
  d.n_heads = fields[1];
  d.n_kv_heads = fields[2];
  d.head_dim = fields[3];
  d.chunk = fields[4];
  if (!(d.rope_theta > 0.0f)) fail("'{}': RoPE base {} is not positive", path, d.rope_theta);
  const auto [nq, nk] = float_counts(d);
  const uint64_t pairs = version == 1 ? 0 : uint64_t(d.head_dim / 2);
  const uint64_t expected = kHeaderBytes + (pairs + nq + 2 * nk) * sizeof(float);
  if (file_bytes != expected)
    fail("'{}': qk dump holds {} bytes but its header describes {} (truncated or corrupt)", path, file_bytes, expected);
  if (d.n_heads % d.n_kv_heads != 0)
    fail("'{}': {} query heads are not a multiple of {} KV heads", path, d.n_heads, d.n_kv_heads);
  if (version == 1) {
    d.rope_freqs = d.frequencies();
  } else {
    d.rope_freqs.resize(size_t(pairs));
    in.read(reinterpret_cast<char*>(d.rope_freqs.data()), std::streamsize(pairs * sizeof(float)));
    for (float f : d.rope_freqs)
      if (!std::isfinite(f)) fail("'{}': RoPE frequency {} is not finite", path, f);
  }
  d.allocate();
  for (auto* buf : {&d.q, &d.k, &d.v})
    in.read(reinterpret_cast<char*>(buf->data()), std::streamsize(buf->size() * sizeof(float)));
  if (!in) fail("failed reading '{}'", path);
  return d;
}

}  // namespace kvserve
