#include "util/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "util/error.h"

namespace kvserve {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer forever;
  // the check below refuses it. (No effect on reading a regular file.)
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'{}' is not a regular file", path);
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail("cannot map '{}': {}", path, std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

void MappedFile::release(const void* p, size_t bytes) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (uintptr_t(p) + page - 1) / page * page;
  const uintptr_t end = (uintptr_t(p) + bytes) / page * page;
  // Advice only: failure leaves the pages resident, which is harmless.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace kvserve
