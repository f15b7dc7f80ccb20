#include "model/gguf_reader.h"

#include <fmt/ranges.h>

#include <cstring>
#include <limits>

#include "util/error.h"

namespace kvserve {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
// Caps that no real checkpoint comes near; they stop a hostile header from
// making us allocate or loop over billions of entries.
constexpr uint64_t kMaxKeyValues = 1u << 20;
constexpr uint64_t kMaxTensors = 1u << 20;
constexpr uint64_t kMaxStringBytes = 1u << 26;
constexpr uint32_t kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;
// The smallest encodings of a metadata record (empty key, type, one-byte value)
// and of a tensor record (empty name, rank, one dimension, type, offset), in
// bytes. A count whose records cannot fit in the file is rejected before the
// tensor table is reserved (about 100 bytes per entry) from it.
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;

// A bounds-checked little-endian cursor over the mapped file.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}

  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const char* what) {
    uint64_t n = read<uint64_t>(what);
    if (n > kMaxStringBytes) fail("{}: {} length {} is implausible (corrupt file?)", path_, what, n);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), size_t(n));
    pos_ += n;
    return s;
  }

  // REQUIRES: the caller checked that count elements of elem_bytes each fit.
  void need(uint64_t bytes, const char* what) const {
    if (bytes > size_ - pos_) fail("{}: truncated while reading {} (offset {})", path_, what, pos_);
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

size_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    default: return 0;
  }
}

bool is_integer(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64: return true;
    default: return false;
  }
}

// Reads one scalar of type t; integers are widened to int64 (U64 beyond
// int64's range keeps its uint64 value), floats to double.
std::variant<int64_t, uint64_t, double, bool> read_scalar(Cursor& c, GgufType t) {
  switch (t) {
    case GgufType::U8: return int64_t(c.read<uint8_t>("u8"));
    case GgufType::I8: return int64_t(c.read<int8_t>("i8"));
    case GgufType::U16: return int64_t(c.read<uint16_t>("u16"));
    case GgufType::I16: return int64_t(c.read<int16_t>("i16"));
    case GgufType::U32: return int64_t(c.read<uint32_t>("u32"));
    case GgufType::I32: return int64_t(c.read<int32_t>("i32"));
    case GgufType::U64: {
      uint64_t v = c.read<uint64_t>("u64");
      if (v > uint64_t(std::numeric_limits<int64_t>::max())) return v;
      return int64_t(v);
    }
    case GgufType::I64: return c.read<int64_t>("i64");
    case GgufType::F32: return double(c.read<float>("f32"));
    case GgufType::F64: return c.read<double>("f64");
    case GgufType::BOOL: return c.read<uint8_t>("bool") != 0;
    default: return int64_t(0);
  }
}

GgufValue read_value(Cursor& c, GgufType type, const std::string& key, const std::string& path) {
  GgufValue v;
  v.type = type;
  if (type == GgufType::STRING) {
    v.value = c.read_string("metadata string");
    return v;
  }
  if (type == GgufType::ARRAY) {
    auto et = GgufType(c.read<uint32_t>("array type"));
    uint64_t n = c.read<uint64_t>("array length");
    v.element_type = et;
    if (et == GgufType::STRING) {
      // Each string needs at least its 8-byte length.
      if (n > c.remaining() / 8) fail("{}: array '{}' claims {} strings, more than the file holds", path, key, n);
      std::vector<std::string> out;
      out.reserve(size_t(n));
      for (uint64_t i = 0; i < n; ++i) out.push_back(c.read_string("array string"));
      v.value = std::move(out);
      return v;
    }
    size_t eb = scalar_bytes(et);
    if (eb == 0) fail("{}: array '{}' has unsupported element type {}", path, key, uint32_t(et));
    if (n > c.remaining() / eb) fail("{}: array '{}' claims {} elements, more than the file holds", path, key, n);
    if (is_integer(et) || et == GgufType::BOOL) {
      std::vector<int64_t> out(static_cast<size_t>(n));
      for (auto& x : out) {
        auto s = read_scalar(c, et);
        if (auto* i = std::get_if<int64_t>(&s)) x = *i;
        else if (auto* b = std::get_if<bool>(&s)) x = *b ? 1 : 0;
        else x = int64_t(std::get<uint64_t>(s));
      }
      v.value = std::move(out);
    } else {
      std::vector<double> out(static_cast<size_t>(n));
      for (auto& x : out) x = std::get<double>(read_scalar(c, et));
      v.value = std::move(out);
    }
    return v;
  }
  if (scalar_bytes(type) == 0) fail("{}: metadata '{}' has unknown type {}", path, key, uint32_t(type));
  auto s = read_scalar(c, type);
  std::visit([&](auto x) { v.value = x; }, s);
  return v;
}

