// A large zeroed byte region reserved with an anonymous mmap: address space is
// set aside up front, but a page costs memory only once it is written. The KV
// cache reserves its whole budget this way, so an idle pool costs nothing and
// the resident size tracks the blocks actually used.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvserve {

class PageArena {
 public:
  PageArena() = default;
  // Throws kvserve::Error when the address space cannot be reserved.
  explicit PageArena(size_t bytes);
  ~PageArena();
  PageArena(PageArena&& o) noexcept;
  PageArena& operator=(PageArena&& o) noexcept;
  PageArena(const PageArena&) = delete;
  PageArena& operator=(const PageArena&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }  // in bytes

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvserve
