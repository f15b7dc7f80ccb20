#include "store/block_key.h"

#include <xxhash.h>

#include <cstring>

#include "util/error.h"

namespace kvserve {
namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

BlockKey BlockKey::from_bytes(ByteView data) {
  if (data.size() > kBytes) fail("a block key has at most {} bytes, got {}", kBytes, data.size());
  BlockKey key;
  if (!data.empty()) std::memcpy(key.bytes.data(), data.data(), data.size());
  return key;
}

std::optional<BlockKey> BlockKey::from_hex(std::string_view hex) {
  if (hex.size() != 2 * kBytes) return std::nullopt;
  BlockKey key;
  for (size_t i = 0; i < kBytes; ++i) {
    const int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    key.bytes[i] = uint8_t(hi * 16 + lo);
  }
  return key;
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

size_t BlockKeyHash::operator()(const BlockKey& key) const noexcept {
  return size_t(XXH3_64bits(key.bytes.data(), key.bytes.size()));
}

}  // namespace kvserve
