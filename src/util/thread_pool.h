// A fixed pool of worker threads for data-parallel kernels.
//
// parallel_for splits [0, n) into one contiguous range per thread; the calling
// thread runs range 0 itself. Decode issues ~100 parallel_for calls per token,
// so workers spin briefly on a generation counter before sleeping: waking a
// sleeping thread costs tens of microseconds, spinning costs nothing while a
// step is in flight.
//
// Thread safety: one caller at a time (the owner of the model). Not reentrant.
//
// An exception thrown by fn on any thread reaches the caller of
// parallel_for / parallel_chunks, after every thread has left fn (the
// first one thrown, if several); the job's other ranges may or may not
// have run. On a worker thread it would otherwise end the process.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means no worker threads at all.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end, thread_index) on disjoint ranges covering [0, n),
  // each range a multiple of `grain` except the last. Returns when all are done.
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t, int)>& fn);
  // The same over chunks of `chunk` items, for memory-bound loops whose
  // threads run at different speeds (cores of a shared host do): thread t
  // takes the chunks of its contiguous share in order, as parallel_for
  // would, and then those the other threads have not reached yet, so no
  // thread waits long for a slower one. Chunks run in order within each
  // share; fn sees each chunk once.
  void parallel_chunks(int64_t n, int64_t chunk,
                       const std::function<void(int64_t, int64_t, int)>& fn);
  // The chunk parallel_chunks callers use: ~16 per thread, a multiple of
  // grain and at least grain.
  int64_t chunk_size(int64_t n, int64_t grain) const;

 private:
  void worker_loop(int thread_index);
  void run_range(int thread_index);
  // run_range, keeping the first exception thrown for the caller.
  void run_range_caught(int thread_index);

  int num_threads_;
  std::vector<std::thread> workers_;

  // The current job; written by the caller before bumping generation_.
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_grain_ = 1;

  // parallel_chunks: chunks of thread t's share claimed so far, one cache
  // line each (threads claim their own share's without sharing a line).
  struct alignas(64) ChunkClaims {
    std::atomic<int64_t> claimed{0};
  };
  std::vector<ChunkClaims> chunk_claims_;

  std::atomic<uint64_t> generation_{0};  // bumped once per job
  std::atomic<int> pending_{0};          // workers still running the job
  std::atomic<bool> stop_{false};
  std::mutex error_mutex_;               // guards error_ while a job runs
  std::exception_ptr error_;             // the job's first exception; the caller reads and clears it
                                         // unlocked once pending_ (acquire) is 0: the workers are done
  std::mutex mutex_;                     // guards sleeping on wake_
  std::condition_variable wake_;
};

// The default pool size: the machine's hardware threads.
int default_thread_count();

}  // namespace kvserve
