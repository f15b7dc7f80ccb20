// Faults the tests inject into a forward pass.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>

#include "attention/sparsity_policy.h"
#include "util/error.h"

namespace kvserve::testing_faults {

// A sparsity policy that keeps every token and throws kvserve::Error (or,
// with `library`, std::runtime_error, as hnswlib does) at `layer`: from
// on_kv, a failure partway through a pass, after every entry's KV of the
// layers before it was written; or, with `in_select`, from select, which a
// decode query's attention calls on a thread-pool worker.
class ThrowingPolicy : public SparsityPolicy {
 public:
  explicit ThrowingPolicy(int layer, std::string message, bool library = false, bool in_select = false)
      : layer_(layer), message_(std::move(message)), library_(library), in_select_(in_select) {}
  std::string_view name() const override { return "throwing"; }
  bool wants_kv() const override { return !in_select_; }
  bool selects_reads() const override { return in_select_; }
  void on_kv(int layer, int32_t, const float*, const float*) override {
    if (!in_select_) maybe_throw(layer);
  }
  void select(int layer, int, const float*, int, int32_t, ReadSet& out) const override {
    out = {};  // every token
    if (layer == layer_ && std::this_thread::get_id() != owner_) throws_off_owner.fetch_add(1);
    maybe_throw(layer);
  }
  // Throws from threads other than the one that made the policy (the pool's workers).
  mutable std::atomic<int> throws_off_owner{0};

 private:
  void maybe_throw(int layer) const {
    if (layer != layer_) return;
    if (library_) throw std::runtime_error(message_);
    throw Error(message_);
  }
  int layer_;
  std::string message_;
  bool library_, in_select_;
  std::thread::id owner_ = std::this_thread::get_id();
};

// Throws from begin_forward: before the pass writes anything.
class BeginForwardThrowing : public SparsityPolicy {
 public:
  explicit BeginForwardThrowing(std::string message) : message_(std::move(message)) {}
  std::string_view name() const override { return "begin-forward-throwing"; }
  void begin_forward(const KvCache&, BlockTable&, int32_t) override { throw std::runtime_error(message_); }

 private:
  std::string message_;
};

}  // namespace kvserve::testing_faults
