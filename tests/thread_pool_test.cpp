#include "util/thread_pool.h"

#include "util/aligned_buffer.h"
#include "util/memory_bandwidth.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace kvserve {
namespace {

struct Range {
  int64_t begin, end;
  int thread;
};

// Runs one parallel_for and checks its contract: every index exactly once,
// ranges disjoint, each a multiple of grain except the one that ends at n,
// thread indexes in [0, num_threads) and distinct per range.
void check_coverage(ThreadPool& pool, int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::mutex mu;
  std::vector<Range> ranges;  // guarded by mu
  pool.parallel_for(n, grain, [&](int64_t begin, int64_t end, int thread) {
    for (int64_t i = begin; i < end; ++i) hits[size_t(i)].fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    ranges.push_back({begin, end, thread});
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "n=" << n << " i=" << i;
  std::set<int> threads;
  for (const Range& r : ranges) {
    EXPECT_LT(r.begin, r.end);
    EXPECT_GE(r.thread, 0);
    EXPECT_LT(r.thread, pool.num_threads());
    EXPECT_TRUE(threads.insert(r.thread).second) << "thread " << r.thread << " ran two ranges";
    if (r.end != n) {
      EXPECT_EQ((r.end - r.begin) % std::max<int64_t>(grain, 1), 0);
    }
    EXPECT_EQ(r.begin % std::max<int64_t>(grain, 1), 0);
  }
  if (n <= 0) {
    EXPECT_TRUE(ranges.empty());
  }
}

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 5, 16, 31, 32, 33, 100, 1000, 4097})
      for (int64_t grain : {0, 1, 2, 4, 16, 32, 1000}) check_coverage(pool, n, grain);
  }
}

// parallel_chunks: every index exactly once, in chunks that start at
// multiples of `chunk` and are whole but for the one ending at n.
TEST(ThreadPool, ChunksCoverEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 3, 5, 16, 31, 33, 100, 1000, 4097})
      for (int64_t chunk : {0, 1, 2, 3, 16, 1000}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad{0};
        pool.parallel_chunks(n, chunk, [&](int64_t begin, int64_t end, int thread) {
          const int64_t c = std::max<int64_t>(chunk, 1);
          if (begin % c != 0 || (end != n && end - begin != c) || begin >= end || thread < 0 ||
              thread >= threads)
            bad.fetch_add(1);
          for (int64_t i = begin; i < end; ++i) hits[size_t(i)].fetch_add(1);
        });
        EXPECT_EQ(bad.load(), 0) << "threads=" << threads << " n=" << n << " chunk=" << chunk;
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "n=" << n << " i=" << i;
      }
  }
}

// A thread done with its own share takes chunks of a slower thread's.
TEST(ThreadPool, ChunksOfASlowThreadGoToAnIdleOne) {
  ThreadPool pool(2);
  constexpr int64_t kChunks = 16;
  std::vector<std::atomic<int>> ran_by(kChunks);
  pool.parallel_chunks(kChunks, 1, [&](int64_t begin, int64_t, int thread) {
    ran_by[size_t(begin)].store(thread);
    if (thread == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  int taken = 0;  // chunks of thread 1's share (the second half) that thread 0 ran
  for (int64_t c = kChunks / 2; c < kChunks; ++c) taken += ran_by[size_t(c)].load() == 0;
  EXPECT_GE(taken, 1);
  EXPECT_EQ(ran_by[0].load(), 0);  // thread 0 starts with its own share
}

TEST(ThreadPool, NonPositiveThreadCountMeansCallerOnly) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.num_threads(), 1);
  const auto caller = std::this_thread::get_id();
  pool.parallel_for(100, 1, [&](int64_t begin, int64_t end, int thread) {
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 100);
    EXPECT_EQ(thread, 0);
    EXPECT_EQ(std::this_thread::get_id(), caller);
  });
}

TEST(ThreadPool, CallerRunsRangeZero) {
  ThreadPool pool(3);
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> ok{false};
  pool.parallel_for(300, 1, [&](int64_t begin, int64_t, int thread) {
    if (thread == 0) ok = begin == 0 && std::this_thread::get_id() == caller;
  });
  EXPECT_TRUE(ok.load());
}

