// The disk tier: exact bytes back, LRU eviction order under the byte budget
// (files gone with their blocks), a restarted store finds its blocks in the
// same LRU order, one process per directory, and write failures (a file-size
// limit) or something not a regular file under a block's name cost only the
// block.
#include "store/disk_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "test_support.h"
#include "util/error.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;

BlockKey key_of(uint64_t n) {
  uint8_t b[16] = {};
  std::memcpy(b, &n, 8);
  b[15] = uint8_t(n * 37);  // spreads keys over the fan-out directories
  return BlockKey::from_bytes(b);
}

Bytes block_of(size_t n, uint8_t fill) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(fill * 3 + i);
  return b;
}

std::vector<BlockKey> keys_of(std::initializer_list<uint64_t> ids) {
  std::vector<BlockKey> out;
  for (uint64_t id : ids) out.push_back(key_of(id));
  return out;
}

size_t put_blocks(KvStore& s, std::initializer_list<uint64_t> ids, size_t bytes) {
  std::vector<Bytes> blocks;
  std::vector<ByteView> views;
  for (uint64_t id : ids) blocks.push_back(block_of(bytes, uint8_t(id)));
  for (const Bytes& b : blocks) views.push_back(b);
  return s.put(keys_of(ids), views);
}

class DiskStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "kvserve-disk-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  DiskStoreOptions options(int64_t budget) const { return {.dir = dir_ + "/tier", .budget_bytes = budget}; }

  std::string dir_;
};

TEST_F(DiskStoreTest, RoundTripsExactBytesOneFilePerBlock) {
  DiskStore s(options(1 << 20));
  EXPECT_EQ(put_blocks(s, {1, 2, 3}, 5000), 3u);
  const auto got = s.get(keys_of({1, 9, 3}));
  EXPECT_EQ(got[0], block_of(5000, 1));
  EXPECT_FALSE(got[1]);
  EXPECT_EQ(got[2], block_of(5000, 3));
  const std::string path = s.path_of(key_of(2));
  EXPECT_EQ(fs::path(path).parent_path().filename().string(), key_of(2).hex().substr(0, 2));
  EXPECT_EQ(fs::file_size(path), 5000u);
  const TierStats st = s.stats();
  EXPECT_EQ(st.name, "disk:" + dir_ + "/tier");
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.resident_blocks, 3);
  EXPECT_EQ(st.resident_bytes, 15000);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_TRUE(fs::is_empty(dir_ + "/tier/tmp"));
}

TEST_F(DiskStoreTest, EvictsLeastRecentlyUsedAndDeletesTheirFiles) {
  DiskStore s(options(3000));
  put_blocks(s, {0, 1, 2}, 1000);
  (void)s.get(keys_of({0}));
  put_blocks(s, {3}, 1000);  // evicts 1
  EXPECT_EQ(s.keys_lru_first(), keys_of({2, 0, 3}));
  EXPECT_FALSE(fs::exists(s.path_of(key_of(1))));
  put_blocks(s, {4}, 2000);  // evicts 2 and 0
  EXPECT_EQ(s.keys_lru_first(), keys_of({3, 4}));
  EXPECT_FALSE(fs::exists(s.path_of(key_of(2))));
  EXPECT_FALSE(fs::exists(s.path_of(key_of(0))));
  EXPECT_EQ(s.stats().evictions, 3u);
  EXPECT_EQ(s.stats().resident_bytes, 3000);
}

TEST_F(DiskStoreTest, RestartFindsBlocksInTheSameLruOrder) {
  std::vector<BlockKey> order;
  {
    DiskStore s(options(1 << 20));
    put_blocks(s, {0, 1, 2, 3, 4}, 700);
    (void)s.get(keys_of({1, 0}));  // reads refresh recency: 2, 3, 4, 1, 0
    order = s.keys_lru_first();
    EXPECT_EQ(order, keys_of({2, 3, 4, 1, 0}));
  }
  DiskStore s(options(1 << 20));
  EXPECT_EQ(s.keys_lru_first(), order);
  EXPECT_EQ(s.stats().resident_bytes, 3500);
  const auto got = s.get(keys_of({0, 1, 2, 3, 4}));
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(got[i], block_of(700, uint8_t(i)));
}

TEST_F(DiskStoreTest, RestartWithASmallerBudgetEvictsTheOldest) {
  {
    DiskStore s(options(1 << 20));
    put_blocks(s, {0, 1, 2, 3}, 1000);
  }
  DiskStore s(options(2500));
  EXPECT_EQ(s.keys_lru_first(), keys_of({2, 3}));
  EXPECT_FALSE(fs::exists(s.path_of(key_of(0))));
  EXPECT_EQ(s.stats().evictions, 2u);
}

