#include "util/thread_pool.h"

#include "util/simd.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace kvserve {

namespace {

// One step of a spin-wait. Every kYieldEvery-th step yields the core: with more
// threads than free cores (an oversubscribed pool, or other processes busy) the
// thread being waited for may be runnable but descheduled, and pure spinning
// would hold it off for a whole scheduler time slice (about 1 ms per job).
void spin_pause(int spins) {
  constexpr int kYieldEvery = 64;
  if (spins % kYieldEvery == 0) {
    std::this_thread::yield();
  } else {
    _mm_pause();
  }
}

}  // namespace

int default_thread_count() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(std::max(1, num_threads)), chunk_claims_(static_cast<size_t>(num_threads_)) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_range(int thread_index) {
  int64_t chunks = (job_n_ + job_grain_ - 1) / job_grain_;
  int64_t per = chunks / num_threads_, extra = chunks % num_threads_;
  int64_t first = thread_index * per + std::min<int64_t>(thread_index, extra);
  int64_t count = per + (thread_index < extra ? 1 : 0);
  int64_t begin = first * job_grain_;
  int64_t end = std::min(job_n_, (first + count) * job_grain_);
  if (begin < end) (*job_)(begin, end, thread_index);
}

void ThreadPool::run_range_caught(int thread_index) {
  try {
    run_range(thread_index);
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (num_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  job_ = &fn;
  job_n_ = n;
  job_grain_ = grain;
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_range_caught(0);  // a throw here must still wait: the workers read fn
  for (int spins = 1; pending_.load(std::memory_order_acquire) != 0; ++spins) spin_pause(spins);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));  // the workers are done with it
}

void ThreadPool::parallel_chunks(int64_t n, int64_t chunk,
                                 const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (num_threads_ == 1 || chunks == 1) {
    fn(0, n, 0);
    return;
  }
  // Share s is chunks [first(s), first(s + 1)); chunk_claims_[s] counts the
  // chunks of it claimed so far, by its owner or by a thread done with its
  // own share. parallel_for publishes the reset to the workers.
  const int shares = int(std::min<int64_t>(num_threads_, chunks));
  auto first = [&](int s) { return chunks * s / shares; };
  for (int s = 0; s < shares; ++s) chunk_claims_[size_t(s)].claimed.store(0, std::memory_order_relaxed);
  auto drain = [&](int s, int thread_index) {
    const int64_t begin = first(s), count = first(s + 1) - begin;
    for (int64_t c; (c = chunk_claims_[size_t(s)].claimed.fetch_add(1, std::memory_order_relaxed)) < count;) {
      const int64_t lo = (begin + c) * chunk;
      fn(lo, std::min(n, lo + chunk), thread_index);
    }
  };
  parallel_for(num_threads_, 1, [&](int64_t, int64_t, int thread_index) {
    if (thread_index >= shares) return;
    for (int k = 0; k < shares; ++k) drain((thread_index + k) % shares, thread_index);
  });
}

int64_t ThreadPool::chunk_size(int64_t n, int64_t grain) const {
  constexpr int64_t kChunksPerThread = 16;
  grain = std::max<int64_t>(1, grain);
  return std::max<int64_t>(1, n / (kChunksPerThread * num_threads_) / grain) * grain;
}

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin for a short while (a decode step issues jobs back to back), then sleep.
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    uint64_t gen;
    int spins = 0;
    while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
      spin_pause(++spins);
      if (spins % 256 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
    }
    seen = gen;
    if (stop_.load()) return;
    run_range_caught(thread_index);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace kvserve