// Bytes of a tensor of `elements` values of ggml type t; 0 for types kvserve
// cannot read. REQUIRES: elements is a multiple of the type's block.
uint64_t ggml_bytes(uint32_t t, uint64_t elements) {
  const GgmlBlock block = ggml_block(t);
  return block.values == 0 ? 0 : elements / uint64_t(block.values) * uint64_t(block.bytes);
}

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::STRING: return "string";
    case GgufType::ARRAY: return "array";
    case GgufType::F32: case GgufType::F64: return "float";
    case GgufType::BOOL: return "bool";
    default: return "integer";
  }
}

}  // namespace

std::optional<WeightType> weight_type_from_ggml(uint32_t ggml_type) {
  switch (GgmlType(ggml_type)) {
    case GgmlType::F32: return WeightType::F32;
    case GgmlType::F16: return WeightType::F16;
    case GgmlType::Q8_0: return WeightType::Q8_0;
    case GgmlType::Q4_0: return WeightType::Q4_0;
    default: return std::nullopt;
  }
}

bool has_gguf_magic(const uint8_t* data, size_t size) {
  uint32_t magic = 0;
  if (size >= sizeof magic) std::memcpy(&magic, data, sizeof magic);
  return magic == kGgufMagic;
}

bool has_gguf_magic(const std::string& path) {
  const MappedFile file(path);
  return has_gguf_magic(file.data(), file.size());
}

GgufFile::GgufFile(const std::string& path) : file_(std::make_unique<MappedFile>(path)) {
  Cursor c(file_->data(), file_->size(), path);
  if (!has_gguf_magic(file_->data(), file_->size())) fail("{}: not a GGUF file (bad magic)", path);
  (void)c.read<uint32_t>("magic");  // past it
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) fail("{}: unsupported GGUF version {} (need 2 or 3)", path, version_);
  uint64_t n_tensors = c.read<uint64_t>("tensor count");
  uint64_t n_kv = c.read<uint64_t>("metadata count");
  if (n_tensors > kMaxTensors || n_tensors > c.remaining() / kMinTensorInfoBytes)
    fail("{}: tensor count {} is implausible for a file of {} bytes", path, n_tensors, file_->size());
  if (n_kv > kMaxKeyValues || n_kv > c.remaining() / kMinKeyValueBytes)
    fail("{}: metadata count {} is implausible for a file of {} bytes", path, n_kv, file_->size());

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string("metadata key");
    auto type = GgufType(c.read<uint32_t>("metadata type"));
    if (metadata_.count(key)) fail("{}: duplicate metadata key '{}'", path, key);
    metadata_[key] = read_value(c, type, key, path);
  }

  uint64_t alignment = uint64_t(get_int_or("general.alignment", kDefaultAlignment));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    fail("{}: general.alignment {} is not a power of two", path, alignment);
  // The GGUF spec requires a multiple of 8; smaller ones would leave F32 and
  // F16 tensors misaligned for the kernels that read them in place.
  if (alignment % 8 != 0) fail("{}: general.alignment {} is not a multiple of 8", path, alignment);

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = c.read_string("tensor name");
    uint32_t n_dims = c.read<uint32_t>("tensor rank");
    if (n_dims == 0 || n_dims > kMaxDims) fail("{}: tensor '{}' has rank {}", path, t.name, n_dims);
    uint64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = c.read<uint64_t>("tensor dimension");
      if (ne == 0 || ne > (uint64_t(1) << 40)) fail("{}: tensor '{}' has an implausible dimension {}", path, t.name, ne);
      if (elements > (uint64_t(1) << 40) / ne)
        fail("{}: tensor '{}' has more than 2^40 elements ({} so far, then a dimension of {})", path, t.name, elements, ne);
      elements *= ne;
      t.dims.push_back(int64_t(ne));
    }
    t.ggml_type = c.read<uint32_t>("tensor type");
    t.offset = c.read<uint64_t>("tensor offset");
    // Blocks never straddle rows: a row must hold whole blocks (32 values,
    // 256 for a K-quant's super-blocks).
    const int64_t block_values = ggml_block(t.ggml_type).values;
    if (block_values > 1 && t.dims[0] % block_values != 0)
      fail("{}: tensor '{}' is {} but its row of {} values is not a multiple of {}{}", path, t.name,
           ggml_type_label(t.ggml_type), t.dims[0], block_values,
           block_values == kSuperBlock ? " (a K-quant super-block)" : "");
    t.bytes = ggml_bytes(t.ggml_type, elements);
    if (tensor_index_.count(t.name)) fail("{}: duplicate tensor '{}'", path, t.name);
    tensor_index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  for (auto& t : tensors_) {
    if (t.offset % alignment != 0) fail("{}: tensor '{}' offset {} is not aligned", path, t.name, t.offset);
    // Unsupported types have no known size; they are rejected only when used.
    if (t.bytes == 0) continue;
    if (data_start > file_->size() || t.offset > file_->size() - data_start ||
        t.bytes > file_->size() - data_start - t.offset)
      fail("{}: tensor '{}' lies past the end of the file (truncated?)", path, t.name);
    t.data = file_->data() + data_start + t.offset;
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail("{}: missing metadata '{}'", path(), key);
  if (auto* i = std::get_if<int64_t>(&v->value)) return *i;
  if (std::get_if<uint64_t>(&v->value)) fail("{}: metadata '{}' is out of range", path(), key);
  fail("{}: metadata '{}' is a {}, expected an integer", path(), key, gguf_type_name(v->type));
}

