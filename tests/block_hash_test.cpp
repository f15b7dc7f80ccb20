// Block keys: both hashes chain from the root, known answers pin the digests,
// and everything that changes a block's bytes changes its key.
#include "kv/block_hash.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/kv_spec.h"
#include "util/error.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_shapes::stories_shape;

std::vector<int32_t> iota_tokens(int32_t n, int32_t first = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[size_t(i)] = first + i;
  return t;
}

TEST(BlockHash, KnownAnswers) {
  // SHA-256("abc") from FIPS 180-2.
  EXPECT_EQ(BlockHasher(BlockHashAlgo::Sha256, "").digest("abc").hex(BlockHashAlgo::Sha256),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // XXH3-128 in canonical (big-endian) byte order.
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits("abc", 3));
  BlockKey want;
  std::memcpy(want.bytes.data(), c.digest, 16);
  EXPECT_EQ(BlockHasher(BlockHashAlgo::Xxh3_128, "").digest("abc"), want);
  EXPECT_EQ(want.hex(BlockHashAlgo::Xxh3_128).size(), 32u);
}

TEST(BlockHash, BlockKeyHashesParentExtraAndTokens) {
  const BlockHasher h(BlockHashAlgo::Xxh3_128, "model=m");
  const BlockKey parent = h.digest("root");
  const std::vector<int32_t> tokens = {7, 8, 9, 10};
  // parent | H(extra) | tokens as little-endian int32.
  std::string bytes(reinterpret_cast<const char*>(parent.bytes.data()), 32);
  const BlockKey extra = h.digest("model=m");
  bytes.append(reinterpret_cast<const char*>(extra.bytes.data()), 32);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), 16);
  EXPECT_EQ(h.block_key(parent, tokens), h.digest(bytes));
}

TEST(BlockHash, KeysChainAndDifferBetweenHashes) {
  for (BlockHashAlgo algo : {BlockHashAlgo::Xxh3_128, BlockHashAlgo::Sha256}) {
    const BlockHasher h(algo, "model=m");
    const BlockKey root = h.digest("root");
    std::vector<int32_t> a = iota_tokens(10), b = a;
    b[1] = 99;  // differs in the first block only
    std::vector<BlockKey> ka, kb;
    h.extend(root, a, 4, ka);
    h.extend(root, b, 4, kb);
    ASSERT_EQ(ka.size(), 2u);  // the partial third block has no key
    EXPECT_EQ(ka[0], h.block_key(root, std::span(a).first(4)));
    EXPECT_EQ(ka[1], h.block_key(ka[0], std::span(a).subspan(4, 4)));
    EXPECT_NE(ka[0], kb[0]);
    EXPECT_NE(ka[1], kb[1]);  // same tokens in block 1, different history
    // Extending hashes only the new blocks: the same keys as in one go.
    std::vector<BlockKey> grown;
    h.extend(root, std::span(a).first(5), 4, grown);
    ASSERT_EQ(grown.size(), 1u);
    h.extend(root, a, 4, grown);
    EXPECT_EQ(grown, ka);
  }
  const std::vector<int32_t> t = iota_tokens(4);
  const BlockHasher x(BlockHashAlgo::Xxh3_128, "e"), s(BlockHashAlgo::Sha256, "e");
  const BlockKey kx = x.block_key(BlockKey{}, t), ks = s.block_key(BlockKey{}, t);
  EXPECT_NE(kx, ks);
  // XXH3-128 fills 16 bytes, SHA-256 all 32.
  EXPECT_EQ(std::vector<uint8_t>(kx.bytes.begin() + 16, kx.bytes.end()), std::vector<uint8_t>(16, 0));
  EXPECT_EQ(ks.hex(BlockHashAlgo::Sha256).size(), 64u);
}

TEST(BlockHash, IdentityCoversModelCodecsBlockSizeAndResidual) {
  const ModelConfig c = stories_shape(2);
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 4;
  apply_kv_preset(o, "fp16");
  const std::string fp16 = kv_cache_identity(KvCache(c, o), "m");
  EXPECT_NE(fp16, kv_cache_identity(KvCache(c, o), "other-model"));
  EXPECT_NE(fp16.find("layer 1 v=fp16"), std::string::npos);
  apply_kv_preset(o, "int4", /*keep_block_size=*/true);
  const std::string int4 = kv_cache_identity(KvCache(c, o), "m");
  EXPECT_NE(int4, fp16);
  EXPECT_NE(int4.find("layer 0 k=int4/channel"), std::string::npos);
  o.residual = 4;
  EXPECT_NE(kv_cache_identity(KvCache(c, o), "m"), int4);
  // Calibrated ranges change the codes, not the description.
  KvCacheOptions s;
  s.block_size = 4;
  s.num_blocks = 4;
  s.k = {KvDType::INT8, KvGrouping::Channel, 0, std::vector<float>(32, -1.0f), std::vector<float>(32, 1.0f)};
  s.v = s.k;
  const std::string a = kv_cache_identity(KvCache(c, s), "m");
  s.v.static_max[3] = 2.0f;
  EXPECT_NE(kv_cache_identity(KvCache(c, s), "m"), a);
  // Different extras give different keys for the same tokens.
  const std::vector<int32_t> t = iota_tokens(4);
  EXPECT_NE(BlockHasher(BlockHashAlgo::Xxh3_128, fp16).block_key(BlockKey{}, t),
            BlockHasher(BlockHashAlgo::Xxh3_128, int4).block_key(BlockKey{}, t));
}

TEST(BlockHash, ParsesNames) {
  EXPECT_EQ(parse_block_hash_algo("sha256"), BlockHashAlgo::Sha256);
  EXPECT_EQ(parse_block_hash_algo("xxh3"), BlockHashAlgo::Xxh3_128);
  EXPECT_THROW(parse_block_hash_algo("md5"), Error);
  std::vector<BlockKey> keys;
  EXPECT_THROW(BlockHasher(BlockHashAlgo::Xxh3_128, "").extend(BlockKey{}, iota_tokens(4), 0, keys), Error);
}

}  // namespace
}  // namespace kvserve
