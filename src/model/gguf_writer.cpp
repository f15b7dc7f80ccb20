#include "model/gguf_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "util/error.h"

namespace kvserve {
namespace {

constexpr uint64_t kAlignment = 32;

template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

}  // namespace

void GgufWriter::set_string(const std::string& key, const std::string& value) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::STRING));
  put_string(metadata_, value);
  ++n_metadata_;
}

void GgufWriter::set_u32(const std::string& key, uint32_t value) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::U32));
  put<uint32_t>(metadata_, value);
  ++n_metadata_;
}

void GgufWriter::set_f32(const std::string& key, float value) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::F32));
  put<float>(metadata_, value);
  ++n_metadata_;
}

void GgufWriter::set_bool(const std::string& key, bool value) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::BOOL));
  put<uint8_t>(metadata_, value ? 1 : 0);
  ++n_metadata_;
}

void GgufWriter::set_strings(const std::string& key, const std::vector<std::string>& values) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::ARRAY));
  put<uint32_t>(metadata_, uint32_t(GgufType::STRING));
  put<uint64_t>(metadata_, values.size());
  for (const auto& v : values) put_string(metadata_, v);
  ++n_metadata_;
}

void GgufWriter::set_f32s(const std::string& key, const std::vector<float>& values) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::ARRAY));
  put<uint32_t>(metadata_, uint32_t(GgufType::F32));
  put<uint64_t>(metadata_, values.size());
  for (float v : values) put<float>(metadata_, v);
  ++n_metadata_;
}

void GgufWriter::set_i32s(const std::string& key, const std::vector<int32_t>& values) {
  put_string(metadata_, key);
  put<uint32_t>(metadata_, uint32_t(GgufType::ARRAY));
  put<uint32_t>(metadata_, uint32_t(GgufType::I32));
  put<uint64_t>(metadata_, values.size());
  for (int32_t v : values) put<int32_t>(metadata_, v);
  ++n_metadata_;
}

void GgufWriter::add_tensor(const std::string& name, std::vector<int64_t> dims, GgmlType type,
                            std::vector<uint8_t> data) {
  tensors_.push_back({name, std::move(dims), type, std::move(data)});
}

void GgufWriter::write(const std::string& path) const {
  std::vector<uint8_t> head;
  put<uint32_t>(head, 0x46554747);  // "GGUF"
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, n_metadata_);
  head.insert(head.end(), metadata_.begin(), metadata_.end());
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const auto& t : tensors_) {
    put_string(head, t.name);
    put<uint32_t>(head, uint32_t(t.dims.size()));
    for (int64_t d : t.dims) put<uint64_t>(head, uint64_t(d));
    put<uint32_t>(head, uint32_t(t.type));
    put<uint64_t>(head, offset);
    offsets.push_back(offset);
    offset = (offset + t.data.size() + kAlignment - 1) / kAlignment * kAlignment;
  }
  head.resize((head.size() + kAlignment - 1) / kAlignment * kAlignment, 0);

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail("cannot write '{}': {}", path, std::strerror(errno));
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
  const std::vector<uint8_t> zeros(kAlignment, 0);
  for (size_t i = 0; ok && i < tensors_.size(); ++i) {
    const auto& data = tensors_[i].data;
    ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
    const size_t pad = (kAlignment - data.size() % kAlignment) % kAlignment;
    if (ok && i + 1 < tensors_.size()) ok = std::fwrite(zeros.data(), 1, pad, f) == pad;
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) fail("failed writing '{}' (disk full?)", path);
}

}  // namespace kvserve
