// The byte format every tier stores for one KV block: a fixed header, then the
// payload (the block's encoded K and V of every layer, exactly as the KV cache
// holds them: an INT4 block travels as INT4 codes with their scales).
//
// Header, 72 bytes, little-endian:
//   offset  size  field
//        0     4  magic "KVBK"
//        4     2  format version (kRecordVersion)
//        6     2  header size in bytes (72)
//        8     8  codec hash: KvCache::block_codec_hash() of the writer
//       16     8  model id: the writer's model identity
//       24    32  block key
//       56     8  payload size in bytes
//       64     8  checksum: XXH3-64 of the payload, seeded with XXH3-64 of bytes [0, 64)
//
// A reader states what it expects (model, codec, key, payload size); a record
// that differs in any field, is truncated, has trailing bytes or fails its
// checksum is refused with the reason, and the block is recomputed instead.
// The record's own consistency (length, checksum) is checked before the
// reader's expectations, so a model, codec or length mismatch means a sound
// record written by someone else (record_is_foreign), never damage.
// Every offset and length is checked against the buffer before it is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/block_key.h"

namespace kvserve {

inline constexpr uint32_t kRecordMagic = 0x4B42564B;  // "KVBK" read as little-endian
inline constexpr uint16_t kRecordVersion = 1;
inline constexpr size_t kRecordHeaderBytes = 72;

// What a record says about the block it carries, besides its key.
struct RecordIdentity {
  uint64_t model_id = 0;
  uint64_t codec_hash = 0;
};

// What a reader requires of a record.
struct RecordExpectation {
  RecordIdentity identity;
  BlockKey key;
  uint64_t payload_bytes = 0;  // exact payload size in bytes; 0 = any
};

enum class RecordStatus : uint8_t {
  Ok,
  Truncated,           // shorter than the header, or than header + payload
  BadMagic,
  UnsupportedVersion,
  BadHeaderSize,
  ModelMismatch,
  CodecMismatch,
  KeyMismatch,
  LengthMismatch,      // a sound record whose payload size differs from the expectation
  ChecksumMismatch,
  TrailingBytes,       // bytes follow the payload the header declares
};

std::string_view record_status_name(RecordStatus status);
// Whether a refused record is sound but another model's, codec's or block
// size's (in a shared tier, maybe another fleet's) rather than damaged.
bool record_is_foreign(RecordStatus status);

// header + payload; payload.size() + kRecordHeaderBytes bytes.
[[nodiscard]] Bytes encode_record(const RecordIdentity& identity, const BlockKey& key, ByteView payload);
// Fills the header (checksum included) of a record whose payload is already in
// place at offset kRecordHeaderBytes: lets a caller copy the payload once and
// leave the hashing to another thread.  REQUIRES: record.size() >= kRecordHeaderBytes.
void write_record_header(const RecordIdentity& identity, const BlockKey& key, std::span<uint8_t> record);

struct DecodedRecord {
  RecordStatus status = RecordStatus::Truncated;
  ByteView payload;  // into the record; empty unless status is Ok
};

// Validates `record` against `expect`; the payload is returned only when every
// check passes.
[[nodiscard]] DecodedRecord decode_record(ByteView record, const RecordExpectation& expect);

}  // namespace kvserve
