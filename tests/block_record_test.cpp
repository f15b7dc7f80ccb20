// BlockKey and the block record format: exact layout, every mismatch refused
// with its reason, and fuzz-style corruption (every bit flip, every
// truncation, random garbage) never decoded as a valid block.
#include "store/block_record.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <unordered_set>

#include "util/error.h"

namespace kvserve {
namespace {

BlockKey key_of(uint64_t n) {
  uint8_t b[16] = {};
  std::memcpy(b + 8, &n, sizeof(n));
  return BlockKey::from_bytes(b);
}

Bytes payload_of(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes p(n);
  for (auto& b : p) b = uint8_t(rng());
  return p;
}

const RecordIdentity kIdentity{0x1234567890abcdefULL, 0xfeedfacecafebeefULL};

RecordExpectation expect_for(const BlockKey& key, uint64_t payload_bytes = 0) {
  return RecordExpectation{kIdentity, key, payload_bytes};
}

TEST(BlockKey, ShortKeysArePaddedWithZerosAndHexRoundTrips) {
  const uint8_t xxh128[16] = {0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0xff};
  const BlockKey k = BlockKey::from_bytes(xxh128);
  EXPECT_EQ(k.hex(), "deadbeef0102030405060708090a0bff00000000000000000000000000000000");
  EXPECT_EQ(BlockKey::from_hex(k.hex()), k);
  EXPECT_EQ(BlockKey::from_hex("DEADBEEF0102030405060708090A0BFF00000000000000000000000000000000"), k);
  EXPECT_FALSE(BlockKey::from_hex("deadbeef"));
  EXPECT_FALSE(BlockKey::from_hex(std::string(63, '0') + "g"));
  const uint8_t too_long[33] = {};
  EXPECT_THROW(BlockKey::from_bytes(too_long), Error);
}

TEST(BlockKey, HashMixesEveryByte) {
  std::unordered_set<size_t> hashes;
  for (uint64_t i = 0; i < 1000; ++i) hashes.insert(BlockKeyHash{}(key_of(i)));
  EXPECT_EQ(hashes.size(), 1000u);  // keys differing only in their last bytes
}

TEST(BlockRecord, LayoutIsTheDocumentedHeaderThenThePayload) {
  const BlockKey key = key_of(42);
  const Bytes payload = payload_of(1000, 1);
  const Bytes r = encode_record(kIdentity, key, payload);
  ASSERT_EQ(r.size(), kRecordHeaderBytes + 1000);
  EXPECT_EQ(std::memcmp(r.data(), "KVBK", 4), 0);
  uint16_t version, header;
  uint64_t codec, model, length;
  std::memcpy(&version, r.data() + 4, 2);
  std::memcpy(&header, r.data() + 6, 2);
  std::memcpy(&codec, r.data() + 8, 8);
  std::memcpy(&model, r.data() + 16, 8);
  std::memcpy(&length, r.data() + 56, 8);
  EXPECT_EQ(version, kRecordVersion);
  EXPECT_EQ(header, kRecordHeaderBytes);
  EXPECT_EQ(codec, kIdentity.codec_hash);
  EXPECT_EQ(model, kIdentity.model_id);
  EXPECT_EQ(std::memcmp(r.data() + 24, key.bytes.data(), 32), 0);
  EXPECT_EQ(length, 1000u);
  EXPECT_EQ(std::memcmp(r.data() + kRecordHeaderBytes, payload.data(), payload.size()), 0);

  const DecodedRecord d = decode_record(r, expect_for(key, 1000));
  ASSERT_EQ(d.status, RecordStatus::Ok);
  EXPECT_EQ(d.payload.data(), r.data() + kRecordHeaderBytes);
  EXPECT_EQ(Bytes(d.payload.begin(), d.payload.end()), payload);
}

TEST(BlockRecord, HeaderWrittenInPlaceEqualsEncoding) {
  const Bytes payload = payload_of(333, 8);
  Bytes in_place(kRecordHeaderBytes + payload.size());
  std::memcpy(in_place.data() + kRecordHeaderBytes, payload.data(), payload.size());
  write_record_header(kIdentity, key_of(5), in_place);
  EXPECT_EQ(in_place, encode_record(kIdentity, key_of(5), payload));
}

TEST(BlockRecord, EmptyPayloadRoundTrips) {
  const Bytes r = encode_record(kIdentity, key_of(1), {});
  EXPECT_EQ(r.size(), kRecordHeaderBytes);
  EXPECT_EQ(decode_record(r, expect_for(key_of(1))).status, RecordStatus::Ok);
}

TEST(BlockRecord, EachMismatchIsRefusedWithItsReason) {
  const BlockKey key = key_of(7);
  const Bytes r = encode_record(kIdentity, key, payload_of(64, 2));
  RecordExpectation e = expect_for(key);
  e.identity.model_id ^= 1;
  EXPECT_EQ(decode_record(r, e).status, RecordStatus::ModelMismatch);
  e = expect_for(key);
  e.identity.codec_hash ^= 1;
  EXPECT_EQ(decode_record(r, e).status, RecordStatus::CodecMismatch);
  EXPECT_EQ(decode_record(r, expect_for(key_of(8))).status, RecordStatus::KeyMismatch);
  EXPECT_EQ(decode_record(r, expect_for(key, 65)).status, RecordStatus::LengthMismatch);

  Bytes bad = r;
  bad[0] = 'X';
  EXPECT_EQ(decode_record(bad, expect_for(key)).status, RecordStatus::BadMagic);
  bad = r;
  bad[4] = 2;
  EXPECT_EQ(decode_record(bad, expect_for(key)).status, RecordStatus::UnsupportedVersion);
  bad = r;
  bad[6] = 80;
  EXPECT_EQ(decode_record(bad, expect_for(key)).status, RecordStatus::BadHeaderSize);
  bad = r;
  bad.push_back(0);
  EXPECT_EQ(decode_record(bad, expect_for(key)).status, RecordStatus::TrailingBytes);
  bad = r;
  bad.back() ^= 0x10;
  EXPECT_EQ(decode_record(bad, expect_for(key)).status, RecordStatus::ChecksumMismatch);
  EXPECT_EQ(record_status_name(RecordStatus::ChecksumMismatch), "checksum mismatch");
}

// Damage is never taken for another fleet's record: trailing bytes, or a
// flipped bit in the model or codec field, are damage (deleted), while a sound
// record of another model, codec or size is foreign (left to age out).
TEST(BlockRecord, DamageIsToldApartFromAForeignRecord) {
  const BlockKey key = key_of(7);
  const Bytes r = encode_record(kIdentity, key, payload_of(64, 2));
  Bytes bad = r;
  bad.insert(bad.end(), {'g', 'a', 'r', 'b', 'a', 'g', 'e'});
  EXPECT_EQ(decode_record(bad, expect_for(key, 64)).status, RecordStatus::TrailingBytes);
  for (const size_t field : {size_t(8), size_t(16)}) {  // codec hash, model id
    bad = r;
    bad[field] ^= 1;
    EXPECT_EQ(decode_record(bad, expect_for(key, 64)).status, RecordStatus::ChecksumMismatch) << field;
  }
  RecordExpectation other = expect_for(key, 64);
  other.identity.model_id ^= 1;
  EXPECT_TRUE(record_is_foreign(decode_record(r, other).status));
  EXPECT_TRUE(record_is_foreign(decode_record(r, expect_for(key, 65)).status));
  for (const RecordStatus damage : {RecordStatus::TrailingBytes, RecordStatus::ChecksumMismatch,
                                    RecordStatus::Truncated, RecordStatus::KeyMismatch})
    EXPECT_FALSE(record_is_foreign(damage)) << record_status_name(damage);
}

TEST(BlockRecord, EveryTruncationIsRefused) {
  const BlockKey key = key_of(3);
  const Bytes r = encode_record(kIdentity, key, payload_of(300, 3));
  for (size_t n = 0; n < r.size(); ++n) {
    const DecodedRecord d = decode_record(ByteView(r).first(n), expect_for(key));
    EXPECT_EQ(d.status, RecordStatus::Truncated) << "length " << n;
    EXPECT_TRUE(d.payload.empty());
  }
}

TEST(BlockRecord, EverySingleBitFlipIsRefused) {
  const BlockKey key = key_of(9);
  const Bytes r = encode_record(kIdentity, key, payload_of(256, 4));
  for (size_t bit = 0; bit < r.size() * 8; ++bit) {
    Bytes bad = r;
    bad[bit / 8] ^= uint8_t(1u << (bit % 8));
    EXPECT_NE(decode_record(bad, expect_for(key)).status, RecordStatus::Ok) << "bit " << bit;
  }
}

TEST(BlockRecord, RandomCorruptionAndGarbageAreRefused) {
  std::mt19937 rng(5);
  const BlockKey key = key_of(11);
  const Bytes r = encode_record(kIdentity, key, payload_of(4096, 6));
  for (int trial = 0; trial < 2000; ++trial) {
    Bytes bad = r;
    const int edits = 1 + int(rng() % 8);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % bad.size();
      const uint8_t value = uint8_t(rng());
      if (value == bad[at]) continue;
      bad[at] = value;
    }
    if (bad == r) continue;
    if (rng() % 4 == 0) bad.resize(rng() % bad.size());
    EXPECT_NE(decode_record(bad, expect_for(key)).status, RecordStatus::Ok) << "trial " << trial;
  }
  for (int trial = 0; trial < 500; ++trial) {
    Bytes garbage = payload_of(rng() % 512, uint32_t(trial));
    EXPECT_NE(decode_record(garbage, expect_for(key)).status, RecordStatus::Ok);
  }
}

TEST(BlockRecord, HostilePayloadSizeCannotOverflow) {
  const BlockKey key = key_of(12);
  Bytes r = encode_record(kIdentity, key, payload_of(16, 7));
  for (uint64_t size : {~uint64_t(0), ~uint64_t(0) - kRecordHeaderBytes + 1, uint64_t(1) << 63}) {
    std::memcpy(r.data() + 56, &size, 8);
    EXPECT_EQ(decode_record(r, expect_for(key)).status, RecordStatus::Truncated);
  }
}

}  // namespace
}  // namespace kvserve
