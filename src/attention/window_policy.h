// window and sinks: recency. window keeps the last `budget` tokens; sinks
// (StreamingLLM) also keeps the first S tokens of the text, the attention
// sinks every later query leans on, and the last budget - S. Both keep one
// set for every layer and head (recency does not depend on the head).
//
// sinks defaults to positions within the cache: keys are stored before RoPE
// and rotated by their slot at read time, so after eviction the kept tokens
// sit at contiguous positions 0..budget (plus at most one block of not yet
// compacted slots) whatever the length of the text, and generation runs past
// the model's context length (StreamingLLM, section 3.2).
#pragma once

#include "attention/evicting_policy.h"

namespace kvserve {

class WindowPolicy final : public EvictingPolicy {
 public:
  WindowPolicy(const SparsityOptions& options, const KvCache& cache) : EvictingPolicy(options, cache) {}

  std::string_view name() const override { return options_.policy; }

 protected:
  bool aggregated() const override { return true; }
  void choose(int row, std::span<const LiveToken> live, int32_t count, std::vector<int32_t>& out) override;
};

}  // namespace kvserve
