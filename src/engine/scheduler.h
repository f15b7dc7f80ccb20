// Continuous batching: decides, once per step, which sequences run and how
// many of their pending tokens, within the KV memory, max_num_seqs and the
// per-step prompt-token budget. One step = one batched forward pass in which
// chunks of prompts and single decode tokens run together.
//
// Rules, in priority order (older requests first everywhere):
//  1. Every running sequence that is decoding gets one token. When its next
//     token needs a block and none is free, the youngest running sequence is
//     preempted (recompute: its blocks are freed and it goes back to the
//     front of the waiting queue, keeping its age, to be prefilled again).
//  2. Running sequences still prefilling get chunks of their prompt from the
//     remaining budget of max_batch_prefill_tokens.
//  3. Waiting sequences are admitted while the budget, max_num_seqs and the
//     free blocks allow. Admission reserves blocks for the sequence's whole
//     pending prompt at once (plus a watermark), so an admitted prompt never
//     needs a block mid-prefill and a long request cannot be admitted,
//     preempted and readmitted in a loop. The oldest waiting request that does
//     not fit blocks those behind it (no starvation of long prompts).
//  4. Prefix-aware ordering: among the first `prefix_lookahead` waiting
//     requests, one whose prompt starts with cached blocks is admitted first,
//     so requests sharing a prefix run while it is hot; and a request whose
//     prefix a running sequence is computing right now waits until it is
//     published instead of computing it a second time. A request passed over
//     or held back `max_skips` times is admitted next regardless (fairness).
//
// Thread safety: none; the engine thread owns the scheduler.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "engine/sequence.h"
#include "kv/kv_cache.h"

namespace kvserve {

struct SchedulerOptions {
  int32_t max_num_seqs = 64;                // sequences running at once (vLLM's name)
  int32_t max_batch_prefill_tokens = 512;   // prompt tokens per step, all sequences together (TGI's name)
  int32_t watermark_blocks = -1;            // blocks kept free at admission for running decodes;
                                            // -1 = 1% of the pool (at least 1)
  bool prefix_aware = true;                 // admit requests with a cached prefix first
  int32_t prefix_lookahead = 32;            // waiting requests scanned for a cached prefix
  int32_t max_skips = 8;                    // admissions a waiting request may be passed over

  // Throws kvserve::Error for non-positive limits.
  void validate() const;
};

// One sequence's share of a step: its next n_tokens pending tokens.
struct ScheduledChunk {
  Sequence* seq = nullptr;
  int32_t n_tokens = 0;
  int32_t prefill_tokens = 0;  // of them, prompt or recomputed tokens (a new decode token is not)
};

struct SchedulePlan {
  std::vector<ScheduledChunk> chunks;   // in priority order
  std::vector<Sequence*> admitted;      // newly running this step
  std::vector<Sequence*> preempted;     // moved back to waiting this step
  int32_t prefill_tokens = 0;           // the chunks' prefill_tokens together

  bool empty() const { return chunks.empty(); }
};

// How the scheduler reaches the prefix cache (optional). Both see a sequence
// whose table is empty.
struct PrefixHooks {
  // Tokens of seq's prompt that are cached now, without taking them (for
  // ordering and for refusing early); *idle_blocks (may be null): how many
  // of their blocks are idle.
  std::function<int32_t(Sequence&, int32_t* idle_blocks)> cached_tokens;
  // Tokens of seq's prompt that running sequences are computing now and will
  // publish (not cached yet): admitting seq a step later turns them into hits.
  std::function<int32_t(Sequence&)> inflight_tokens;
  // Shares the cached prefix into seq.table (ref counts taken); returns the
  // tokens matched (a multiple of the block size, less than seq's tokens).
  std::function<int32_t(Sequence&)> match;
  // Gives the sequence's blocks back (publishing what is cacheable) and empties its table.
  std::function<void(Sequence&)> release;
  // Unpins every pinned block and gives back idle blocks' staging slots;
  // returns how many. Called when nothing runs and the next waiting sequence
  // still does not fit, and (at most once a step) when no running sequence
  // found room for its next chunk and admission let nothing in: neither may
  // hold the queue up forever.
  std::function<int32_t()> make_room;
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& options, KvCache& cache, PrefixHooks prefix = {});

  // Queues a new sequence (state Waiting, empty table).
  void add(Sequence* seq);
  // Removes a sequence wherever it is and frees its blocks; marks it Finished.
  void finish(Sequence* seq);
  // Plans the next step; reserves every block the plan needs.
  [[nodiscard]] SchedulePlan schedule();
  // Moves a running sequence back to waiting (keeping its age), its blocks
  // freed, to be computed again from scratch: recompute preemption. schedule()
  // does this when a decode finds no block; the engine when a failed forward
  // pass left the sequence's step half done.
  void preempt(Sequence* seq);

  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  const std::deque<Sequence*>& waiting() const { return waiting_; }
  const std::vector<Sequence*>& running() const { return running_; }
  int64_t preemptions() const { return preemptions_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  void insert_waiting(Sequence* seq);     // by age
  void release(Sequence& seq);
  // Index in waiting_ of the sequence to admit next.
  size_t pick_waiting();
  // The smallest prefill chunk worth running for seq now: its whole next
  // chunk under fixed steps (sequence.h), else any.
  int32_t whole_chunk(const Sequence& seq) const;
  [[nodiscard]] bool admit(Sequence* seq, int32_t budget);  // budget: prompt tokens left this step
  // schedule()'s steps 1-2 (chunks for running sequences) and 3-4 (admission)
  // into plan, taking prompt tokens from budget.
  void plan_running(SchedulePlan& plan, int32_t& budget);
  void admit_waiting(SchedulePlan& plan, int32_t& budget);

  SchedulerOptions options_;
  KvCache& cache_;
  PrefixHooks prefix_;
  int32_t watermark_ = 1;                 // in blocks
  std::deque<Sequence*> waiting_;         // oldest first
  std::vector<Sequence*> running_;        // oldest first
  int64_t preemptions_ = 0;
};

}  // namespace kvserve
