// Faults the tests inject into a forward pass.
#pragma once

#include <string>

#include "attention/sparsity_policy.h"
#include "util/error.h"

namespace kvserve::testing_faults {

// A sparsity policy that keeps every token and throws kvserve::Error from
// on_kv at `layer`: a failure partway through a pass, after every entry's
// KV of the layers before it was written.
class ThrowingPolicy : public SparsityPolicy {
 public:
  explicit ThrowingPolicy(int layer, std::string message) : layer_(layer), message_(std::move(message)) {}
  std::string_view name() const override { return "throwing"; }
  bool wants_kv() const override { return true; }
  void on_kv(int layer, int32_t, const float*, const float*) override {
    if (layer == layer_) throw Error(message_);
  }

 private:
  int layer_;
  std::string message_;
};

}  // namespace kvserve::testing_faults
