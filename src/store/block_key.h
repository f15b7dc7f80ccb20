// The key of one KV block in every store tier is the prefix cache's BlockKey
// (kv/block_hash.h): an opaque, fixed-size byte string. A 128-bit xxh3 key fills the first 16
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

#include "kv/block_hash.h"

namespace kvserve {

// Values every tier stores: owned bytes, and a view of bytes someone else owns.
using Bytes = std::vector<uint8_t>;
using ByteView = std::span<const uint8_t>;

// The key of the chain a block belongs to: all blocks written or read in one
// call share it. The Redis tier puts it in a hash tag so a chain's blocks land
// in one cluster slot (one round trip); the other tiers ignore it. Because a
// prefix-cache key determines its whole prefix, the chain's first block key is
// a function of every block key in it, so writer and reader agree on the tag.
using ChainTag = std::optional<BlockKey>;

}  // namespace kvserve
