#include "server/event_queue.h"

namespace kvserve {

void EventQueue::push(const RequestEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(event);
  }
  cv_.notify_one();
}

bool EventQueue::pop_all(std::vector<RequestEvent>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  for (RequestEvent& e : events_) out->push_back(std::move(e));
  events_.clear();
  return true;
}

}  // namespace kvserve
