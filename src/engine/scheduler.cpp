#include "engine/scheduler.h"

#include <algorithm>
#include <cassert>

#include "util/error.h"

namespace kvserve {

void SchedulerOptions::validate() const {
  if (max_num_seqs <= 0) fail("--max-num-seqs must be positive (got {})", max_num_seqs);
  if (max_batch_prefill_tokens <= 0)
    fail("--max-batch-prefill-tokens must be positive (got {})", max_batch_prefill_tokens);
  if (prefix_lookahead <= 0) fail("prefix lookahead must be positive (got {})", prefix_lookahead);
  if (max_skips < 0) fail("max skips must be >= 0 (got {})", max_skips);
}

Scheduler::Scheduler(const SchedulerOptions& options, KvCache& cache, PrefixHooks prefix)
    : options_(options), cache_(cache), prefix_(std::move(prefix)) {
  options_.validate();
  const int32_t total = cache.pool().num_blocks();
  watermark_ = options_.watermark_blocks >= 0 ? options_.watermark_blocks : std::max(1, total / 100);
}

void Scheduler::insert_waiting(Sequence* seq) {
  auto it = std::upper_bound(waiting_.begin(), waiting_.end(), seq,
                             [](const Sequence* a, const Sequence* b) { return a->order() < b->order(); });
  waiting_.insert(it, seq);
}

void Scheduler::add(Sequence* seq) {
  seq->state = SequenceState::Waiting;
  insert_waiting(seq);
}

void Scheduler::release(Sequence& seq) {
  if (prefix_.release) prefix_.release(seq);
  else cache_.release(seq.table);
  seq.num_computed = 0;
}

void Scheduler::finish(Sequence* seq) {
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) {
    running_.erase(it);
    release(*seq);
  } else if (auto w = std::find(waiting_.begin(), waiting_.end(), seq); w != waiting_.end()) {
    waiting_.erase(w);
  }
  seq->state = SequenceState::Finished;
}

void Scheduler::preempt(Sequence* seq) {
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  release(*seq);
  seq->checkpoint = 0;  // cached_tokens stays: the usage reports the first admission
  ++seq->preemptions;
  ++preemptions_;
  seq->state = SequenceState::Waiting;
  insert_waiting(seq);
}

size_t Scheduler::pick_waiting() {
  if (!options_.prefix_aware || !prefix_.cached_tokens || waiting_.front()->skipped >= options_.max_skips)
    return 0;
  size_t best = 0;
  int32_t best_cached = prefix_.cached_tokens(*waiting_.front(), nullptr);
  const size_t n = std::min(waiting_.size(), size_t(options_.prefix_lookahead));
  for (size_t i = 1; i < n; ++i) {
    const int32_t c = prefix_.cached_tokens(*waiting_[i], nullptr);
    if (c > best_cached) best = i, best_cached = c;
  }
  for (size_t i = 0; i < best; ++i) ++waiting_[i]->skipped;
  return best;
}

bool Scheduler::admit(Sequence* seq, int32_t budget) {
  assert(seq->table.blocks.empty());
  // The watermark keeps room for running decodes; with nothing running, the
  // whole pool is the sequence's.
  const int32_t watermark = running_.empty() ? 0 : watermark_;
  // Refused before matching when even its whole in-memory prefix hit leaves
  // too few blocks (staging aside): a match that is then rolled back counted
  // as prefix-cache queries and hits, touched recency, fed pin-after-hits and
  // read the tiers, at every step a sequence waited.
  if (!seq->evicting()) {
    int32_t idle = 0;
    const int32_t peek = prefix_.cached_tokens ? prefix_.cached_tokens(*seq, &idle) : 0;
    const int32_t least = cache_.blocks_for(int64_t(seq->tokens().size())) - peek / cache_.block_size();
    // The hit's idle blocks stop being available once taken.
    if (cache_.pool().num_available() - idle < least + watermark) return false;
  }
  const int32_t matched = prefix_.match ? prefix_.match(*seq) : 0;
  seq->num_computed = matched;
  // Generated tokens of a fixed-steps sequence are replayed as decode steps.
  seq->prefill_end = seq->fixed_steps() ? std::max(matched, seq->num_prompt()) : int32_t(seq->tokens().size());
  // The usage's cached tokens are the first admission's: a readmitted
  // sequence matching the blocks it published itself was served nobody
  // else's work.
  if (seq->preemptions == 0) seq->cached_tokens = std::min(matched, seq->num_prompt());
  // Blocks for all that is pending, or for the first chunk under an evicting
  // policy (which holds at most its budget, however long the prompt).
  const int32_t reserve = seq->evicting() ? std::min(seq->chunk_limit(), options_.max_batch_prefill_tokens)
                                          : seq->num_pending();
  // Staging slots (FP16 residual) only for the chunk this step writes; later
  // chunks take theirs when they run.
  // The slots are those reserve() takes: one per block the chunk writes, from
  // the block the next token lands in. (Counting one block more than that
  // asked more than KvCache::fits promised a request, so a prompt the server
  // accepted could wait forever on an idle server.)
  const int32_t first_chunk = std::min(budget, seq->chunk_limit());
  const int32_t n = seq->table.num_tokens;
  const int32_t need = cache_.blocks_for(int64_t(n) + reserve) - int32_t(seq->table.blocks.size()) +
                       cache_.staging_cost_blocks() * (cache_.blocks_for(int64_t(n) + first_chunk) -
                                                       n / cache_.block_size());
  // Idle prefix-cache blocks count as free: allocation reclaims them.
  if (cache_.pool().num_available() < need + watermark || !cache_.reserve(seq->table, reserve, first_chunk)) {
    release(*seq);
    if (seq->preemptions == 0) seq->cached_tokens = 0;
    seq->checkpoint = 0;
    return false;
  }
  return true;
}

