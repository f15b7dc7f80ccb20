// Events cross from the engine thread to an HTTP thread in order, and a reader
// with nothing to read times out.
#include "server/event_queue.h"

#include <gtest/gtest.h>

#include <thread>

namespace kvserve {
namespace {

TEST(EventQueue, DeliversEventsInOrderAcrossThreads) {
  EventQueue q;
  std::thread engine([&] {
    for (int32_t t = 0; t < 100; ++t) {
      RequestEvent e;
      e.token = t;
      e.finish = t == 99 ? FinishReason::Length : FinishReason::None;
      q.push(e);
    }
  });
  std::vector<RequestEvent> got;
  while (got.empty() || got.back().finish == FinishReason::None) q.pop_all(&got, std::chrono::seconds(5));
  engine.join();
  ASSERT_EQ(got.size(), 100u);
  for (int32_t t = 0; t < 100; ++t) EXPECT_EQ(got[size_t(t)].token, t);
}

TEST(EventQueue, TimesOutWhenNothingArrives) {
  EventQueue q;
  std::vector<RequestEvent> got;
  EXPECT_FALSE(q.pop_all(&got, std::chrono::milliseconds(5)));
  EXPECT_TRUE(got.empty());
  RequestEvent e;
  e.text = "x";
  q.push(e);
  EXPECT_TRUE(q.pop_all(&got, std::chrono::milliseconds(0)));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].text, "x");
  EXPECT_FALSE(q.pop_all(&got, std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace kvserve
