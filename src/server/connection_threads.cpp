#include "server/connection_threads.h"

namespace kvserve {

ConnectionThreads::ConnectionThreads(size_t n_threads) {
  threads_.reserve(n_threads);
  for (size_t i = 0; i < n_threads; ++i) threads_.emplace_back([this] { work(); });
}

ConnectionThreads::~ConnectionThreads() { shutdown(); }

void ConnectionThreads::enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void ConnectionThreads::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
}

bool ConnectionThreads::saturated() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_ + jobs_.size() >= threads_.size();
}

void ConnectionThreads::work() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    job();
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
  }
}

}  // namespace kvserve
