// The continuous-batching scheduler on its own: exact plans (which sequences
// run, how many tokens, who is preempted) for a small cache, with the model
// pass simulated by committing the planned tokens.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <utility>

#include "util/error.h"

namespace kvserve {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.dim = 16;
  c.hidden_dim = 32;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.vocab_size = 32;
  c.seq_len = 1024;
  return c;
}

class SchedulerTest : public ::testing::Test {
 protected:
  // A cache of `blocks` blocks of 4 tokens.
  void make(int32_t blocks, SchedulerOptions o) {
    KvCacheOptions k;
    k.block_size = 4;
    k.num_blocks = blocks;
    cache = std::make_unique<KvCache>(tiny_config(), k);
    o.watermark_blocks = 0;
    sched = std::make_unique<Scheduler>(o, *cache, hooks);
  }
  Sequence* add(int32_t prompt_tokens, int32_t max_tokens = 100) {
    Request r;
    r.prompt.assign(size_t(prompt_tokens), 3);
    r.max_tokens = max_tokens;
    seqs.push_back(std::make_unique<Sequence>(seqs.size() + 1, r, seqs.size(), 0.0));
    sched->add(seqs.back().get());
    return seqs.back().get();
  }
  // What the engine does with a plan: the tokens run (commit), and a sequence
  // whose pending tokens are all done gets a new one.
  void run(const SchedulePlan& plan) {
    for (const ScheduledChunk& c : plan.chunks) {
      cache->commit(c.seq->table, c.n_tokens);
      c.seq->num_computed += c.n_tokens;
      if (c.seq->num_pending() == 0) (void)c.seq->append(7, "");
    }
  }
  static std::vector<std::pair<RequestId, int32_t>> chunks(const SchedulePlan& p) {
    std::vector<std::pair<RequestId, int32_t>> out;
    for (const ScheduledChunk& c : p.chunks) out.push_back({c.seq->id(), c.n_tokens});
    return out;
  }
  using Chunks = std::vector<std::pair<RequestId, int32_t>>;

  PrefixHooks hooks;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Scheduler> sched;
  std::vector<std::unique_ptr<Sequence>> seqs;
};

TEST_F(SchedulerTest, MaxNumSeqsBoundsTheRunningSet) {
  SchedulerOptions o;
  o.max_num_seqs = 2;
  make(64, o);
  for (int i = 0; i < 4; ++i) add(3);
  SchedulePlan p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 3}, {2, 3}}));
  EXPECT_EQ(sched->num_running(), 2u);
  EXPECT_EQ(sched->num_waiting(), 2u);
  run(p);
  // Both decode; nobody else fits under max_num_seqs.
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}, {2, 1}}));
  // When one finishes, the next waiting request is admitted in the same step as the decode.
  run(p);
  sched->finish(seqs[0].get());
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{2, 1}, {3, 3}}));
}

TEST_F(SchedulerTest, PrefillIsChunkedByTheTokenBudgetAndMixedWithDecodes) {
  SchedulerOptions o;
  o.max_batch_prefill_tokens = 10;
  make(64, o);
  add(4);
  add(23);
  SchedulePlan p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 4}, {2, 6}}));
  EXPECT_EQ(p.prefill_tokens, 10);
  // The whole 23-token prompt's blocks were reserved at admission.
  EXPECT_EQ(seqs[1]->table.blocks.size(), 6u);
  run(p);
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}, {2, 10}}));
  EXPECT_EQ(p.prefill_tokens, 10);  // decode tokens do not count against the prefill budget
  run(p);
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}, {2, 7}}));
  run(p);
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}, {2, 1}}));
}

TEST_F(SchedulerTest, AdmissionWaitsForBlocksForTheWholePromptInOrder) {
  make(8, SchedulerOptions{});
  add(20);  // 5 blocks
  add(16);  // 4 blocks: does not fit beside the first
  add(2);   // 1 block: would fit, but may not overtake the older request
  SchedulePlan p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 20}}));
  EXPECT_EQ(cache->pool().num_free(), 3);
  run(p);
  sched->finish(seqs[0].get());
  EXPECT_EQ(cache->pool().num_free(), 8);
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{2, 16}, {3, 2}}));
}

TEST_F(SchedulerTest, OutOfBlocksPreemptsTheYoungestWhichComesBackFirst) {
  make(4, SchedulerOptions{});
  add(4);  // 1 block each, both fill their block
  add(4);
  SchedulePlan p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 4}, {2, 4}}));
  run(p);
  // Decodes need a second block each: 2 free, fine.
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}, {2, 1}}));
  EXPECT_EQ(cache->pool().num_free(), 0);
  run(p);
  // Three more decode tokens fill the second blocks.
  for (int i = 0; i < 3; ++i) run(sched->schedule());
  // Now sequence 1 needs a third block: sequence 2 (younger) is preempted.
  p = sched->schedule();
  ASSERT_EQ(p.preempted.size(), 1u);
  EXPECT_EQ(p.preempted[0]->id(), 2u);
  EXPECT_EQ(chunks(p), (Chunks{{1, 1}}));
  EXPECT_EQ(seqs[1]->num_computed, 0);
  EXPECT_TRUE(seqs[1]->table.blocks.empty());
  EXPECT_EQ(sched->preemptions(), 1);
  EXPECT_EQ(seqs[1]->state, SequenceState::Waiting);
  run(p);
  // Once sequence 1 ends, sequence 2 recomputes its prompt and generated tokens.
  sched->finish(seqs[0].get());
  p = sched->schedule();
  EXPECT_EQ(chunks(p), (Chunks{{2, 9}}));
  EXPECT_EQ(p.prefill_tokens, 9);
}

