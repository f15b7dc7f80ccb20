#include "util/page_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "util/error.h"

namespace kvserve {

PageArena::PageArena(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) fail("cannot reserve {} bytes for the KV cache: {}", bytes, std::strerror(errno));
  data_ = static_cast<uint8_t*>(p);
}

PageArena::~PageArena() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

PageArena::PageArena(PageArena&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

PageArena& PageArena::operator=(PageArena&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  return *this;
}

}  // namespace kvserve
