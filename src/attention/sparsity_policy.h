// KV sparsity (issue 4): which of a sequence's tokens attention reads, and
// which the cache keeps at all. One interface, one small strategy per file:
//   full    every token (today's behaviour)
//   window  the last `budget` tokens                    (window_policy)
//   sinks   the first S + the last budget - S tokens    (sinks_policy, StreamingLLM)
//   h2o     heavy hitters by accumulated attention + a recent window (h2o_policy)
//   snapkv  tokens the last W queries attend to, pooled (snapkv_policy)
//   topk    every token kept; each decode query reads the K blocks whose key
//           summaries promise the largest scores       (topk_policy, Quest)
//   ann     every token kept; each decode query reads sinks, a window and
//           the keys an ANN index returns for it       (ann_policy, HNSW / IVF-PQ)
// Evicting policies (window, sinks, h2o, snapkv) keep at most `budget` tokens
// per (layer, KV head) after every forward pass and FREE memory: KvCache
// compacts evicted tokens out of blocks and returns emptied blocks to the
// pool. Read-time policies (topk, ann) keep everything and save reads, not memory;
// they report the fraction of keys read.
//
// A policy object belongs to one sequence: the engine makes one per request
// (make_sparsity_policy) and passes it with the sequence to the forward pass
// (BatchEntry::policy). Transformer::forward calls, for each entry with a
// policy:
//   begin_forward               once, before the first layer
//   on_kv                       per layer and new token, when wants_kv()
//   select                      per layer, KV head and decode query, when selects_reads()
//   observe                     per layer, KV head and new query, when wants_attention_weights()
//   after_forward               once, after the new tokens are committed
// A policy that wants none of these costs the forward pass nothing.
//
// Thread safety: select() may run concurrently for any (layer, KV head,
// query) and must only read; observe() may run concurrently for different KV
// heads, but calls for one (layer, KV head) come in slot order from one
// thread. Every other method runs on the engine thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "attention/key_index.h"
#include "kv/block_table.h"
#include "kv/kv_cache.h"

namespace kvserve {

// Whether h2o and snapkv choose tokens per (layer, KV head) or one set for all.
enum class SparsityScope : uint8_t {
  Head,       // each (layer, KV head) keeps its own tokens (the default: heads attend to different tokens)
  Aggregate,  // one keep set for every layer and head, from scores summed over them
};
// How h2o turns the attention a token received into its score.
enum class H2oScore : uint8_t {
  Sum,   // the sum over every query since the token arrived (H2O)
  Mean,  // that sum divided by the number of those queries (no bias toward old tokens)
};
// The positions RoPE sees after eviction.
enum class SparsityPositions : uint8_t {
  Default,   // cache for sinks, original for the others
  Original,  // each token keeps its position in the text; bounded by the model's context length
  Cache,     // positions within the cache (StreamingLLM): needs keys stored before RoPE; unbounded
};

struct SparsityOptions {
  std::string policy = "full";  // full | window | sinks | h2o | snapkv | topk | ann
  int32_t budget = 0;           // tokens kept (evicting) or read (topk, ann) per (layer, KV head); 0 only with full
  int32_t sinks = -1;           // first tokens always kept; -1 = the policy's default (sinks: 4, others: 0)
  int32_t window = -1;          // most recent tokens always kept; -1 = the policy's default
                                // (h2o, ann: budget / 2, snapkv: the observation window, topk: none)
  int32_t observe = -1;         // snapkv: queries whose attention is pooled; -1 = min(32, budget / 2)
  int32_t pool = -1;            // snapkv: max-pool width over neighbouring slots (odd; 1 = none); -1 = 7
  int32_t horizon = 0;          // h2o/snapkv: tokens further back than this many positions are
                                // evicted first, oldest first (sinks excepted); 0 = no horizon
  SparsityScope scope = SparsityScope::Head;
  H2oScore score = H2oScore::Sum;
  // h2o/snapkv: multiply a token's attention score by the L1 norm of its
  // value (VATP): attention paid to a near-zero value (a sink) moves the
  // output little, so it should not keep the token.
  bool value_weighted = false;
  SparsityPositions positions = SparsityPositions::Default;
  int32_t compact_slack = -1;   // evicted slots left in place before compacting; -1 = one block,
                                // 0 or 1 = compact at every eviction
                                // (compaction then always frees a block)
  KeyIndexBackend ann_backend = KeyIndexBackend::Hnsw;      // ann: hnsw | ivfpq
  MipsTransform ann_transform = MipsTransform::L2Augment;   // ann: l2aug | ip
};

// The policy names, for help texts and errors.
std::vector<std::string> sparsity_policy_names();
SparsityScope parse_sparsity_scope(std::string_view name);         // head | aggregate
H2oScore parse_h2o_score(std::string_view name);                   // sum | mean
SparsityPositions parse_sparsity_positions(std::string_view name);  // original | cache

// What one decode query reads for one (layer, KV head) (read-time policies).
struct ReadSet {
  std::vector<int32_t> blocks;  // logical blocks, ascending, the query's own included; empty = every block
  std::vector<uint8_t> keep;    // (n_ctx) 1 = the slot is read; empty = every slot of `blocks`
};

// Counters of one sequence's policy.
struct SparsityStats {
  int64_t forward_passes = 0;
  int64_t tokens_evicted = 0;    // per (layer, KV head)
  int64_t compactions = 0;       // compactions that moved tokens and freed blocks
  int64_t tokens_read = 0;       // keys read by attention calls that chose blocks
  int64_t tokens_available = 0;  // keys those calls could have read

