// libFuzzer target for the KV store's block records (src/store/block_record):
// every input is decoded as a record, once against a fixed expectation and
// once against the expectation its own header states (so inputs reach the
// length and checksum checks); then the input is wrapped as a payload,
// which must decode back exactly, and a byte of the record chosen by the
// input is changed, which must be refused. A crash, a sanitizer report, an
// accepted damaged record or a payload view outside the input is a bug. See
// fuzz/README.md.
//
// Built with -DKVSERVE_FUZZ_WRITE_SEEDS the same file writes the seed corpus:
// valid records of a few sizes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "store/block_record.h"

namespace kvserve {
namespace {

const RecordIdentity kIdentity{0x5107, 0xc0dec};

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "block_record_fuzz: %s\n", what);
  std::abort();
}

// The payload view of an accepted record must be its tail.
void check_view(ByteView record, const DecodedRecord& d) {
  if (d.status != RecordStatus::Ok) {
    if (!d.payload.empty()) bug("a refused record returned a payload");
    return;
  }
  if (d.payload.data() != record.data() + kRecordHeaderBytes || d.payload.size() != record.size() - kRecordHeaderBytes)
    bug("the payload view is not the record's tail");
}

}  // namespace
}  // namespace kvserve

#ifndef KVSERVE_FUZZ_WRITE_SEEDS

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvserve;
  const ByteView input(data, size);
  check_view(input, decode_record(input, RecordExpectation{kIdentity, BlockKey{}, 0}));
  if (size >= kRecordHeaderBytes) {
    RecordExpectation own;
    std::memcpy(&own.identity.codec_hash, data + 8, 8);
    std::memcpy(&own.identity.model_id, data + 16, 8);
    std::memcpy(own.key.bytes.data(), data + 24, BlockKey::kBytes);
    std::memcpy(&own.payload_bytes, data + 56, 8);
    check_view(input, decode_record(input, own));
  }

  const BlockKey key = BlockKey::from_bytes(input.first(std::min<size_t>(size, BlockKey::kBytes)));
  Bytes record = encode_record(kIdentity, key, input);
  const RecordExpectation expect{kIdentity, key, size};
  const DecodedRecord d = decode_record(record, expect);
  if (d.status != RecordStatus::Ok) bug("a fresh record was refused");
  check_view(record, d);
  if (!std::equal(d.payload.begin(), d.payload.end(), input.begin(), input.end())) bug("the payload changed");
  if (size > 0) {
    const size_t at = size_t(data[0]) * 257 % record.size();
    record[at] ^= uint8_t(data[size - 1] | 1);
    if (decode_record(record, expect).status == RecordStatus::Ok) bug("a damaged record was accepted");
  }
  return 0;
}

#else  // KVSERVE_FUZZ_WRITE_SEEDS

int main(int argc, char** argv) {
  using namespace kvserve;
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " OUT_DIR\n";
    return 2;
  }
  const std::filesystem::path out(argv[1]);
  std::filesystem::create_directories(out);
  for (size_t n : {0, 1, 72, 4480}) {
    Bytes payload(n);
    for (size_t i = 0; i < n; ++i) payload[i] = uint8_t(i * 7);
    const Bytes record = encode_record(kIdentity, BlockKey::from_bytes(ByteView(payload).first(std::min<size_t>(n, 32))), payload);
    std::ofstream f(out / ("record_" + std::to_string(n)), std::ios::binary);
    f.write(reinterpret_cast<const char*>(record.data()), std::streamsize(record.size()));
    if (!f) return 1;
  }
  return 0;
}

#endif  // KVSERVE_FUZZ_WRITE_SEEDS
