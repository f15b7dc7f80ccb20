#include "store/disk_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>

#include "util/error.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSuffix = ".kvb";

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

timespec to_timespec(int64_t ns) { return timespec{time_t(ns / 1000000000), long(ns % 1000000000)}; }

// Sets the file's access and modification times to `ns`.
void stamp(int fd, int64_t ns) {
  const timespec times[2] = {to_timespec(ns), to_timespec(ns)};
  (void)futimens(fd, times);  // only the LRU order after a restart depends on it
}

bool write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= size_t(w);
  }
  return true;
}

bool read_all(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r == 0) return false;  // the file shrank under us
    p += r;
    n -= size_t(r);
  }
  return true;
}

constexpr int kNotRegular = -2;

// Opens `path` for reading if it is a regular file: -1 with errno set when it
// cannot be opened, kNotRegular when it is something else. O_NONBLOCK because
// a plain open of a FIFO waits for a writer forever (on the engine thread);
// on a regular file the flag changes nothing. A socket cannot be opened at
// all (ENXIO): it is something else too.
int open_regular(const char* path) {
  const int fd = ::open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return errno == ENXIO ? kNotRegular : -1;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return kNotRegular;
  }
  return fd;
}

}  // namespace

DiskStore::DiskStore(const DiskStoreOptions& options) : KvStore("disk:" + options.dir), options_(options) {
  if (options.dir.empty()) fail("the disk tier needs a directory");
  if (options.budget_bytes <= 0) fail("the disk tier needs a positive byte budget, got {}", options.budget_bytes);
  std::error_code ec;
  fs::create_directories(fs::path(options.dir) / "tmp", ec);
  if (ec) fail("cannot create the disk tier directory {}: {}", options.dir, ec.message());
  const std::string lock_path = (fs::path(options.dir) / "LOCK").string();
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) fail("cannot open {}: {}", lock_path, std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(lock_fd_);
    if (err == EWOULDBLOCK) fail("the disk tier directory {} is in use by another kvserve process", options.dir);
    fail("cannot lock {}: {}", lock_path, std::strerror(err));
  }
  try {
    open_index();
  } catch (...) {
    ::close(lock_fd_);
    throw;
  }
}

DiskStore::~DiskStore() { ::close(lock_fd_); }