TEST_F(DiskStoreTest, OpenRemovesTemporaryFilesAndIgnoresForeignFiles) {
  { DiskStore s(options(1 << 20)); }
  fs::create_directories(dir_ + "/tier/ab");
  testing_files::write_all(dir_ + "/tier/tmp/crashed.tmp", "half a block");
  testing_files::write_all(dir_ + "/tier/ab/notes.txt", "not a block");
  testing_files::write_all(dir_ + "/tier/ab/" + std::string(64, 'c') + ".kvb", "in the wrong fan-out directory");
  DiskStore s(options(1 << 20));
  EXPECT_FALSE(fs::exists(dir_ + "/tier/tmp/crashed.tmp"));
  EXPECT_TRUE(fs::exists(dir_ + "/tier/ab/notes.txt"));
  EXPECT_EQ(s.stats().resident_blocks, 0);
}

TEST_F(DiskStoreTest, OneProcessPerDirectory) {
  DiskStore s(options(1 << 20));
  testing_files::expect_error_containing([&] { DiskStore again(options(1 << 20)); }, "in use by another");
}

TEST_F(DiskStoreTest, RejectsBadOptionsAndOversizedBlocks) {
  EXPECT_THROW(DiskStore({.dir = "", .budget_bytes = 100}), Error);
  EXPECT_THROW(DiskStore(options(0)), Error);
  testing_files::write_all(dir_ + "/file", "x");
  testing_files::expect_error_containing([&] { DiskStore s({.dir = dir_ + "/file/sub", .budget_bytes = 100}); },
                                         "cannot create");
  DiskStore s(options(999));  // a tiny budget: a block of 1000 bytes can never fit
  EXPECT_EQ(put_blocks(s, {0}, 1000), 0u);
  EXPECT_EQ(s.stats().rejected, 1u);
  EXPECT_EQ(s.stats().resident_blocks, 0);
}

TEST_F(DiskStoreTest, AWriteFailureCostsOnlyThatBlock) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0}, 1000);
  // A file-size limit makes the next write fail with EFBIG, like a full disk.
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old), 0);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit limited = saved;
  limited.rlim_cur = 2000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const size_t stored = put_blocks(s, {1, 2}, 4000);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  ::sigaction(SIGXFSZ, &old, nullptr);

  EXPECT_EQ(stored, 0u);
  EXPECT_EQ(s.stats().errors, 2u);
  EXPECT_EQ(s.keys_lru_first(), keys_of({0}));
  EXPECT_TRUE(fs::is_empty(dir_ + "/tier/tmp"));  // no partial file left behind
  EXPECT_FALSE(fs::exists(s.path_of(key_of(1))));
  EXPECT_EQ(s.get(keys_of({0}))[0], block_of(1000, 0));
  EXPECT_EQ(put_blocks(s, {1}, 4000), 1u);  // the tier works again once the cause is gone
}

TEST_F(DiskStoreTest, AFileDeletedBehindItsBackIsAMissAndForgotten) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0, 1}, 100);
  fs::remove(s.path_of(key_of(0)));
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  EXPECT_EQ(s.contains(keys_of({0, 1})), (std::vector<bool>{false, true}));
  EXPECT_EQ(s.stats().errors, 0u);
  EXPECT_EQ(s.stats().resident_bytes, 100);
}

// The whole directory removed under a running store: old blocks are misses,
// new ones are written again (every write failed until a restart).
TEST_F(DiskStoreTest, ADirectoryRemovedBehindItsBackIsMadeAgain) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0, 1}, 100);
  fs::remove_all(dir_ + "/tier");
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  EXPECT_EQ(put_blocks(s, {2}, 100), 1u);
  const auto got = s.get(keys_of({2}));
  ASSERT_TRUE(got[0]);
  EXPECT_EQ(*got[0], block_of(100, 2));
}

// A FIFO under a block's name: read as a FIFO it returned 0 bytes as a hit
// (and with no writer, open(2) blocked the engine thread forever). The test
// holds the FIFO open for writing so the unfixed store fails instead of hanging.
// A Unix socket bound at path (its descriptor), or -1.
int bind_socket(const std::string& path) {
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock < 0 || path.size() >= sizeof addr.sun_path) return -1;
  std::strcpy(addr.sun_path, path.c_str());
  if (::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(sock);
    return -1;
  }
  return sock;
}