TEST_F(SchedulerTest, TheOnlySequenceIsNeverPreemptedWhenItFits) {
  make(3, SchedulerOptions{});
  Sequence* s = add(5, 7);  // 12 tokens = 3 blocks
  for (int step = 0; step < 8; ++step) {
    SchedulePlan p = sched->schedule();
    EXPECT_TRUE(p.preempted.empty());
    run(p);
  }
  EXPECT_EQ(s->num_generated(), 8);
  EXPECT_EQ(cache->pool().num_free(), 0);
}

TEST_F(SchedulerTest, PrefixAwareOrderingAdmitsCachedPrefixesFirstButNotForever) {
  // Requests with an even prompt length "have a cached prefix" of 4 tokens.
  hooks.cached_tokens = [](const Sequence& s, int32_t*) { return s.num_prompt() % 2 == 0 ? 4 : 0; };
  SchedulerOptions o;
  o.max_num_seqs = 1;
  o.max_skips = 2;
  make(64, o);
  add(5);
  add(6);
  add(7);
  add(8);
  add(9);
  std::vector<RequestId> order;
  for (int i = 0; i < 5; ++i) {
    SchedulePlan p = sched->schedule();
    ASSERT_EQ(p.admitted.size(), 1u);
    order.push_back(p.admitted[0]->id());
    sched->finish(p.admitted[0]);
  }
  // 2 (cached) overtakes 1; 4 overtakes 1 again; then 1 has been skipped twice.
  EXPECT_EQ(order, (std::vector<RequestId>{2, 4, 1, 3, 5}));
}

// A step whose running sequences all find no room for their next chunk
// (here an evicting prefill, which reserves chunk by chunk) and that admits
// nothing makes room (pins, idle sidecars) and plans them again; admission
// runs once: a step planned from scratch after making room matched the
// waiting request's prefix a second time and passed the older one over
// twice (counting towards max_skips at twice the rate). When the room made
// does not help, the youngest running sequence makes way, once: with a
// match that pins again what make_room unpinned (pin-after-hits), planning
// from scratch recursed for as long as rooms were made (8 matches here, until
// the request passed over reached max_skips; alone, it would not end).
TEST_F(SchedulerTest, MakingRoomForAStuckStepRunsAdmissionOnce) {
  for (const bool room_helps : {true, false}) {
    SCOPED_TRACE(room_helps ? "room helps" : "room does not help");
    int32_t matches = 0, rooms = 0;
    bool pinned = false;
    BlockTable held;  // pinned blocks make_room gives back when the room helps
    hooks.cached_tokens = [](Sequence& s, int32_t* idle) {
      if (idle) *idle = 0;
      return s.num_prompt() == 4 ? 4 : 0;
    };
    hooks.match = [&](Sequence& s) {
      matches += s.num_prompt() == 4;
      pinned = true;
      return 0;
    };
    hooks.make_room = [&] {
      ++rooms;
      int32_t n = std::exchange(pinned, false) ? 1 : 0;
      if (room_helps) n += int32_t(held.blocks.size()), cache->release(held);
      return n;
    };
    SchedulerOptions o;
    o.max_batch_prefill_tokens = 8;
    make(4, o);
    seqs.clear();
    Sequence* a = add(12);
    a->policy = make_sparsity_policy({.policy = "window", .budget = 8}, *cache);
    SchedulePlan p = sched->schedule();
    EXPECT_EQ(chunks(p), (Chunks{{1, 8}}));  // the first chunk's blocks only
    run(p);
    ASSERT_TRUE(cache->reserve(held, 8));    // the other two blocks
    Sequence* c = add(6);
    add(4);  // a cached prefix: admitted before c
    matches = 0;
    p = sched->schedule();
    EXPECT_EQ(rooms, 1);
    EXPECT_EQ(matches, 1);
    EXPECT_EQ(c->skipped, 1);
    if (room_helps) {
      EXPECT_EQ(chunks(p), (Chunks{{1, 4}}));  // the cached request comes in next step
    } else {
      EXPECT_TRUE(p.chunks.empty());
      ASSERT_EQ(p.preempted.size(), 1u);
      EXPECT_EQ(p.preempted[0], a);
    }
    sched.reset();
    cache->release(held);
  }
}

TEST_F(SchedulerTest, RejectsBadOptions) {
  SchedulerOptions o;
  o.max_num_seqs = 0;
  EXPECT_THROW(o.validate(), Error);
  o = {};
  o.max_batch_prefill_tokens = -1;
  EXPECT_THROW(o.validate(), Error);
}

}  // namespace
}  // namespace kvserve