std::optional<std::string> DiskStore::kept_secret() {
  const fs::path path = fs::path(options_.dir) / "tenant.secret";
  auto read = [&]() -> std::optional<std::string> {
    const int fd = open_regular(path.c_str());
    // Only a missing secret is made anew: one that cannot be read would be
    // replaced, and replicas sharing this directory would lose their shared
    // salts without a word.
    if (fd == kNotRegular)
      fail("{} is not a regular file; remove it to have a new secret made", path.string());
    if (fd < 0 && errno != ENOENT) fail("cannot read {}: {}", path.string(), std::strerror(errno));
    if (fd < 0) return std::nullopt;
    char buf[64];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    ::close(fd);
    if (n < 16) fail("{} holds {} bytes; remove it to have a new secret made", path.string(), std::max<ssize_t>(n, 0));
    return std::string(buf, size_t(n));
  };
  if (std::optional<std::string> s = read()) return s;
  // Written under tmp/ and renamed: a reader never sees a partial secret.
  std::random_device rd;
  std::string secret;
  for (int i = 0; i < 32; ++i) secret.push_back(char(rd() & 0xff));
  const fs::path tmp = fs::path(options_.dir) / "tmp" / "tenant.secret";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail("cannot create {}: {}", tmp.string(), std::strerror(errno));
  const bool written = ::write(fd, secret.data(), secret.size()) == ssize_t(secret.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!written || ::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot write {}: {}", path.string(), std::strerror(errno));
  return secret;
}

std::string DiskStore::path_of(const BlockKey& key) const {
  const std::string hex = key.hex();
  return options_.dir + "/" + hex.substr(0, 2) + "/" + hex + std::string(kSuffix);
}

void DiskStore::open_index() {
  const fs::path root(options_.dir);
  std::error_code ec;
  // A crash mid-write leaves only temporary files; none of them is a block.
  for (const auto& entry : fs::directory_iterator(root / "tmp", ec)) fs::remove(entry.path(), ec);

  struct Found {
    int64_t mtime_ns;
    BlockKey key;
    uint64_t bytes;
  };
  std::vector<Found> found;
  fs::directory_iterator top(root, ec);
  if (ec) fail("cannot read {}: {}", root.string(), ec.message());
  for (const auto& sub_entry : top) {
    // Fan-out directories are created on first use: "00" to "ff".
    const std::string sub = sub_entry.path().filename().string();
    if (sub.size() != 2 || !std::isxdigit(static_cast<unsigned char>(sub[0])) ||
        !std::isxdigit(static_cast<unsigned char>(sub[1])) || !sub_entry.is_directory(ec))
      continue;
    fs::directory_iterator it(sub_entry.path(), ec);
    if (ec) fail("cannot read {}: {}", sub_entry.path().string(), ec.message());
    for (const auto& entry : it) {
      const std::string name = entry.path().filename().string();
      if (name.size() != 2 * BlockKey::kBytes + kSuffix.size() || !name.ends_with(kSuffix)) continue;
      const auto key = BlockKey::from_hex(std::string_view(name).substr(0, 2 * BlockKey::kBytes));
      if (!key || key->hex().substr(0, 2) != sub) continue;
      struct stat st;
      if (::stat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      found.push_back({int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec, *key, uint64_t(st.st_size)});
    }
  }
  // Oldest first, so the newest ends up most recently used; ties by key keep
  // the order deterministic.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.mtime_ns != b.mtime_ns ? a.mtime_ns < b.mtime_ns : a.key < b.key;
  });
  int64_t newest = 0;
  std::lock_guard lock(mu_);
  for (const Found& f : found) {
    index_.insert(f.key, FileInfo{}, f.bytes);
    newest = std::max(newest, f.mtime_ns);
  }
  last_stamp_ns_.store(newest);
  // The budget may have shrunk since the last run.
  while (index_.bytes() > uint64_t(options_.budget_bytes)) {
    const auto victim = index_.pop_lru();
    ::unlink(path_of(victim->key).c_str());
    counters().add(counters().evictions, 1);
  }
}

int64_t DiskStore::next_stamp() {
  int64_t prev = last_stamp_ns_.load();
  int64_t next;
  do {
    next = std::max(wall_ns(), prev + 1);
  } while (!last_stamp_ns_.compare_exchange_weak(prev, next));
  return next;
}

bool DiskStore::put_one(const BlockKey& key, ByteView value) {
  const std::string tmp = fmt::format("{}/tmp/{}.{}.{}", options_.dir, key.hex(), ::getpid(), temp_counter_++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == ENOENT) {
    // The directory was removed under the running server: make it again, or
    // every later write would fail until a restart.
    std::error_code ec;
    fs::create_directories(fs::path(options_.dir) / "tmp", ec);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  }
  if (fd < 0) return false;
  bool ok = write_all(fd, value.data(), value.size());
  if (ok && options_.sync) ok = ::fdatasync(fd) == 0;
  if (ok) stamp(fd, next_stamp());
  ok = (::close(fd) == 0) && ok;
  if (!ok) {
    ::unlink(tmp.c_str());
    return false;
  }
  const std::string path = path_of(key);
  uint64_t evicted = 0;
  {
    std::lock_guard lock(mu_);
    index_.erase(key);
    while (index_.bytes() + value.size() > uint64_t(options_.budget_bytes)) {
      const auto victim = index_.pop_lru();
      ::unlink(path_of(victim->key).c_str());
      ++evicted;
    }
    bool renamed = ::rename(tmp.c_str(), path.c_str()) == 0;
    if (!renamed && errno == ENOENT) {
      // The key's fan-out directory does not exist yet.
      (void)::mkdir(fs::path(path).parent_path().c_str(), 0755);
      renamed = ::rename(tmp.c_str(), path.c_str()) == 0;
    }
    if (!renamed && (errno == EISDIR || errno == ENOTEMPTY || errno == EEXIST)) {
      // A directory under the block's name (the start-up scan skips it): the
      // store owns every block name, so clear it rather than fail every write.
      std::error_code ec;
      fs::remove_all(path, ec);
      renamed = ::rename(tmp.c_str(), path.c_str()) == 0;
    }
    if (!renamed) {
      // Keep the directory in step with the index: the key is absent from both.
      ::unlink(tmp.c_str());
      ::unlink(path.c_str());
      ok = false;
    } else {
      index_.insert(key, FileInfo{}, value.size());
    }
  }
  counters().add(counters().evictions, evicted);
  return ok;
}