TEST_F(DiskStoreTest, AFifoUnderABlocksNameIsAnErrorAndRemoved) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0, 1}, 100);
  const std::string path = s.path_of(key_of(0));
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  const int writer = ::open(path.c_str(), O_RDWR | O_NONBLOCK);
  ASSERT_GE(writer, 0);
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  ::close(writer);
  EXPECT_EQ(s.stats().errors, 1u);
  EXPECT_FALSE(fs::exists(fs::symlink_status(path)));
  EXPECT_EQ(s.contains(keys_of({0, 1})), (std::vector<bool>{false, true}));
}

// A socket cannot even be opened (ENXIO): it failed every read and stayed.
TEST_F(DiskStoreTest, ASocketUnderABlocksNameIsAnErrorAndRemoved) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0, 1}, 100);
  const std::string path = s.path_of(key_of(0));
  fs::remove(path);
  const int sock = bind_socket(path);
  ASSERT_GE(sock, 0) << path;
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  ::close(sock);
  EXPECT_EQ(s.stats().errors, 1u);
  EXPECT_FALSE(fs::exists(fs::symlink_status(path)));
  EXPECT_EQ(s.contains(keys_of({0, 1})), (std::vector<bool>{false, true}));
}

// A directory under a block's name fails once, is removed, and the block can
// be written again (before, every read and write of it failed until cleaned
// by hand).
TEST_F(DiskStoreTest, ADirectoryUnderABlocksNameIsAnErrorOnceAndRemoved) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0}, 100);
  const std::string path = s.path_of(key_of(0));
  fs::remove(path);
  fs::create_directories(path + "/inside");
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  EXPECT_FALSE(s.get(keys_of({0}))[0]);
  EXPECT_EQ(s.stats().errors, 1u);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(put_blocks(s, {0}, 100), 1u);
  EXPECT_EQ(s.get(keys_of({0}))[0], block_of(100, 0));
}

// The start-up scan skips a directory under a block's name; writing the
// block replaces it.
TEST_F(DiskStoreTest, AWriteReplacesADirectoryUnderTheBlocksName) {
  std::string path;
  {
    DiskStore s(options(1 << 20));
    path = s.path_of(key_of(0));
  }
  fs::create_directories(path + "/inside");
  DiskStore s(options(1 << 20));
  EXPECT_EQ(put_blocks(s, {0}, 100), 1u);
  EXPECT_EQ(s.get(keys_of({0}))[0], block_of(100, 0));
  EXPECT_EQ(s.stats().errors, 0u);
}

// tenant.secret as a FIFO is refused with its name (a plain open waited for
// a writer forever). The test writes into the FIFO so the unfixed store reads
// those bytes as the secret instead of hanging.
TEST_F(DiskStoreTest, ASecretThatIsNoRegularFileIsRefused) {
  DiskStore s(options(1 << 20));
  const std::string path = dir_ + "/tier/tenant.secret";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const int writer = ::open(path.c_str(), O_RDWR | O_NONBLOCK);
  ASSERT_GE(writer, 0);
  ASSERT_EQ(::write(writer, "0123456789abcdef0123", 20), 20);
  try {
    (void)s.kept_secret();
    ADD_FAILURE() << "a FIFO was read as the secret";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tenant.secret is not a regular file"), std::string::npos) << e.what();
  }
  ::close(writer);
}

// A socket cannot be opened (ENXIO): it was taken for a missing secret and
// replaced by a new one.
TEST_F(DiskStoreTest, ASecretThatIsASocketIsRefusedNotReplaced) {
  DiskStore s(options(1 << 20));
  const std::string path = dir_ + "/tier/tenant.secret";
  const int sock = bind_socket(path);
  ASSERT_GE(sock, 0);
  try {
    (void)s.kept_secret();
    ADD_FAILURE() << "a socket was taken for a missing secret";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tenant.secret is not a regular file"), std::string::npos) << e.what();
  }
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));  // still there, not renamed over
  ::close(sock);
}

TEST_F(DiskStoreTest, RemoveDeletesFiles) {
  DiskStore s(options(1 << 20));
  put_blocks(s, {0, 1}, 100);
  s.remove(keys_of({0}));
  EXPECT_FALSE(fs::exists(s.path_of(key_of(0))));
  EXPECT_EQ(s.contains(keys_of({0, 1})), (std::vector<bool>{false, true}));
}

}  // namespace
}  // namespace kvserve