TEST(ThreadPool, ManyBackToBackJobs) {
  // Decode issues hundreds of short jobs per token; none may be lost or run twice.
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  const int kJobs = 20000;
  for (int job = 0; job < kJobs; ++job) {
    pool.parallel_for(64, 8, [&](int64_t begin, int64_t end, int) {
      total.fetch_add(end - begin, std::memory_order_relaxed);
    });
    // The results of each job are visible to the caller once parallel_for returns.
    ASSERT_EQ(total.load(std::memory_order_relaxed), int64_t(job + 1) * 64);
  }
}

TEST(ThreadPool, WritesOfWorkersAreVisibleAfterReturn) {
  ThreadPool pool(2);
  std::vector<int64_t> out(1000);
  for (int round = 0; round < 200; ++round) {
    pool.parallel_for(1000, 1, [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) out[size_t(i)] = i * round;
    });
    for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(out[size_t(i)], i * round);
  }
}

TEST(ThreadPool, WakesSleepingWorkers) {
  // Workers sleep after ~200 us without work; a job after a pause must still run on them.
  ThreadPool pool(3);
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::atomic<int> ranges{0};
    pool.parallel_for(3, 1, [&](int64_t, int64_t, int) { ranges.fetch_add(1); });
    EXPECT_EQ(ranges.load(), 3);
  }
}

TEST(ThreadPool, DestructionWhileIdle) {
  // Right after construction (workers may not have started), while spinning,
  // and while asleep.
  { ThreadPool pool(4); }
  {
    ThreadPool pool(3);
    pool.parallel_for(10, 1, [](int64_t, int64_t, int) {});
  }
  {
    ThreadPool pool(3);
    pool.parallel_for(10, 1, [](int64_t, int64_t, int) {});
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  SUCCEED();
}

// An exception thrown by a worker's range reaches the caller (on a worker
// thread it would end the process), and the pool runs jobs afterwards.
TEST(ThreadPool, AWorkersExceptionReachesTheCaller) {
  ThreadPool pool(3);
  for (int round = 0; round < 20; ++round) {
    EXPECT_THROW(pool.parallel_for(3, 1,
                                   [](int64_t begin, int64_t, int thread) {
                                     if (thread == 2) throw std::runtime_error("range " + std::to_string(begin));
                                   }),
                 std::runtime_error);
    check_coverage(pool, 100, 1);
  }
  EXPECT_THROW(pool.parallel_chunks(64, 1, [](int64_t begin, int64_t, int) {
    if (begin == 40) throw std::runtime_error("chunk 40");
  }),
               std::runtime_error);
  check_coverage(pool, 100, 7);
}

// A throw on the caller's own range returns only after the workers have left
// fn: they read it, and what it captures, until then.
TEST(ThreadPool, ACallersExceptionWaitsForTheWorkers) {
  ThreadPool pool(2);
  std::atomic<bool> worker_done{false};
  try {
    pool.parallel_for(2, 1, [&](int64_t, int64_t, int thread) {
      if (thread == 0) throw std::runtime_error("caller");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      worker_done.store(true);
    });
    ADD_FAILURE() << "nothing was thrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "caller");
    EXPECT_TRUE(worker_done.load());
  }
}

TEST(ThreadPool, DefaultThreadCountIsPositive) { EXPECT_GE(default_thread_count(), 1); }

// The bandwidth probe's read loop sums every element once, whatever the
// split between threads and the vector width (integers: exact in float).
TEST(ThreadPool, BandwidthProbeSumsEveryElement) {
  for (int threads : {1, 2, 3})
    for (size_t n : {size_t(0), size_t(1), size_t(31), size_t(64), size_t(4096 + 37), size_t(50000)}) {
      AlignedBuffer<float> buf(n == 0 ? 1 : n);
      double want = 0;
      for (size_t i = 0; i < n; ++i) want += double(buf[i] = float(i % 7));
      ThreadPool pool(threads);
      EXPECT_EQ(double(sum_buffer(pool, buf.data(), n)), want) << threads << " threads, " << n;
    }
}

}  // namespace
}  // namespace kvserve
