// The Llama forward pass (RMSNorm, RoPE, GQA attention over the paged KV
// cache, SwiGLU) over a batch of sequences in one pass: the new tokens of all
// sequences are stacked into one activation matrix, so every weight matrix is
// read once per step whatever the batch holds — prefill chunks and single
// decode tokens alike.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "attention/paged_attention.h"
#include "attention/sparsity_policy.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "util/aligned_buffer.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace kvserve {

// One sequence's share of a forward pass.
struct BatchEntry {
  BlockTable* table = nullptr;       // the sequence's KV; new tokens go at table->num_tokens
  std::span<const int32_t> tokens;   // new tokens to run
  bool all_logits = false;           // logits for every new token, not only the last
  // The sequence's KV sparsity policy (issue 4), owned by the caller, one per
  // sequence; nullptr = full attention. It sees the pass (sparsity_policy.h)
  // and, when it evicts, shrinks the table after the pass.
  SparsityPolicy* policy = nullptr;
  // The tokens are decode steps: the policy's read-time choices (topk, ann)
  // apply to their queries. A prefill chunk reads everything, however short
  // (a 1-token chunk of a prompt split by a shared budget included), so a
  // prompt's KV does not depend on how it was chunked.
  bool decode = false;
};

// A batch entry the forward pass could not run, named by its index, so the
// caller can fail that sequence alone.
//   others_untouched: thrown before the pass changed anything (a position
//     past the context, a token id out of range, KV space not reserved): the
//     cache, every table and every policy are as they were, and the other
//     entries can run again without it.
//   otherwise: the entry's sparsity policy threw during the pass, after
//     other entries' KV was written (not committed: tables are committed
//     only at the end) and their policies fed, or after they were
//     committed (a throw in after_forward); their state is not that of a
//     finished step, so they must be recomputed.
class BatchEntryError : public Error {
 public:
  BatchEntryError(size_t entry, bool others_untouched, const std::string& message)
      : Error(message), entry_(entry), others_untouched_(others_untouched) {}
  size_t entry() const { return entry_; }
  bool others_untouched() const { return others_untouched_; }

 private:
  size_t entry_;
  bool others_untouched_;
};

// Logits of a forward pass, one row per requested token, entries in batch order.
struct Logits {
  std::vector<float> values;         // (rows, vocab)
  std::vector<int32_t> first_row;    // (entries) first row of each entry
  int32_t vocab = 0;

  const float* row(int32_t r) const { return values.data() + size_t(r) * size_t(vocab); }
  // The logits after the last new token of entry e.
  const float* last(size_t e, const std::vector<BatchEntry>& batch) const;
};

// Sees the keys (after RoPE) and values of every token of every layer as they
// are written: k, v are (n_tokens, kv_dim) floats. Used for calibration.
using KvObserver = std::function<void(int layer, const float* k, const float* v, int64_t n_tokens)>;
// Sees the queries (after RoPE) of every token of every layer: q is
// (n_tokens, n_heads * head_dim) floats. Used to capture real Q/K statistics.
using QueryObserver = std::function<void(int layer, const float* q, int64_t n_tokens)>;

class Transformer {
 public:
  // The model and pool must outlive the transformer.
  Transformer(const Model& model, ThreadPool& pool);

  // Runs the new tokens of every entry, appending their K/V to the cache and
  // advancing each table's num_tokens; then lets each entry's policy evict.
  // REQUIRES: cache.reserve(*entry.table, entry.tokens.size()) succeeded for
  // every entry; tables are distinct. Throws BatchEntryError naming the
  // entry, before changing anything, when a RoPE position would pass the
  // model's context length (positions within the cache never do while the
  // cache is smaller), a token id is out of range or an entry's KV space was
  // not reserved; and naming the entry whose sparsity policy threw (any
  // exception) during the pass.
  void forward(const std::vector<BatchEntry>& batch, KvCache& cache, Logits& out);

