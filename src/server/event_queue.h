// Hands one request's events from the engine thread (which must never block
// on a client) to the HTTP thread serving that request.
//
// Thread safety: push from one thread, pop from another; mutex_ guards events_.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "engine/request.h"

namespace kvserve {

class EventQueue {
 public:
  // Engine thread: queues a copy of the event and wakes the reader.
  void push(const RequestEvent& event);
  // Moves every queued event into *out (appended, in order); when none is
  // queued, waits up to `timeout` for one. Returns whether any was moved.
  bool pop_all(std::vector<RequestEvent>* out, std::chrono::milliseconds timeout);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<RequestEvent> events_;  // in arrival order
};

}  // namespace kvserve
