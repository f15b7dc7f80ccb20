// Reader for GGUF v2/v3 files (llama.cpp's checkpoint format), mmap'd.
//
// Every count, length and offset read from the file is checked against the
// file size before use, so a truncated or hostile file yields a kvserve::Error
// naming the problem, never a crash or a huge allocation.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kernels/weight_matrix.h"
#include "model/ggml_dequantize.h"
#include "util/mapped_file.h"

namespace kvserve {

// GGUF metadata value types, as numbered in the format.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};

// One metadata value. Scalars are widened; arrays keep their element type.
struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType element_type = GgufType::U8;  // for ARRAY
  std::variant<int64_t, uint64_t, double, bool, std::string,
               std::vector<int64_t>, std::vector<double>, std::vector<std::string>>
      value;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] is the innermost (contiguous) dimension
  uint32_t ggml_type = 0;
  uint64_t offset = 0;        // from the start of the data section, in bytes
  uint64_t bytes = 0;         // size of the tensor data; 0 for types kvserve cannot read
  const uint8_t* data = nullptr;  // null for types kvserve cannot read
};

// Whether bytes start with the GGUF magic; the path form maps the file
// (throws kvserve::Error when it cannot be opened).
bool has_gguf_magic(const uint8_t* data, size_t size);
bool has_gguf_magic(const std::string& path);

class GgufFile {
 public:
  // Opens, maps and parses the header, metadata and tensor table.
  // Throws kvserve::Error on any malformed content.
  explicit GgufFile(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& path() const { return file_->path(); }

  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  const GgufValue* find(const std::string& key) const;

  // Typed getters: throw kvserve::Error when the key is missing or has the
  // wrong type; the *_or forms return the fallback when the key is missing.
  int64_t get_int(const std::string& key) const;
  int64_t get_int_or(const std::string& key, int64_t fallback) const;
  double get_float_or(const std::string& key, double fallback) const;
  bool get_bool_or(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string_or(const std::string& key, const std::string& fallback) const;
  const std::vector<std::string>& get_string_array(const std::string& key) const;
  const std::vector<double>& get_float_array(const std::string& key) const;
  const std::vector<int64_t>& get_int_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

  // The tensor `name` of a (rows, cols) weight matrix; checks that its shape
  // is exactly {cols, rows} (GGUF order) and its type one kvserve reads
  // (ggml_load_type), else throws kvserve::Error naming the tensor and type.
  const GgufTensorInfo& matrix_tensor(const std::string& name, int64_t rows, int64_t cols) const;
  // The same tensor viewed in place, for types computed as stored
  // (weight_type_from_ggml); a type converted at load (ggml_needs_conversion)
  // throws: Model::load converts those.
  WeightMatrix matrix(const std::string& name, int64_t rows, int64_t cols) const;
  // A 1-D F32 tensor of exactly n values (norm weights).
  const float* vector_f32(const std::string& name, int64_t n) const;

 private:
  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Maps a ggml type to the weight type it is computed as in place; nullopt for
// types converted at load and for types kvserve cannot read.
std::optional<WeightType> weight_type_from_ggml(uint32_t ggml_type);

}  // namespace kvserve