int32_t Scheduler::whole_chunk(const Sequence& seq) const {
  return seq.fixed_steps() ? std::min(seq.chunk_limit(), options_.max_batch_prefill_tokens) : 1;
}

void Scheduler::plan_running(SchedulePlan& plan, int32_t& budget) {
  // Oldest first. Victims are taken from the back, so a victim has never
  // been planned in this step.
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* seq = running_[i];
    if (seq->decoding()) {
      // One token a step: the newest sampled one, or the next generated
      // token a fixed-steps sequence replays after a preemption.
      bool self_preempted = false;
      while (!cache_.reserve(seq->table, 1)) {
        Sequence* victim = running_.back();
        self_preempted = victim == seq;
        preempt(victim);
        plan.preempted.push_back(victim);
        if (self_preempted) break;
      }
      if (self_preempted) break;  // it was the youngest: nothing after it remains
      const int32_t replayed = seq->num_pending() > 1 ? 1 : 0;  // a replayed token is recomputed work
      plan.chunks.push_back({seq, 1, replayed});
      plan.prefill_tokens += replayed;
    } else if (budget > 0) {
      const int32_t n = std::min(budget, seq->chunk_limit());
      if (n < whole_chunk(*seq)) continue;  // a fixed-steps sequence waits for its whole chunk
      // An evicting sequence reserves chunk by chunk (compaction returns the
      // blocks it no longer needs); it waits a step when none is free.
      if (!cache_.reserve(seq->table, n)) continue;
      budget -= n;
      plan.prefill_tokens += n;
      plan.chunks.push_back({seq, n, n});
    }
  }
}

void Scheduler::admit_waiting(SchedulePlan& plan, int32_t& budget) {
  // Not when memory was short this very step.
  while (plan.preempted.empty() && budget > 0 && !waiting_.empty() &&
         int32_t(running_.size()) < options_.max_num_seqs) {
    const size_t pick = pick_waiting();
    Sequence* seq = waiting_[pick];
    if (options_.prefix_aware && prefix_.inflight_tokens && seq->skipped < options_.max_skips &&
        prefix_.inflight_tokens(*seq) > prefix_.cached_tokens(*seq, nullptr)) {
      ++seq->skipped;
      break;
    }
    if (!admit(seq, budget)) {
      // Nothing runs, so nothing else will free blocks: unpin and try again.
      const bool stuck = running_.empty() && plan.chunks.empty();
      if (!stuck || !prefix_.make_room || prefix_.make_room() == 0 || !admit(seq, budget)) break;
    }
    waiting_.erase(waiting_.begin() + std::ptrdiff_t(pick));
    seq->state = SequenceState::Running;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), seq,
                                     [](const Sequence* a, const Sequence* b) { return a->order() < b->order(); }),
                    seq);
    plan.admitted.push_back(seq);
    // A preempted sequence that had been decoding comes back with its generated
    // tokens to recompute; they are prefill work like the prompt (replayed
    // one step each, once its prompt is in, under fixed steps).
    const int32_t n = std::min(budget, seq->chunk_limit());
    if (n < whole_chunk(*seq)) continue;  // admitted; its first chunk runs next step
    budget -= n;
    plan.prefill_tokens += n;
    plan.chunks.push_back({seq, n, n});
  }
}

SchedulePlan Scheduler::schedule() {
  SchedulePlan plan;
  int32_t budget = options_.max_batch_prefill_tokens;

  // 1-2. Running sequences; 3-4. admission.
  plan_running(plan, budget);
  admit_waiting(plan, budget);

  // 5. Sequences run but nothing got a chunk: each running one is a prefill
  // whose next chunk found no room (its FP16 staging slots are taken chunk by
  // chunk, an evicting sequence's blocks too), and nothing in flight will
  // free any. An empty plan put the engine to sleep with requests queued (a
  // helper's int4-small server at 160 KiB: one recompute stuck, the rest
  // waiting until their clients gave up). Idle cached blocks' sidecars and
  // pins go first (only now: a waiting request admitted keeps them), and the
  // running sequences are planned again: planning nothing changed nothing,
  // so that repeats no effect. Admission does not run again (a waiting
  // request the room lets in comes in next step): planning the whole step
  // again repeated its effects (prefix-cache matches, requests counted as
  // passed over). Still nothing: the youngest running sequence makes way, as
  // a decode step would preempt it.
  if (plan.chunks.empty() && plan.preempted.empty() && plan.admitted.empty() && !running_.empty()) {
    if (prefix_.make_room && prefix_.make_room() > 0) plan_running(plan, budget);
    if (plan.chunks.empty() && plan.preempted.empty()) {
      plan.preempted.push_back(running_.back());
      preempt(running_.back());
    }
  }
  return plan;
}

}  // namespace kvserve
