// The threads that serve HTTP connections, for httplib's Server::new_task_queue.
//
// httplib serves a connection on one thread for as long as the client keeps
// it alive, so with more keep-alive clients than threads the extra
// connections would wait (unserved, not even refused) until another client
// goes idle for the keep-alive timeout. This pool counts the connections
// waiting for a thread; while any wait, the server answers with
// "Connection: close", so each response frees its thread for the next
// connection in line and no client is starved.
//
// Thread safety: all methods; mutex_ guards jobs_ and stopping_.
#pragma once

#include <httplib.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve {

class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t n_threads);
  ~ConnectionThreads() override;

  void enqueue(std::function<void()> fn) override;
  // Runs the queued connections to their end, then joins the threads.
  void shutdown() override;
  // Connections accepted and not yet given a thread.
  size_t waiting() const;

 private:
  void work();

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // accepted connections, oldest first
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvserve
