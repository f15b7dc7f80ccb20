// Writes GGUF v3 files: metadata first, then tensor data aligned to 32 bytes.
// Used by `kvserve synth` and by tests that need checkpoints of a given shape.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/gguf_reader.h"

namespace kvserve {

class GgufWriter {
 public:
  void set_string(const std::string& key, const std::string& value);
  void set_u32(const std::string& key, uint32_t value);
  void set_f32(const std::string& key, float value);
  void set_bool(const std::string& key, bool value);
  void set_strings(const std::string& key, const std::vector<std::string>& values);
  void set_f32s(const std::string& key, const std::vector<float>& values);
  void set_i32s(const std::string& key, const std::vector<int32_t>& values);

  // dims in GGUF order (ne[0] innermost); data holds the encoded tensor bytes.
  void add_tensor(const std::string& name, std::vector<int64_t> dims, GgmlType type, std::vector<uint8_t> data);

  // Throws kvserve::Error when the file cannot be written.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    GgmlType type;
    std::vector<uint8_t> data;
  };
  std::vector<uint8_t> metadata_;  // encoded key/value records
  uint64_t n_metadata_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace kvserve
