// The local-disk tier: one file per block in one directory, under a byte
// budget, least recently used evicted first; a restarted process finds its
// blocks again.
//
// Why a file per block and not one slab file: blocks are 4 KB to 400 KB, so
// the filesystem's own allocation is efficient at that size, and it gives us
// for free what a slab would have to build: atomic replacement (write a
// temporary file, then rename(2): a reader sees the old block or the new one,
// never a torn mix), space returned on eviction (unlink, no compaction or free
// list), and a crash-safe index (the directory itself). The costs are an open
// and close per access (~10 us, small next to recomputing a block) and one
// inode per block; a two-level fan-out (up to 256 subdirectories by the
// key's first byte, created on first use) keeps directories small at
// millions of blocks.
//
// Layout under `dir`:
//   LOCK            flock(2)ed while open: one process per directory
//   tmp/            blocks being written (removed at open: a crash leaves only these)
//   ab/<key>.kvb    a block whose key's hex starts with "ab"
//
// Restart: open() indexes every <key>.kvb file and orders them by
// modification time, which the store sets itself, strictly increasing, on
// every write and (by default) every read, so the LRU order survives restarts
// exactly. Files whose names are not block keys are left alone.
//
// Durability: a block is visible only after its rename. Without `sync` a power
// loss can leave a renamed file with missing data; the record checksum (see
// block_record.h) then refuses it and the block is recomputed, so `sync` only
// trades write cost for fewer such misses after a crash.
//
// Failures (disk full, EFBIG under a file-size limit, EIO, a read-only
// directory) cost the block: it is not stored, or read as a miss, and counted
// in stats().errors; the tier keeps serving. Something other than a regular
// file under a block's name (a FIFO, a directory) is such a failure: it is
// never opened in a way that could block, and it is removed. A process that sets
// RLIMIT_FSIZE must ignore SIGXFSZ to see EFBIG instead of dying.
//
// Thread safety: all methods. mu_ guards the index, and every rename and
// unlink is made under it so the index and the directory agree; file
// contents are read and written outside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "store/kv_store.h"
#include "store/lru_index.h"

namespace kvserve {

struct DiskStoreOptions {
  std::string dir;                          // created if missing
  int64_t budget_bytes = int64_t(16) << 30; // file bytes held at most; must be > 0
  bool sync = false;                        // fdatasync each block before it becomes visible
  bool touch_on_read = true;                // a read refreshes the file's mtime (LRU order across restarts)
};

class DiskStore final : public KvStore {
 public:
  // Creates the directory layout, takes the lock, removes leftover temporary
  // files and indexes the blocks found (evicting the oldest if they exceed the
  // budget). Throws kvserve::Error when the directory cannot be created or
  // read, or another process holds it.
  explicit DiskStore(const DiskStoreOptions& options);
  ~DiskStore() override;

  // The file that holds (or would hold) the block.
  std::string path_of(const BlockKey& key) const;
  // DIR/tenant.secret: 32 random bytes written (mode 0600) the first time
  // they are asked for, then read back, so a restarted process with no
  // --tenant-secret-file salts tenants' keys as before and finds its blocks.
  std::optional<std::string> kept_secret() override;
  // Keys from least to most recently used.
  std::vector<BlockKey> keys_lru_first() const;

 private:
  struct FileInfo {};  // the index needs only the key and the size

  std::vector<bool> do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                           const ChainTag& chain) override;
  std::vector<std::optional<Bytes>> do_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                           bool leading_only) override;
  std::vector<bool> do_contains(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void do_remove(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void fill_resident(TierStats& out) const override;

  void open_index();
  bool put_one(const BlockKey& key, ByteView value);
  std::optional<Bytes> read_one(const BlockKey& key);
  // A modification time later than every one this store has set, in ns since the epoch.
  int64_t next_stamp();

  const DiskStoreOptions options_;
  int lock_fd_ = -1;
  std::atomic<uint64_t> temp_counter_{0};  // unique temporary file names
  std::atomic<int64_t> last_stamp_ns_{0};  // the latest mtime set, in ns since the epoch
  mutable std::mutex mu_;
  LruIndex<FileInfo> index_;  // guarded by mu_
};

}  // namespace kvserve