std::vector<bool> DiskStore::do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                    const ChainTag&) {
  std::vector<bool> stored(keys.size(), false);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (values[i].size() > uint64_t(options_.budget_bytes)) {
      counters().add(counters().rejected, 1);
      continue;
    }
    stored[i] = put_one(keys[i], values[i]);
    if (!stored[i]) counters().add(counters().errors, 1);
  }
  return stored;
}

std::optional<Bytes> DiskStore::read_one(const BlockKey& key) {
  const std::string path = path_of(key);
  const int fd = open_regular(path.c_str());
  if (fd == kNotRegular) {
    // A FIFO, directory or device under a block's name holds no block, and
    // would fail every read after this one: forget it and clear the name.
    // The check under mu_ spares a block a concurrent put has just renamed
    // into place.
    counters().add(counters().errors, 1);
    std::lock_guard lock(mu_);
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      index_.erase(key);
      std::error_code ec;
      fs::remove_all(path, ec);
    }
    return std::nullopt;
  }
  if (fd < 0) {
    if (errno != ENOENT) {
      counters().add(counters().errors, 1);
      return std::nullopt;
    }
    // Evicted between the index lookup and the open (a plain miss), or deleted
    // by someone else: then forget it too. The check under mu_ spares a block
    // a concurrent put has just renamed into place.
    std::lock_guard lock(mu_);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) index_.erase(key);
    return std::nullopt;
  }
  std::optional<Bytes> out;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size >= 0 && st.st_size <= options_.budget_bytes) {
    Bytes data(size_t(st.st_size));
    if (read_all(fd, data.data(), data.size())) out = std::move(data);
  }
  if (!out) counters().add(counters().errors, 1);
  else if (options_.touch_on_read) stamp(fd, next_stamp());
  ::close(fd);
  return out;
}

std::vector<std::optional<Bytes>> DiskStore::do_get(std::span<const BlockKey> keys, const ChainTag&,
                                                    bool leading_only) {
  std::vector<std::optional<Bytes>> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    bool present;
    {
      std::lock_guard lock(mu_);
      present = index_.touch(keys[i]) != nullptr;
    }
    if (present) out[i] = read_one(keys[i]);
    if (!out[i] && leading_only) break;
  }
  return out;
}

std::vector<bool> DiskStore::do_contains(std::span<const BlockKey> keys, const ChainTag&) {
  std::vector<bool> out(keys.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) out[i] = index_.contains(keys[i]);
  return out;
}

void DiskStore::do_remove(std::span<const BlockKey> keys, const ChainTag&) {
  std::lock_guard lock(mu_);
  for (const BlockKey& key : keys)
    if (index_.erase(key)) ::unlink(path_of(key).c_str());
}

void DiskStore::fill_resident(TierStats& out) const {
  std::lock_guard lock(mu_);
  out.resident_blocks = int64_t(index_.size());
  out.resident_bytes = int64_t(index_.bytes());
  out.capacity_bytes = options_.budget_bytes;
}

std::vector<BlockKey> DiskStore::keys_lru_first() const {
  std::vector<BlockKey> out;
  std::lock_guard lock(mu_);
  index_.for_each_lru_first([&](const auto& e) { out.push_back(e.key); });
  return out;
}

}  // namespace kvserve