  // Fraction of the kept keys attention read, over the calls that chose (1 without any).
  double read_fraction() const {
    return tokens_available == 0 ? 1.0 : double(tokens_read) / double(tokens_available);
  }
};

class SparsityPolicy {
 public:
  virtual ~SparsityPolicy() = default;

  virtual std::string_view name() const = 0;
  // Whether the policy drops tokens (and so frees memory).
  virtual bool evicts() const { return false; }

  // What the forward pass must provide.
  virtual bool wants_kv() const { return false; }
  virtual bool wants_attention_weights() const { return false; }
  virtual bool selects_reads() const { return false; }

  // Before a forward pass that appends n_new tokens to `table`.
  virtual void begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) {}
  // The key (after RoPE) and value of the token written to `slot` of
  // `layer`: (kv_dim) floats each.
  virtual void on_kv(int layer, int32_t slot, const float* k, const float* v) {}
  // What the query in slot n_ctx - 1 reads for (layer, kv_head); leaving
  // `out` empty reads everything. q: (group, head_dim) floats, RoPE applied.
  // Read only.
  virtual void select(int layer, int kv_head, const float* q, int group, int32_t n_ctx, ReadSet& out) const {}
  // The attention weights of the query in slot n_ctx - 1 for (layer,
  // kv_head), summed over the GQA group: (n_ctx) floats over slots, 0 for
  // evicted slots.
  virtual void observe(int layer, int kv_head, const float* weights, int32_t n_ctx) {}
  // After the pass committed n_new tokens: evicts down to the budget and
  // compacts (evicting policies).
  virtual void after_forward(KvCache& cache, BlockTable& table, int32_t n_new) { ++stats_.forward_passes; }

  // Records attention reads of select()ing calls; thread-safe.
  void record_reads(int64_t read, int64_t available) {
    tokens_read_.fetch_add(read, std::memory_order_relaxed);
    tokens_available_.fetch_add(available, std::memory_order_relaxed);
  }
  SparsityStats stats() const {
    SparsityStats s = stats_;
    s.tokens_read = tokens_read_.load(std::memory_order_relaxed);
    s.tokens_available = tokens_available_.load(std::memory_order_relaxed);
    return s;
  }

 protected:
  SparsityStats stats_;

 private:
  std::atomic<int64_t> tokens_read_{0}, tokens_available_{0};
};

// A policy for one new sequence stored in `cache`. Throws kvserve::Error
// naming the problem for an unknown policy, a budget out of range, options
// that do not fit the budget, or a cache the policy cannot work with
// (positions in the cache need keys stored before RoPE in every layer).
std::unique_ptr<SparsityPolicy> make_sparsity_policy(const SparsityOptions& options, const KvCache& cache);

// The options with the policy's defaults filled in, checked against the
// budget and the cache; make_sparsity_policy throws the same errors.
SparsityOptions resolve_sparsity_options(SparsityOptions options, const KvCache& cache);
// What a sequence under `options` may hold, known without building its
// policy (an ann policy allocates one key index per layer and KV head):
// the engine's and the server's request checks use it. Throws what
// make_sparsity_policy throws.
struct SparsityLimits {
  // The most tokens held at once when fed chunks of up to `chunk` tokens,
  // or -1 when every token stays.
  int64_t max_tokens_held = -1;
  // Positions are bounded by the cache rather than the text (sinks), so
  // the sequence may run past the model's context length.
  bool unbounded_positions = false;
};
SparsityLimits sparsity_limits(const SparsityOptions& options, const KvCache& cache, int32_t chunk);
// Dead slots an evicting policy leaves before it compacts its table.
int32_t compaction_slack(const SparsityOptions& resolved, int32_t block_size);

// A one-line description of resolved options, e.g.
// "h2o budget 64 (sinks 0, window 32, per head, sum)".
std::string describe(const SparsityOptions& resolved);

}  // namespace kvserve