int64_t GgufFile::get_int_or(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double GgufFile::get_float_or(const std::string& key, double fallback) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return fallback;
  if (auto* d = std::get_if<double>(&v->value)) return *d;
  if (auto* i = std::get_if<int64_t>(&v->value)) return double(*i);
  fail("{}: metadata '{}' is a {}, expected a number", path(), key, gguf_type_name(v->type));
}

bool GgufFile::get_bool_or(const std::string& key, bool fallback) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return fallback;
  if (auto* b = std::get_if<bool>(&v->value)) return *b;
  fail("{}: metadata '{}' is a {}, expected a bool", path(), key, gguf_type_name(v->type));
}

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail("{}: missing metadata '{}'", path(), key);
  if (auto* s = std::get_if<std::string>(&v->value)) return *s;
  fail("{}: metadata '{}' is a {}, expected a string", path(), key, gguf_type_name(v->type));
}

std::string GgufFile::get_string_or(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

const std::vector<std::string>& GgufFile::get_string_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail("{}: missing metadata '{}'", path(), key);
  if (auto* a = std::get_if<std::vector<std::string>>(&v->value)) return *a;
  fail("{}: metadata '{}' is not an array of strings", path(), key);
}

const std::vector<double>& GgufFile::get_float_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail("{}: missing metadata '{}'", path(), key);
  if (auto* a = std::get_if<std::vector<double>>(&v->value)) return *a;
  fail("{}: metadata '{}' is not an array of floats", path(), key);
}

const std::vector<int64_t>& GgufFile::get_int_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail("{}: missing metadata '{}'", path(), key);
  if (auto* a = std::get_if<std::vector<int64_t>>(&v->value)) return *a;
  fail("{}: metadata '{}' is not an array of integers", path(), key);
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::matrix_tensor(const std::string& name, int64_t rows, int64_t cols) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (t == nullptr) fail("{}: missing tensor '{}'", path(), name);
  if (!ggml_load_type(t->ggml_type, false))
    fail("{}: tensor '{}' has unsupported type {} (kvserve reads {})", path(), name, ggml_type_label(t->ggml_type),
         ggml_readable_types());
  if (t->dims.size() != 2 || t->dims[0] != cols || t->dims[1] != rows) {
    // GGUF lists dims innermost first; a matrix written in the other order
    // shows as the expected dims swapped.
    const bool transposed = t->dims.size() == 2 && t->dims[0] == rows && t->dims[1] == cols;
    fail("{}: tensor '{}' has shape [{}], expected [{}, {}]{}", path(), name, fmt::join(t->dims, ", "), cols, rows,
         transposed ? ": it appears transposed" : "");
  }
  return *t;
}

WeightMatrix GgufFile::matrix(const std::string& name, int64_t rows, int64_t cols) const {
  const GgufTensorInfo& t = matrix_tensor(name, rows, cols);
  const auto type = weight_type_from_ggml(t.ggml_type);
  if (!type)
    fail("{}: tensor '{}' is {}, which is converted at load (Model::load), not read in place", path(), name,
         ggml_type_label(t.ggml_type));
  return WeightMatrix{*type, t.data, rows, cols};
}

const float* GgufFile::vector_f32(const std::string& name, int64_t n) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (t == nullptr) fail("{}: missing tensor '{}'", path(), name);
  if (t->ggml_type != uint32_t(GgmlType::F32))
    fail("{}: tensor '{}' must be F32, not {}", path(), name, ggml_type_label(t->ggml_type));
  if (t->dims.size() != 1 || t->dims[0] != n)
    fail("{}: tensor '{}' has shape [{}], expected [{}]", path(), name, fmt::join(t->dims, ", "), n);
  return reinterpret_cast<const float*>(t->data);
}

}  // namespace kvserve
