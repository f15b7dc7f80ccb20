#include "util/page_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "util/error.h"

namespace kvserve {

namespace {
constexpr size_t kHugePageMinBytes = size_t(16) << 20;  // smaller ones: at most 2 MiB over, relatively too much
}  // namespace

PageArena::PageArena(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) fail("cannot reserve {} bytes for the KV cache: {}", bytes, std::strerror(errno));
  data_ = static_cast<uint8_t*>(p);
  // Large arenas ask for transparent huge pages: a KV block's first write
  // then faults once per 2 MiB instead of once per 4 KiB. Faults dominate the
  // cost of a fresh block in a VM (~3 ms per 16-token block of a 400M model,
  // about 200 faults). Resident size still tracks use, in 2 MiB steps.
  if (bytes >= kHugePageMinBytes) ::madvise(p, bytes, MADV_HUGEPAGE);  // advice: failure is harmless
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
