// A read-only memory map of a whole file. Checkpoints are mmap'd so weights
// are paged in on demand and shared between processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvserve {

class MappedFile {
 public:
  // Throws kvserve::Error if the file cannot be opened or mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }  // in bytes
  const std::string& path() const { return path_; }

  // Drops the whole pages inside [p, p + bytes) from this process's resident
  // memory (the file is unchanged; a later read pages them back in). For
  // data the process now holds a copy of.
  static void release(const void* p, size_t bytes);

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvserve
