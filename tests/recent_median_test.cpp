// RecentMedian: the median of the last kWindow samples, so one outlier among
// them does not move it and a sustained change does.
#include "util/recent_median.h"

#include <gtest/gtest.h>

namespace kvserve {
namespace {

TEST(RecentMedian, IsTheMedianOfTheSamplesSoFar) {
  RecentMedian m;
  EXPECT_EQ(m.value(), 0);
  m.add(5);
  EXPECT_EQ(m.value(), 5);
  m.add(1);
  EXPECT_EQ(m.value(), 3);  // even count: mean of the middle two
  m.add(9);
  EXPECT_EQ(m.value(), 5);
  m.add(2);
  EXPECT_EQ(m.value(), 3.5);
  EXPECT_EQ(m.count(), 4u);
}

TEST(RecentMedian, OneOutlierDoesNotMoveItAndASustainedChangeDoes) {
  RecentMedian m;
  for (int i = 0; i < 20; ++i) m.add(0.005);
  m.add(1.0);  // one descheduled lookup
  EXPECT_EQ(m.value(), 0.005);
  for (size_t i = 1; i < RecentMedian::kWindow / 2; ++i) m.add(1.0);
  EXPECT_EQ(m.value(), 0.005);  // 4 of 9: still a minority of the window
  m.add(1.0);
  EXPECT_EQ(m.value(), 1.0);    // 5 of 9: now most of it
  EXPECT_EQ(m.count(), RecentMedian::kWindow);
  for (size_t i = 0; i < RecentMedian::kWindow; ++i) m.add(0.25);
  EXPECT_EQ(m.value(), 0.25);   // the old samples are gone
}

}  // namespace
}  // namespace kvserve
