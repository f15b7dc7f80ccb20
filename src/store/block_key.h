// The key of one KV block in every store tier: an opaque, fixed-size byte
// string computed by the prefix cache. A 128-bit xxh3 key fills the first 16
// bytes and leaves the rest zero; a SHA-256 key fills all 32. The tenant salt,
// the model and the KV codec are folded into the key by whoever computes it,
// so tiers compare keys only and tenant isolation holds in every tier.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

// Values every tier stores: owned bytes, and a view of bytes someone else owns.
using Bytes = std::vector<uint8_t>;
using ByteView = std::span<const uint8_t>;

struct BlockKey {
  static constexpr size_t kBytes = 32;
  std::array<uint8_t, kBytes> bytes{};

  // The first n bytes from data, the rest zero. Throws kvserve::Error when n > 32.
  static BlockKey from_bytes(ByteView data);
  // Parses exactly 64 hex digits (either case); nullopt otherwise.
  static std::optional<BlockKey> from_hex(std::string_view hex);
  // 64 lowercase hex digits (a 16-byte key ends in 32 zeros).
  std::string hex() const;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  friend auto operator<=>(const BlockKey&, const BlockKey&) = default;
};

// Keys are usually hashes already, but tests and tools build structured ones
// (a counter in the last bytes), so the hash mixes all 32 bytes.
struct BlockKeyHash {
  size_t operator()(const BlockKey& key) const noexcept;
};

// The key of the chain a block belongs to: all blocks written or read in one
// call share it. The Redis tier puts it in a hash tag so a chain's blocks land
// in one cluster slot (one round trip); the other tiers ignore it. Because a
// prefix-cache key determines its whole prefix, the chain's first block key is
// a function of every block key in it, so writer and reader agree on the tag.
using ChainTag = std::optional<BlockKey>;

}  // namespace kvserve