  const ModelConfig& config() const { return config_; }
  const Model& model() const { return model_; }
  // Replaces the observer (nullptr: none).
  void set_kv_observer(KvObserver observer) { observer_ = std::move(observer); }
  void set_query_observer(QueryObserver observer) { query_observer_ = std::move(observer); }
  // The fewest tokens of a part when decode attention splits a context
  // across threads (attention_parts); tests lower it to split short contexts.
  // KVSERVE_ATTENTION_PARTS=0 in the environment turns the split off (for
  // A/B runs; BENCHMARKS.md measures with and without).
  void set_attention_part_tokens(int32_t tokens) { attention_part_tokens_ = tokens; }
  static constexpr int32_t kAttentionPartTokens = 1024;
  // The most consecutive tokens of one sequence (a prefill chunk) whose
  // attention reads each KV block once (tile_attention.h); 1 reads the KV
  // once per token. By default a tile holds kPrefillTileRows query rows
  // (tokens x query heads per KV head): 16 tokens of the 400M model's
  // groups of 3 (BENCHMARKS.md, "Prefill reads each block once per tile").
  // KVSERVE_PREFILL_TILE=N in the environment sets N tokens (for A/B runs).
  void set_prefill_tile_tokens(int32_t tokens) { prefill_tile_tokens_ = std::max<int32_t>(1, tokens); }
  static constexpr int32_t kPrefillTileRows = 48;

 private:
  void ensure_capacity(int64_t n_tokens, int64_t n_rows);
  // The attention passes of n tokens (tables[t]), each seeing n_ctx[t]
  // slots, for every KV head, into attention_work_ and each thread's share
  // into work_ranges_ (once per forward: every layer shares them).
  void plan_dense_attention(int32_t block_size, const std::vector<const BlockTable*>& tables,
                            const std::vector<int32_t>& n_ctx);
  // Attention of those tokens (tables[t]) for every KV head of `layer`, into
  // att_, without sparsity policies, as plan_dense_attention laid out.
  void attend_dense(const KvCache& cache, int layer, const std::vector<const BlockTable*>& tables,
                    const std::vector<int32_t>& n_ctx);

  const Model& model_;
  const ModelConfig& config_;
  ThreadPool& pool_;

  // Activations for up to capacity_ tokens, reused across calls.
  int64_t capacity_ = 0;
  AlignedBuffer<float> x_;      // (tokens, dim) residual stream
  AlignedBuffer<float> xb_;     // (tokens, dim) normed input / attention output projection
  AlignedBuffer<float> q_;      // (tokens, n_heads * head_dim)
  AlignedBuffer<float> k_;      // (tokens, kv_dim)
  AlignedBuffer<float> v_;      // (tokens, kv_dim)
  AlignedBuffer<float> att_;    // (tokens, n_heads * head_dim)
  AlignedBuffer<float> hb_;     // (tokens, hidden_dim) gate
  AlignedBuffer<float> hb2_;    // (tokens, hidden_dim) up
  AlignedBuffer<float> rows_;   // (rows, dim) final hidden states of the tokens that want logits
  std::vector<AttentionScratch> scratch_;  // (threads)
  KvObserver observer_;

  // Attention work: one KV head's pass for `tokens` consecutive tokens of
  // one sequence from `token` on (a prefill tile; 1 otherwise) over blocks
  // [first_block, end_block); each thread takes a contiguous range. A pass
  // cut into parts (single tokens only) writes its part's output and softmax
  // stats to part_out_ / part_stats_ at `part` (its `parts` parts numbered
  // consecutively); whole passes write att_ directly (part = -1, parts = 1).
  struct AttentionWork {
    int64_t token;
    int32_t tokens;
    int kv_head;
    int32_t first_block, end_block;
    int32_t part;
    int32_t parts;
  };
  std::vector<AttentionWork> attention_work_;
  std::vector<int64_t> work_ranges_;    // (threads + 1) thread k takes work [k], [k + 1)
  std::vector<int32_t> block_ids_;      // 0, 1, 2, ...: the blocks a part reads
  std::vector<float> part_out_;         // (parts, group, head_dim)
  std::vector<float> part_stats_;       // (parts, group, 2)
  int32_t attention_part_tokens_;
  int32_t prefill_tile_tokens_;

  // Sparsity policies' per-thread scratch.
  struct PolicyScratch {
    ReadSet reads;                // what a query reads
    std::vector<float> weights;   // (n_ctx) attention weights for observe()
  };
  std::vector<PolicyScratch> policy_scratch_;  // (threads)
  std::vector<float> key_after_rope_;          // (kv_dim) a pre-RoPE key rotated for on_kv()
  std::vector<float> key_in_span_;             // (kv_dim) a pre-RoPE key rotated within its RoPE span
  std::vector<float> rope_freqs_;              // (head_dim / 2) the model's RoPE angles, scaling applied
  float query_scale_ = 1.0f;                   // YaRN's score factor, put on the queries after RoPE
  QueryObserver query_observer_;
};

}  // namespace kvserve
