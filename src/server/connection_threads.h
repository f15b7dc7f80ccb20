// The threads that serve HTTP connections, for httplib's Server::new_task_queue.
//
// httplib serves a connection on one thread for as long as the client keeps
// it alive, idle or not, so with more keep-alive clients than threads the
// extra connections would wait (unserved, not even refused) until another
// client stays idle for the keep-alive timeout. This pool counts the threads
// taken and the connections waiting; the server keeps a connection alive only
// while a thread is free (saturated() false) and otherwise answers with
// "Connection: close". A connection kept alive therefore always leaves a free
// thread behind it, so some thread keeps cycling through the waiting
// connections and no client is starved.
//
// Thread safety: all methods; mutex_ guards jobs_, running_ and stopping_.
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
  // Whether every thread is taken (serving or holding an idle keep-alive
  // connection) or a connection waits for one.
  bool saturated() const;

 private:
  void work();

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // accepted connections, oldest first
  size_t running_ = 0;                      // threads serving a connection
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvserve
