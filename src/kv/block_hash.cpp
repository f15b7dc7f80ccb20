#include "kv/block_hash.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <cassert>
#include <cstring>

#include <fmt/format.h>

#include "kv/kv_cache.h"
#include "util/error.h"

namespace kvserve {

std::string_view block_hash_algo_name(BlockHashAlgo algo) {
  return algo == BlockHashAlgo::Sha256 ? "sha256" : "xxh3";
}

BlockHashAlgo parse_block_hash_algo(std::string_view name) {
  if (name == "xxh3") return BlockHashAlgo::Xxh3_128;
  if (name == "sha256") return BlockHashAlgo::Sha256;
  fail("unknown prefix-cache hash '{}' (expected xxh3 or sha256)", name);
}

uint64_t BlockKey::prefix64() const {
  uint64_t v;
  std::memcpy(&v, bytes.data(), sizeof v);
  return v;
}

std::string BlockKey::hex(BlockHashAlgo algo) const {
  const size_t n = algo == BlockHashAlgo::Sha256 ? 32 : 16;
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) out += fmt::format("{:02x}", bytes[i]);
  return out;
}

std::string BlockKey::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * kBytes, '0');
  for (size_t i = 0; i < kBytes; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

BlockKey BlockKey::from_bytes(std::span<const uint8_t> data) {
  if (data.size() > kBytes) fail("a block key has at most {} bytes, got {}", kBytes, data.size());
  BlockKey key;
  if (!data.empty()) std::memcpy(key.bytes.data(), data.data(), data.size());
  return key;
}

std::optional<BlockKey> BlockKey::from_hex(std::string_view hex) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() != 2 * kBytes) return std::nullopt;
  BlockKey key;
  for (size_t i = 0; i < kBytes; ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    key.bytes[i] = uint8_t(hi * 16 + lo);
  }
  return key;
}

size_t BlockKeyHash::operator()(const BlockKey& k) const noexcept {
  return size_t(XXH3_64bits(k.bytes.data(), k.bytes.size()));
}

BlockHasher::BlockHasher(BlockHashAlgo algo, std::string_view extra) : algo_(algo) {
  extra_ = digest(extra);
}

BlockKey BlockHasher::hash(const uint8_t* data, size_t n) const {
  BlockKey key;
  if (algo_ == BlockHashAlgo::Xxh3_128) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data, n));
    static_assert(sizeof c.digest == 16);
    std::memcpy(key.bytes.data(), c.digest, sizeof c.digest);
    return key;
  }
  unsigned int len = 0;
  // EVP_sha256() is OpenSSL's built-in implementation (SHA-NI when the CPU has it).
  if (EVP_Digest(data, n, key.bytes.data(), &len, EVP_sha256(), nullptr) != 1 || len != key.bytes.size())
    fail("SHA-256 failed in OpenSSL");
  return key;
}

BlockKey BlockHasher::digest(std::string_view data) const {
  return hash(reinterpret_cast<const uint8_t*>(data.data()), data.size());
}

BlockKey BlockHasher::block_key(const BlockKey& parent, std::span<const int32_t> tokens) const {
  assert(tokens.size() <= size_t(kMaxBlockTokens));
  // parent (32 bytes) | H(extra) (32 bytes) | token ids as little-endian int32 (x86).
  std::array<uint8_t, 64 + 4 * kMaxBlockTokens> buf;
  std::memcpy(buf.data(), parent.bytes.data(), 32);
  std::memcpy(buf.data() + 32, extra_.bytes.data(), 32);
  std::memcpy(buf.data() + 64, tokens.data(), tokens.size_bytes());
  return hash(buf.data(), 64 + tokens.size_bytes());
}

void BlockHasher::extend(const BlockKey& root, std::span<const int32_t> tokens, int32_t block_size,
                         std::vector<BlockKey>& keys) const {
  if (block_size <= 0 || block_size > kMaxBlockTokens)
    fail("prefix-cache block size {} is out of range (1..{})", block_size, kMaxBlockTokens);
  const size_t full = tokens.size() / size_t(block_size);
  for (size_t b = keys.size(); b < full; ++b) {
    const BlockKey& parent = b == 0 ? root : keys[b - 1];
    keys.push_back(block_key(parent, tokens.subspan(b * size_t(block_size), size_t(block_size))));
  }
}

std::string kv_cache_identity(const KvCache& cache, std::string_view model_id) {
  // layout: bumped whenever a codec's bytes change meaning (2: channel-grouped
  // codes stored channel-major; 3: 4-bit ones in octets), so an older build's
  // blocks have other keys in every tier instead of failing their codec check.
  std::string out = fmt::format("model={}\nblock_size={}\nresidual={}\nlayout=3\n", model_id, cache.block_size(),
                                cache.residual());
  auto codec = [&out](const KvCodec& c) {
    out += c.config().describe();
    // Calibrated ranges change the codes without changing the description.
    for (const auto* range : {&c.config().static_min, &c.config().static_max})
      out.append(reinterpret_cast<const char*>(range->data()), range->size() * sizeof(float));
    out += '\n';
  };
  for (int l = 0; l < cache.n_layers(); ++l) {
    out += fmt::format("layer {} k=", l);
    codec(cache.k_codec(l));
    out += fmt::format("layer {} v=", l);
    codec(cache.v_codec(l));
  }
  return out;
}

}  // namespace kvserve
