// Content-addressed keys of full KV blocks, the identity the prefix cache
// shares blocks by:
//   key(block 0) = H(root,             extra, tokens of block 0)
//   key(block i) = H(key(block i - 1), extra, tokens of block i)
// so a key names a block's tokens and everything before them. `extra` is a
// digest of what else decides a block's bytes: the model and the KV codec
// configuration of every layer (kv_cache_identity), so an INT4 block never
// serves an FP16 request. `root` carries the cache scope: a tenant's secret
// salt is mixed into the first block's key, so no other tenant can name it.
//
// H is a setting: XXH3-128 (fast, not collision-resistant against crafted
// inputs) or SHA-256 via OpenSSL EVP (collision-resistant; use it when
// prompts come from untrusted clients sharing a global scope).
//
// Thread safety: a BlockHasher is immutable after construction; any thread
// may compute keys concurrently.
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

class KvCache;

enum class BlockHashAlgo : uint8_t { Xxh3_128, Sha256 };

std::string_view block_hash_algo_name(BlockHashAlgo algo);  // "xxh3", "sha256"
// Parses "xxh3" or "sha256"; throws kvserve::Error otherwise.
BlockHashAlgo parse_block_hash_algo(std::string_view name);

// Also the key of a block in every store tier (src/store/): tiers compare
// keys only, so the tenant salt folded in here keeps tenants apart there too.
struct BlockKey {
  static constexpr size_t kBytes = 32;
  // The digest: 32 bytes of SHA-256, or XXH3-128 in its canonical (big-endian)
  // form in the first 16 bytes with the rest zero.
  std::array<uint8_t, kBytes> bytes{};

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  friend auto operator<=>(const BlockKey&, const BlockKey&) = default;
  // The first 8 bytes as an integer (compact event ids).
  uint64_t prefix64() const;
  // Lower-case hex of the digest's bytes (32 or 64 digits).
  std::string hex(BlockHashAlgo algo) const;
  // All 64 hex digits (a 16-byte key ends in 32 zeros).
  std::string hex() const;
  // The first n bytes of data, the rest zero. Throws kvserve::Error when n > 32.
  static BlockKey from_bytes(std::span<const uint8_t> data);
  // Parses exactly 64 hex digits (either case); nullopt otherwise.
  static std::optional<BlockKey> from_hex(std::string_view hex);
};

// Mixes all 32 bytes: tests and tools build structured keys (a counter in the
// last bytes), not only digests.
struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const noexcept;
};

class BlockHasher {
 public:
  // extra: bytes every key includes (see kv_cache_identity); hashed once here.
  BlockHasher(BlockHashAlgo algo, std::string_view extra);

  BlockHashAlgo algo() const { return algo_; }

  // H(data): roots of scopes are digests of their salts.
  BlockKey digest(std::string_view data) const;
  // The key of one block of tokens after `parent`.
  // tokens: (block_size) token ids, block_size <= kMaxBlockTokens.
  BlockKey block_key(const BlockKey& parent, std::span<const int32_t> tokens) const;
  // Appends the keys of the full blocks of `tokens` that `keys` lacks: keys
  // holds the keys of the first keys.size() blocks of the same tokens (under
  // the same root), so a growing sequence is hashed once per block.
  void extend(const BlockKey& root, std::span<const int32_t> tokens, int32_t block_size,
              std::vector<BlockKey>& keys) const;

  static constexpr int32_t kMaxBlockTokens = 1024;

 private:
  BlockKey hash(const uint8_t* data, size_t n) const;

  BlockHashAlgo algo_;
  BlockKey extra_;  // H(extra)
};

// What, besides the tokens, decides a block's bytes: the caller's model
// identity (e.g. a digest of the model's config and weights), then block
// size, residual window and each layer's K and V codec (description and any
// static scale ranges).
std::string kv_cache_identity(const KvCache& cache, std::string_view model_id);

}  // namespace kvserve
