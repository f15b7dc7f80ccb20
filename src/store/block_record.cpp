#include "store/block_record.h"

#include <xxhash.h>

#include <bit>
#include <cstring>

namespace kvserve {
namespace {

static_assert(std::endian::native == std::endian::little, "records are written in host order, which must be little-endian");

constexpr size_t kMagicAt = 0, kVersionAt = 4, kHeaderSizeAt = 6, kCodecAt = 8, kModelAt = 16, kKeyAt = 24,
                 kPayloadSizeAt = 56, kChecksumAt = 64;
static_assert(kKeyAt + BlockKey::kBytes == kPayloadSizeAt && kChecksumAt + 8 == kRecordHeaderBytes);

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Covers every header byte before the checksum and the whole payload.
uint64_t checksum(const uint8_t* header, ByteView payload) {
  const uint64_t seed = XXH3_64bits(header, kChecksumAt);
  return XXH3_64bits_withSeed(payload.data(), payload.size(), seed);
}

}  // namespace

std::string_view record_status_name(RecordStatus status) {
  switch (status) {
    case RecordStatus::Ok: return "ok";
    case RecordStatus::Truncated: return "truncated";
    case RecordStatus::BadMagic: return "bad magic";
    case RecordStatus::UnsupportedVersion: return "unsupported format version";
    case RecordStatus::BadHeaderSize: return "bad header size";
    case RecordStatus::ModelMismatch: return "model mismatch";
    case RecordStatus::CodecMismatch: return "codec mismatch";
    case RecordStatus::KeyMismatch: return "key mismatch";
    case RecordStatus::LengthMismatch: return "length mismatch";
    case RecordStatus::ChecksumMismatch: return "checksum mismatch";
    case RecordStatus::TrailingBytes: return "trailing bytes";
  }
  return "unknown";
}

bool record_is_foreign(RecordStatus status) {
  return status == RecordStatus::ModelMismatch || status == RecordStatus::CodecMismatch ||
         status == RecordStatus::LengthMismatch;
}

void write_record_header(const RecordIdentity& identity, const BlockKey& key, std::span<uint8_t> record) {
  uint8_t* h = record.data();
  const ByteView payload(record.subspan(kRecordHeaderBytes));
  store<uint32_t>(h + kMagicAt, kRecordMagic);
  store<uint16_t>(h + kVersionAt, kRecordVersion);
  store<uint16_t>(h + kHeaderSizeAt, uint16_t(kRecordHeaderBytes));
  store<uint64_t>(h + kCodecAt, identity.codec_hash);
  store<uint64_t>(h + kModelAt, identity.model_id);
  std::memcpy(h + kKeyAt, key.bytes.data(), BlockKey::kBytes);
  store<uint64_t>(h + kPayloadSizeAt, uint64_t(payload.size()));
  store<uint64_t>(h + kChecksumAt, checksum(h, payload));
}

Bytes encode_record(const RecordIdentity& identity, const BlockKey& key, ByteView payload) {
  Bytes out(kRecordHeaderBytes + payload.size());
  if (!payload.empty()) std::memcpy(out.data() + kRecordHeaderBytes, payload.data(), payload.size());
  write_record_header(identity, key, out);
  return out;
}

DecodedRecord decode_record(ByteView record, const RecordExpectation& expect) {
  if (record.size() < kRecordHeaderBytes) return {RecordStatus::Truncated, {}};
  const uint8_t* h = record.data();
  if (load<uint32_t>(h + kMagicAt) != kRecordMagic) return {RecordStatus::BadMagic, {}};
  if (load<uint16_t>(h + kVersionAt) != kRecordVersion) return {RecordStatus::UnsupportedVersion, {}};
  if (load<uint16_t>(h + kHeaderSizeAt) != kRecordHeaderBytes) return {RecordStatus::BadHeaderSize, {}};
  // The record's own consistency first, then what the reader expects: a
  // sound record of another model, codec or block size (another fleet's) is
  // told apart from a damaged one, whatever field the damage hit.
  // Compared as remaining bytes so a hostile size cannot overflow the sum.
  const uint64_t payload_bytes = load<uint64_t>(h + kPayloadSizeAt);
  const uint64_t available = record.size() - kRecordHeaderBytes;
  if (payload_bytes > available) return {RecordStatus::Truncated, {}};
  if (payload_bytes < available) return {RecordStatus::TrailingBytes, {}};
  const ByteView payload = record.subspan(kRecordHeaderBytes);
  if (load<uint64_t>(h + kChecksumAt) != checksum(h, payload)) return {RecordStatus::ChecksumMismatch, {}};
  if (load<uint64_t>(h + kModelAt) != expect.identity.model_id) return {RecordStatus::ModelMismatch, {}};
  if (load<uint64_t>(h + kCodecAt) != expect.identity.codec_hash) return {RecordStatus::CodecMismatch, {}};
  if (std::memcmp(h + kKeyAt, expect.key.bytes.data(), BlockKey::kBytes) != 0) return {RecordStatus::KeyMismatch, {}};
  if (expect.payload_bytes != 0 && payload_bytes != expect.payload_bytes) return {RecordStatus::LengthMismatch, {}};
  return {RecordStatus::Ok, payload};
}

}  // namespace kvserve
