#include "attention/window_policy.h"

namespace kvserve {

void WindowPolicy::choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) {
  // The oldest tokens after the sinks.
  const int32_t first = sink_count(live);
  for (int32_t i = 0; i < count; ++i) out.push_back(live[size_t(first + i)].slot);
}

}  // namespace kvserve
