// The engine on the real model: many requests batched together, with chunked
// prefill and preemption, produce exactly the tokens each would produce alone
// (kvserve generate); stop strings, cancellation, bad requests and a full
// queue behave as documented; the KV cache is empty again at the end.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "engine/generator.h"
#include "fault_injection.h"
#include "greedy_alone.h"
#include "kv/kv_spec.h"
#include "reference_logits.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::kStoriesGguf;

struct Collected {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::None;
  RequestUsage usage;
  std::string error;
};

class EngineTest : public ::testing::Test {
 public:
  void SetUp() override {
    model = Model::load(kStoriesGguf);
    tok = &model->require_tokenizer();
  }
  // Greedy tokens generate() produces for `prompt` alone (greedy_alone.h).
  std::vector<int32_t> alone(const std::vector<int32_t>& prompt, int32_t max_tokens, const KvCacheOptions& kv,
                             const SparsityOptions& sparsity = {}, int32_t prefill_chunk = 512) {
    return testing_files::greedy_alone(*model, prompt, max_tokens, kv, sparsity, prefill_chunk);
  }
  // Two threads, 40 blocks of 4 tokens and prefill chunks of 7: prompts
  // arrive in chunks of a few tokens and sequences preempt each other.
  static EngineOptions chunked_tight_options() {
    EngineOptions o;
    o.threads = 2;
    o.kv.block_size = 4;
    o.kv.num_blocks = 40;
    o.scheduler.max_batch_prefill_tokens = 7;
    return o;
  }
  Request request(const std::string& text, int32_t max_tokens, std::map<RequestId, Collected>& out) {
    Request r;
    r.prompt = tok->encode(text, true);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.on_event = [&out](const RequestEvent& e) {
      Collected& c = out[e.id];
      if (e.token >= 0) c.tokens.push_back(e.token);
      c.text += e.text;
      c.finish = e.finish;
      c.usage = e.usage;
      c.error = e.error;
    };
    return r;
  }

  std::unique_ptr<Model> model;
  const Tokenizer* tok = nullptr;
};

const std::vector<std::string> kPrompts = {
    "Once upon a time", "Lily had a red ball", "The sun was hot and the sky was blue. Tom",
    "One day, a little bird", "Sam and his mom went to the park to play on the swings. They",
    "There was a big tree", "A cat", "Ben liked to build towers with his blocks. One day"};

// Runs kPrompts through one engine and checks each against generate().
EngineStats expect_batched_equals_alone(EngineTest& t, EngineOptions o, int32_t max_tokens) {
  std::map<RequestId, Collected> out;
  Engine engine(*t.model, o);
  std::map<RequestId, size_t> which;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    SubmitResult s = engine.submit(t.request(kPrompts[i], max_tokens - int32_t(i), out));
    EXPECT_EQ(s.status, SubmitResult::Status::Accepted) << s.error;
    which[s.id] = i;
  }
  engine.run_until_idle();
  EXPECT_EQ(out.size(), kPrompts.size());
  for (auto& [id, c] : out) {
    const size_t i = which[id];
    const std::vector<int32_t> prompt = t.tok->encode(kPrompts[i], true);
    const std::vector<int32_t> want =
        t.alone(prompt, max_tokens - int32_t(i), o.kv, o.sparsity, o.scheduler.max_batch_prefill_tokens);
    EXPECT_EQ(c.tokens, want) << "prompt " << i;
    EXPECT_NE(c.finish, FinishReason::None);
    EXPECT_EQ(c.usage.prompt_tokens, int32_t(prompt.size()));
    // An EOS counts as generated but is not emitted (no stop strings here).
    EXPECT_EQ(c.usage.completion_tokens, int32_t(c.tokens.size()) + (c.finish == FinishReason::Stop ? 1 : 0));
    // The prompts share no block: nothing was cached at admission, even for
    // a sequence that matched its own published blocks after a preemption.
    EXPECT_EQ(c.usage.cached_tokens, 0) << "prompt " << i;
    std::string want_text;
    for (size_t k = 0; k < want.size(); ++k) want_text += t.tok->decode_piece(k ? want[k - 1] : prompt.back(), want[k]);
    EXPECT_EQ(c.text, want_text);
  }
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.requests_finished, int64_t(kPrompts.size()));
  EXPECT_EQ(s.kv.blocks_used, 0);
  EXPECT_EQ(s.running + s.waiting, 0);
  return s;
}

TEST_F(EngineTest, BatchedRequestsEqualEachRunAlone) {
  EngineOptions o;
  o.threads = 2;
  o.kv.num_blocks = 256;
  expect_batched_equals_alone(*this, o, 60);
}

TEST_F(EngineTest, ChunkedPrefillAndPreemptionKeepOutputsExact) {
  EngineOptions o = chunked_tight_options();  // 160 tokens for 8 sequences of up to ~75: preemption
  o.scheduler.max_num_seqs = 6;
  const EngineStats s = expect_batched_equals_alone(*this, o, 60);
  EXPECT_GT(s.preemptions, 0);
  EXPECT_LE(s.max_running, 6);
}

TEST_F(EngineTest, QuantizedCacheWithPreemptionKeepsOutputsExact) {
  EngineOptions o;
  o.threads = 2;
  o.kv.set_dtype(KvDType::INT4);
  o.kv.k.grouping = KvGrouping::Channel;
  o.kv.residual = 32;
  o.kv.num_blocks = 24;
  o.scheduler.max_batch_prefill_tokens = 9;
  EXPECT_GT(expect_batched_equals_alone(*this, o, 50).preemptions, 0);
}

// Greedy outputs under a sparsity policy do not depend on load either: with
// prompts chunked by a shared budget and sequences preempted, each equals
// the sequence run alone with the same policy and chunk size.
TEST_F(EngineTest, SparsityPoliciesUnderPreemptionKeepOutputsExact) {
  for (const char* policy : {"window", "sinks", "h2o", "snapkv", "topk", "ann"}) {
    SCOPED_TRACE(policy);
    EngineOptions o;
    o.threads = 2;
    o.kv.block_size = 4;
    o.kv.num_blocks = 28;
    o.scheduler.max_batch_prefill_tokens = 7;
    o.scheduler.max_num_seqs = 6;
    o.kv.k.pre_rope = std::string(policy) == "sinks";  // sinks re-rotate keys within the cache
    o.sparsity.policy = policy;
    o.sparsity.budget = 16;
    const EngineStats s = expect_batched_equals_alone(*this, o, 60);
    EXPECT_GT(s.preemptions, 0);
  }
}

// The prefix cache shares KV only where it does not depend on a policy: a
// topk sequence takes and gives its prompt's blocks only (its generated
// tokens' KV depends on the blocks it chose to read), and summarises the
// keys it took from the cache. Each request equals itself alone.
TEST_F(EngineTest, PolicySequencesShareOnlyKvThatDoesNotDependOnThePolicy) {
  for (const auto& [name, dtype] : {std::pair{"topk", KvDType::F32}, std::pair{"ann", KvDType::F32},
                                   std::pair{"topk", KvDType::INT8}, std::pair{"ann", KvDType::INT8}}) {
    SCOPED_TRACE(std::string(name) + " " + std::string(kv_dtype_name(dtype)));
    EngineOptions o;
    o.threads = 1;
    o.kv.set_dtype(dtype);
    o.kv.block_size = 4;
    o.kv.num_blocks = 256;
    SparsityOptions sparsity;
    sparsity.policy = name;
    sparsity.budget = 8;
    Engine engine(*model, o);
    std::map<RequestId, Collected> out;
    auto run = [&](Request r) {
      const RequestId id = engine.submit(std::move(r)).id;
      engine.run_until_idle();
      return out[id].tokens;
    };
    const std::vector<int32_t> prompt = tok->encode(kPrompts[4], true);
    // A full-attention request publishes the prompt's blocks and more.
    const std::vector<int32_t> full = run(request(kPrompts[4], 40, out));
    EXPECT_EQ(full, alone(prompt, 40, o.kv));
    // The same prompt under the policy takes the prompt's full blocks.
    Request sparse = request(kPrompts[4], 60, out);
    sparse.sparsity = sparsity;
    const std::vector<int32_t> got = run(sparse);
    EXPECT_EQ(got, alone(prompt, 60, o.kv, sparsity, o.scheduler.max_batch_prefill_tokens));
    // A hit only where the policy can rebuild exactly what it would have seen:
    // on a lossy cache (int8) the sequence computes its prompt itself.
    EXPECT_EQ(out.rbegin()->second.usage.cached_tokens,
              dtype == KvDType::F32 ? int32_t(prompt.size() - 1) / 4 * 4 : 0);
    // A full-attention request continuing the sparse one finds the full one's
    // blocks (as far as both texts agree), never the sparse one's generated ones.
    Request next = request("", 20, out);
    next.prompt = prompt;
    next.prompt.insert(next.prompt.end(), got.begin(), got.end());
    std::vector<int32_t> full_text = prompt;
    full_text.insert(full_text.end(), full.begin(), full.end());
    const size_t agree = size_t(
        std::mismatch(next.prompt.begin(), next.prompt.end(), full_text.begin(), full_text.end()).first -
        next.prompt.begin());
    ASSERT_LT(agree, next.prompt.size() - 8);  // the sparse one's own blocks would have matched further
    EXPECT_EQ(run(next), alone(next.prompt, 20, o.kv));
    EXPECT_LE(out.rbegin()->second.usage.cached_tokens, int32_t(agree));
    EXPECT_EQ(engine.stats().kv.blocks_used, 0);
  }
}

// On a lossy cache a topk request sent twice gives the same text: the second
// does not take the first's prompt blocks, whose int8 keys would give its
// block summaries other bounds than the floats it saw computing them.
TEST_F(EngineTest, TopkOnALossyCacheGivesTheSameTextTwice) {
  EngineOptions o;
  o.threads = 1;
  o.kv.set_dtype(KvDType::INT8);
  o.kv.block_size = 4;
  o.kv.num_blocks = 48;
  Engine engine(*model, o);
  std::map<RequestId, Collected> out;
  std::vector<std::vector<int32_t>> texts;
  for (int i = 0; i < 2; ++i) {
    Request r = request("The sun was shining and the children went to the park to play on the swings and the slide. "
                        "They laughed and",
                        75, out);
    r.stop_at_eos = false;
    r.sparsity.policy = "topk";
    r.sparsity.budget = 16;
    const RequestId id = engine.submit(r).id;
    engine.run_until_idle();
    texts.push_back(out[id].tokens);
  }
  EXPECT_EQ(texts[0].size(), 75u);
  EXPECT_EQ(texts[1], texts[0]);
}

// Preemption recomputes, but a preempted sequence's full blocks were
// published to the prefix cache after every step: readmitted, it matches them
// (still idle in memory, or loaded back from a host tier once evicted from
// it) and recomputes only the rest: vLLM's swap-to-host, through the cache.
TEST_F(EngineTest, PreemptedSequencesGetTheirBlocksBackInsteadOfRecomputingThem) {
  EngineOptions o = chunked_tight_options();
  o.scheduler.max_num_seqs = 6;
  EngineOptions plain = o;
  plain.prefix_caching = false;
  const EngineStats recompute = expect_batched_equals_alone(*this, plain, 60);
  const EngineStats cached = expect_batched_equals_alone(*this, o, 60);
  o.kv_tiers = "host:1MiB";
  const EngineStats tiered = expect_batched_equals_alone(*this, o, 60);
  ASSERT_GT(recompute.preemptions, 0);
  ASSERT_GT(cached.preemptions, 0);
  ASSERT_GT(tiered.preemptions, 0);
  // The prompts share nothing: every token saved is a preempted sequence's
  // own. In memory alone some come back (the rest were reclaimed by the very
  // sequences that needed the room: 291 -> 203 tokens redone when measured);
  // a host tier brings back nearly all (25).
  const int64_t redone = recompute.prefill_tokens_computed - recompute.prompt_tokens;
  EXPECT_LT(cached.prefill_tokens_computed - cached.prompt_tokens, redone);
  EXPECT_LT(tiered.prefill_tokens_computed - tiered.prompt_tokens, redone / 4);
  EXPECT_GT(tiered.tier_blocks_loaded, 0);
}

// One thread, 64 blocks of 4 tokens, the last `events` prefix-cache events logged.
EngineOptions logging_cache_events(int32_t events) {
  EngineOptions o;
  o.threads = 1;
  o.kv.block_size = 4;
  o.kv.num_blocks = 64;
  o.cache_event_log = events;
  return o;
}

// Routers poll the prefix cache's events: numbered, paged with `after`, the
// oldest dropped beyond the log's size, with the tenant's name.
TEST_F(EngineTest, CacheEventsArePagedInOrderAndCapped) {
  std::map<RequestId, Collected> out;
  Engine engine(*model, logging_cache_events(16));
  Request r = request("Once upon a time, there was a little girl named Lily", 6, out);
  r.tenant = "acme";
  ASSERT_EQ(engine.submit(std::move(r)).status, SubmitResult::Status::Accepted);
  engine.run_until_idle();
  CacheEventPage all = engine.cache_events({.after = 0, .max = 1000});
  ASSERT_FALSE(all.events.empty());
  EXPECT_EQ(all.events.front().seq, all.first_kept);
  for (size_t i = 0; i < all.events.size(); ++i) {
    EXPECT_EQ(all.events[i].seq, all.first_kept + i);  // consecutive
    EXPECT_EQ(all.events[i].event.kind, CacheEventKind::Stored);
    EXPECT_EQ(all.events[i].tenant, "acme");
  }
  EXPECT_EQ(all.next, all.events.back().seq);
  // Paging: two at a time from the start gives the same sequence.
  CacheEventPage first = engine.cache_events({.after = 0, .max = 2});
  ASSERT_EQ(first.events.size(), 2u);
  EXPECT_EQ(engine.cache_events({.after = first.next, .max = 1000}).events.size(), all.events.size() - 2);
  EXPECT_TRUE(engine.cache_events({.after = all.next, .max = 1000}).events.empty());
  // More than 16 events: only the newest 16 are kept, first_kept says so.
  for (const std::string& p : kPrompts) {
    Request more = request(p, 6, out);
    more.tenant = "acme";
    ASSERT_EQ(engine.submit(std::move(more)).status, SubmitResult::Status::Accepted);
  }
  engine.run_until_idle();
  const CacheEventPage late = engine.cache_events({.after = 0, .max = 1000});
  EXPECT_EQ(late.events.size(), 16u);
  EXPECT_GT(late.first_kept, 1u);
  EXPECT_EQ(late.events.back().seq, late.first_kept + 15);
}

// A query naming a tenant reads that tenant's events and the global
// account's only. Paging one event at a time moves past the other tenants'
// events; when they fill the whole window a query examines, the page is
// empty but `next` still moves, so a caller never loops nor skips its own.
TEST_F(EngineTest, CacheEventsOfOtherTenantsAreFilteredOutAndPagedPast) {
  std::map<RequestId, Collected> out;
  Engine engine(*model, logging_cache_events(1000));
  // One after another, so beta's events lie between acme's ("" = the global scope).
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"acme", kPrompts[4]}, {"beta", kPrompts[7]}, {"beta", kPrompts[2]}, {"acme", kPrompts[1]}, {"", kPrompts[3]}};
  for (const auto& [tenant, prompt] : runs) {
    Request r = request(prompt, 6, out);
    r.tenant = tenant;
    ASSERT_EQ(engine.submit(std::move(r)).status, SubmitResult::Status::Accepted);
    engine.run_until_idle();
  }
  const CacheEventPage all = engine.cache_events({.after = 0, .max = 1000});
  std::map<std::string, int> per_tenant;
  std::vector<uint64_t> acme_view, global_view;  // seqs acme may read, and a tenant with no events of its own
  for (const CacheEventRecord& r : all.events) {
    ++per_tenant[r.tenant];
    if (r.tenant == "acme" || r.tenant.empty()) acme_view.push_back(r.seq);
    if (r.tenant.empty()) global_view.push_back(r.seq);
  }
  ASSERT_GT(per_tenant["acme"], 0);
  ASSERT_GT(per_tenant["beta"], 2);
  ASSERT_GT(per_tenant[""], 0);
  ASSERT_EQ(per_tenant.size(), 3u);

  auto seqs = [](const CacheEventPage& p) {
    std::vector<uint64_t> v;
    for (const CacheEventRecord& r : p.events) v.push_back(r.seq);
    return v;
  };
  const CacheEventPage acme = engine.cache_events({.after = 0, .max = 1000, .tenant = "acme"});
  EXPECT_EQ(seqs(acme), acme_view);
  EXPECT_EQ(acme.next, all.next);  // the whole log examined
  EXPECT_EQ(acme.first_kept, all.first_kept);
  EXPECT_EQ(seqs(engine.cache_events({.after = 0, .max = 1000, .tenant = "nobody"})), global_view);

  for (const size_t window : {size_t(65536), size_t(2)}) {
    std::vector<uint64_t> paged;
    int empty_pages = 0;
    for (uint64_t after = 0; after < all.next;) {
      const CacheEventPage p = engine.cache_events({.after = after, .max = 1, .tenant = "acme", .max_scanned = window});
      ASSERT_GT(p.next, after) << "window " << window;
      ASSERT_LE(p.events.size(), 1u);
      const std::vector<uint64_t> got = seqs(p);
      paged.insert(paged.end(), got.begin(), got.end());
      if (got.empty()) ++empty_pages;
      after = p.next;
    }
    EXPECT_EQ(paged, acme_view) << "window " << window;
    if (window == 2) {
      EXPECT_GT(empty_pages, 0);  // beta's run is longer than the window
    }
  }
}

// A step one sequence cannot run (a token out of range, as a request that
// slipped validation would bring; a sparsity policy that throws partway
// through the pass, kvserve::Error or a library's std::runtime_error, also
// on a thread-pool worker) fails that sequence alone with the error; the
// others of its batch go on and end exactly as they would have: run again at
// once when the pass had not begun, recomputed when it had written their KV.
TEST_F(EngineTest, AStepOneSequenceCannotRunFailsItAlone) {
  enum class Fault { Token, Error, Library, Select };
  for (const Fault fault : {Fault::Token, Fault::Error, Fault::Library, Fault::Select}) {
    const bool partway = fault != Fault::Token;
    SCOPED_TRACE(testing::Message() << "fault " << int(fault));
    testing_faults::ThrowingPolicy throwing(1, "the key index failed", fault >= Fault::Library, fault == Fault::Select);
    EngineOptions o;
    o.threads = 2;
    std::map<RequestId, Collected> out;
    Engine engine(*model, o);
    const std::vector<int32_t> bad_prompt = tok->encode("Zebras do not", true);
    std::vector<int32_t> corrupted = bad_prompt;
    corrupted.back() = model->config().vocab_size;
    const BlockTable* bad_table = nullptr;  // known from its prompt; its decode steps have one token each
    engine.set_batch_hook_for_tests([&](std::vector<BatchEntry>& batch) {
      for (BatchEntry& e : batch) {
        if (std::equal(e.tokens.begin(), e.tokens.end(), bad_prompt.begin(), bad_prompt.end())) bad_table = e.table;
        if (e.table != bad_table) continue;
        if (partway) e.policy = &throwing;
        else e.tokens = corrupted;
      }
    });
    std::map<RequestId, size_t> which;
    RequestId bad = 0;
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      if (i == 7) bad = engine.submit(request("Zebras do not", 20, out)).id;  // its attention on the worker
      which[engine.submit(request(kPrompts[i], 20, out)).id] = i;
    }
    engine.run_until_idle();
    EXPECT_EQ(out[bad].finish, FinishReason::Error);
    EXPECT_EQ(out[bad].error, partway ? "the key index failed" : "token id 512 is out of range (vocabulary of 512)");
    for (const auto& [id, i] : which) {
      EXPECT_NE(out[id].finish, FinishReason::Error) << "prompt " << i << ": " << out[id].error;
      EXPECT_EQ(out[id].tokens, alone(tok->encode(kPrompts[i], true), 20, o.kv)) << "prompt " << i;
    }
    const EngineStats s = engine.stats();
    EXPECT_EQ(s.finished_error, 1);
    EXPECT_EQ(s.preemptions, partway ? int64_t(kPrompts.size()) : 0);  // all ran in the bad one's step
    EXPECT_EQ(s.kv.blocks_used, 0);
    if (fault == Fault::Select) {
      EXPECT_GT(throwing.throws_off_owner.load(), 0);  // thrown on a pool worker
    }
  }
}

TEST_F(EngineTest, PreemptionIsCounted) {
  EngineOptions o;
  o.threads = 1;
  o.kv.block_size = 4;
  o.kv.num_blocks = 30;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  for (const std::string& p : kPrompts) ASSERT_EQ(engine.submit(request(p, 50, out)).status, SubmitResult::Status::Accepted);
  engine.run_until_idle();
  const EngineStats s = engine.stats();
  EXPECT_GT(s.preemptions, 0);
  EXPECT_EQ(s.finished_length + s.finished_stop, int64_t(kPrompts.size()));
  // Recomputed tokens are prefill work beyond the prompts.
  EXPECT_GT(s.prefill_tokens_computed, s.prompt_tokens);
}

TEST_F(EngineTest, StopStringEndsTheTextBeforeIt) {
  EngineOptions o;
  o.threads = 1;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  // Find what the model says, then stop at a word inside it.
  Request probe = request("Once upon a time", 40, out);
  const RequestId pid = engine.submit(probe).id;
  engine.run_until_idle();
  const std::string full = out[pid].text;
  const size_t at = full.find(" was");
  ASSERT_NE(at, std::string::npos) << full;
  Request r = request("Once upon a time", 40, out);
  r.stop = {" was", "zzz"};
  const RequestId id = engine.submit(r).id;
  engine.run_until_idle();
  EXPECT_EQ(out[id].text, full.substr(0, at));
  EXPECT_EQ(out[id].finish, FinishReason::Stop);
  // include_stop_str: the text ends after the match; of two matches at one
  // place the longer counts.
  r.include_stop_str = true;
  r.stop = {" w", "zzz", " was"};
  const RequestId kept = engine.submit(r).id;
  engine.run_until_idle();
  EXPECT_EQ(out[kept].text, full.substr(0, at + 4));
  EXPECT_EQ(out[kept].finish, FinishReason::Stop);
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
}

// EOS ends the text and counts as a completion token (as OpenAI and vLLM
// count it); stop_token_ids end it the same way; min_tokens holds back both
// and the stop strings.
TEST_F(EngineTest, EndTokensCountAndMinTokensHoldThemBack) {
  EngineOptions o;
  o.threads = 1;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  auto run = [&](Request r) {
    const RequestId id = engine.submit(std::move(r)).id;
    engine.run_until_idle();
    return out[id];
  };
  const Collected free = run(request("Once upon a time", 400, out));
  ASSERT_EQ(free.finish, FinishReason::Stop);  // the story ends with EOS
  const int32_t n = int32_t(free.tokens.size());
  EXPECT_EQ(free.usage.completion_tokens, n + 1);
  EXPECT_EQ(engine.stats().generated_tokens, n + 1);

  // min_tokens past the EOS: the same greedy tokens up to it, then others.
  Request longer = request("Once upon a time", 400, out);
  longer.min_tokens = n + 20;
  const Collected held = run(longer);
  ASSERT_GE(int32_t(held.tokens.size()), n + 20);
  EXPECT_EQ(std::vector<int32_t>(held.tokens.begin(), held.tokens.begin() + n), free.tokens);
  EXPECT_NE(held.tokens[size_t(n)], tok->eos_id());

  // A stop token: the first token at index 5 that did not occur before it.
  size_t at = 5;
  while (std::find(free.tokens.begin(), free.tokens.begin() + long(at), free.tokens[at]) != free.tokens.begin() + long(at))
    ++at;
  Request stop_id = request("Once upon a time", 400, out);
  stop_id.stop_token_ids = {free.tokens[at]};
  const Collected stopped = run(stop_id);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free.tokens.begin(), free.tokens.begin() + long(at)));
  EXPECT_EQ(stopped.finish, FinishReason::Stop);
  EXPECT_EQ(stopped.usage.completion_tokens, int32_t(at) + 1);
  std::string want_text;
  int32_t prev = tok->encode("Once upon a time", true).back();
  for (size_t k = 0; k < at; prev = free.tokens[k++]) want_text += tok->decode_piece(prev, free.tokens[k]);
  EXPECT_EQ(stopped.text, want_text);
  // ... held back by min_tokens, it is generated like any other token.
  stop_id.min_tokens = int32_t(at) + 1;
  const Collected past = run(stop_id);
  EXPECT_GT(past.tokens.size(), at);
  EXPECT_EQ(std::vector<int32_t>(past.tokens.begin(), past.tokens.begin() + long(at)),
            std::vector<int32_t>(free.tokens.begin(), free.tokens.begin() + long(at)));

  // A stop string inside the first min_tokens tokens' text is not looked for.
  const size_t word = free.text.find(" was");
  ASSERT_NE(word, std::string::npos);
  Request early = request("Once upon a time", 400, out);
  early.stop = {" was"};
  early.min_tokens = n;
  const Collected kept = run(early);
  EXPECT_EQ(kept.text.substr(0, word + 4), free.text.substr(0, word + 4));
  EXPECT_GE(int32_t(kept.tokens.size()), n);

  // A stop string that begins before min_tokens and ends after it does end
  // the text (the text under min_tokens used to go out whole, so it was
  // never matched): the last 2 characters of token j's piece and the first
  // 2 of token j + 1's, with min_tokens j + 2, reached at token j + 1.
  std::vector<std::string> pieces;
  prev = tok->encode("Once upon a time", true).back();
  for (size_t k = 0; k < free.tokens.size(); prev = free.tokens[k++]) pieces.push_back(tok->decode_piece(prev, free.tokens[k]));
  size_t j = 4, start = 0;
  while (pieces[j].size() < 2 || pieces[j + 1].size() < 2) ++j;
  for (size_t k = 0; k <= j; ++k) start += pieces[k].size();
  start -= 2;
  Request straddle = request("Once upon a time", 400, out);
  straddle.stop = {free.text.substr(start, 4)};
  straddle.min_tokens = int32_t(j) + 2;
  const Collected cut = run(straddle);
  EXPECT_EQ(cut.finish, FinishReason::Stop) << straddle.stop[0];
  EXPECT_EQ(cut.text, free.text.substr(0, start)) << straddle.stop[0];
  EXPECT_EQ(cut.tokens.size(), j + 2);
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
}

// Prompt log-probabilities (echo) come once per prompt token whatever the
// chunking and preemption, equal to one direct pass over the prompt.
TEST_F(EngineTest, PromptLogprobsSurviveChunksAndPreemption) {
  const EngineOptions o = chunked_tight_options();
  Engine engine(*model, o);
  std::map<RequestId, std::vector<TokenLogprobs>> got;
  std::map<RequestId, size_t> which;
  std::mutex mu;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    Request r;
    r.prompt = tok->encode(kPrompts[i], true);
    r.max_tokens = 50;
    r.sampling.temperature = 0;
    r.logprobs = 2;
    r.prompt_logprobs = true;
    r.on_event = [&](const RequestEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (!e.prompt_logprobs.empty()) {
        EXPECT_TRUE(got[e.id].empty()) << "prompt log-probabilities sent twice";
        got[e.id] = e.prompt_logprobs;
      }
    };
    which[engine.submit(std::move(r)).id] = i;
  }
  engine.run_until_idle();
  EXPECT_GT(engine.stats().preemptions, 0);
  for (const auto& [id, entries] : got) {
    const std::vector<int32_t> prompt = tok->encode(kPrompts[which[id]], true);
    ASSERT_EQ(entries.size(), prompt.size() - 1) << kPrompts[which[id]];
    const Logits logits = testing_files::every_position_logits(*model, prompt);
    for (size_t k = 0; k < entries.size(); ++k) {
      const TokenLogprobs want = token_logprobs(logits.row(int32_t(k)), logits.vocab, prompt[k + 1], 2);
      EXPECT_EQ(entries[k].token, prompt[k + 1]);
      EXPECT_NEAR(entries[k].logprob, want.logprob, 1e-4) << k;
      ASSERT_EQ(entries[k].top.size(), 2u);
      EXPECT_EQ(entries[k].top[0].first, want.top[0].first) << k;
    }
  }
  EXPECT_EQ(got.size(), kPrompts.size());
}

TEST_F(EngineTest, InvalidRequestsAreRefusedWithAReason) {
  EngineOptions o;
  o.threads = 1;
  o.kv.num_blocks = 8;  // 128 tokens
  Engine engine(*model, o);
  Request ok;
  ok.prompt = {1, 5, 6};
  ok.max_tokens = 4;
  // `ok` changed by `edit` is refused with a message holding `needle`.
  auto refused = [&](auto edit, const std::string& needle) {
    Request r = ok;
    edit(r);
    SubmitResult s = engine.submit(std::move(r));
    EXPECT_EQ(s.status, SubmitResult::Status::Invalid) << needle;
    EXPECT_NE(s.error.find(needle), std::string::npos) << s.error;
  };
  refused([](Request& r) { r.prompt.clear(); }, "no tokens");
  refused([](Request& r) { r.prompt = {1, 100000}; }, "out of range");
  refused([](Request& r) { r.max_tokens = 0; }, "at least 1");
  refused([](Request& r) { r.max_tokens = 600; }, "context length");
  refused([](Request& r) { r.prompt.assign(600, 5); }, "context length");
  refused([](Request& r) { r.max_tokens = 300; }, "KV blocks");
  refused([](Request& r) { r.sampling.top_p = 2; }, "top");
  refused([](Request& r) { r.stop = {""}; }, "stop");
  refused([](Request& r) { r.stop_token_ids = {100000}; }, "stop token id");
  refused([](Request& r) { r.sampling.logit_bias = {{100000, 1.0f}}; }, "logit bias");
  refused([](Request& r) { r.min_tokens = 5; }, "min_tokens");
  refused([](Request& r) { r.tenant = "global"; }, "reserved");
  refused([](Request& r) { r.sampling.allowed_tokens = {100000}; }, "allowed token id");
  refused([](Request& r) { r.sampling.bad_words = {{5, 100000}}; }, "bad word token id");
  refused([](Request& r) { r.sampling.allowed_tokens = {7}, r.sampling.bad_words = {{7}}; }, "leave no token");
  refused([](Request& r) { r.sampling.allowed_tokens = {2}, r.min_tokens = 1, r.max_tokens = 2; }, "leave no token");
  refused([](Request& r) { r.sampling.repetition_penalty = 0; }, "repetition");
  refused([](Request& r) { r.logprobs = 21; }, "logprobs");
  refused([](Request& r) { r.prompt_logprobs = true; }, "need logprobs");
  EXPECT_EQ(engine.submit(ok).status, SubmitResult::Status::Accepted);
}

TEST_F(EngineTest, FullQueueSaysSoAndCancelledRequestsReturnTheirBlocks) {
  EngineOptions o;
  o.threads = 1;
  o.max_waiting = 3;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(engine.submit(request("Once upon a time", 100, out)).id);
  EXPECT_EQ(engine.submit(request("Lily", 5, out)).status, SubmitResult::Status::QueueFull);
  EXPECT_EQ(engine.stats().requests_rejected, 1);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(engine.step());
  EXPECT_GT(engine.stats().kv.blocks_used, 0);
  for (RequestId id : ids) engine.cancel(id);
  engine.run_until_idle();
  for (RequestId id : ids) {
    EXPECT_EQ(out[id].finish, FinishReason::Cancelled);
    EXPECT_EQ(out[id].tokens.size(), 5u);
  }
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
  EXPECT_EQ(engine.stats().finished_cancelled, 3);
}

// A completion's choices go in together or not at all: the queue decides
// for the whole group (a helper saw n = 9 on an idle server with room for 8
// waiting get 200 or 429 by timing, rolled-back choices refusing others).
TEST_F(EngineTest, RequestGroupsAreQueuedWhollyOrNotAtAll) {
  EngineOptions o;
  o.threads = 1;
  o.max_waiting = 4;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  auto group = [&](int n) {
    std::vector<Request> g;
    for (int i = 0; i < n; ++i) g.push_back(request("Once upon a time", 4, out));
    return g;
  };
  const SubmitBatchResult too_many = engine.submit_all(group(5));  // never fits
  EXPECT_EQ(too_many.status, SubmitResult::Status::Invalid);
  EXPECT_NE(too_many.error.find("more than the waiting queue holds (4)"), std::string::npos) << too_many.error;
  std::vector<Request> bad = group(3);
  bad[2].max_tokens = 0;
  const SubmitBatchResult invalid = engine.submit_all(std::move(bad));
  EXPECT_EQ(invalid.status, SubmitResult::Status::Invalid);
  EXPECT_EQ(invalid.error.rfind("request 2: ", 0), 0u) << invalid.error;
  ASSERT_EQ(engine.submit(request("Lily", 4, out)).status, SubmitResult::Status::Accepted);
  EXPECT_EQ(engine.submit_all(group(4)).status, SubmitResult::Status::QueueFull);  // 1 + 4 > 4: none queued
  const SubmitBatchResult ok = engine.submit_all(group(3));
  ASSERT_EQ(ok.status, SubmitResult::Status::Accepted);
  EXPECT_EQ(ok.ids.size(), 3u);
  engine.run_until_idle();
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.requests_submitted, 4);
  EXPECT_EQ(st.requests_finished, 4);
  EXPECT_EQ(st.finished_cancelled, 0);
  EXPECT_EQ(st.requests_rejected, 4);  // the refused group's 4 sequences, as submitted counts them
  EXPECT_EQ(out.size(), 4u);
}

TEST_F(EngineTest, BackgroundThreadServesConcurrentSubmitters) {
  EngineOptions o;
  o.threads = 1;
  Engine engine(*model, o);
  engine.start();
  std::mutex m;
  std::condition_variable cv;
  std::map<RequestId, Collected> out;
  int done = 0;
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c)
    clients.emplace_back([&, c] {
      Request r;
      r.prompt = tok->encode(kPrompts[size_t(c)], true);
      r.max_tokens = 20;
      r.sampling.temperature = 0;
      r.on_event = [&](const RequestEvent& e) {
        std::lock_guard<std::mutex> lock(m);
        if (e.token >= 0) out[e.id].tokens.push_back(e.token);
        if (e.finish != FinishReason::None) {
          out[e.id].finish = e.finish;
          ++done;
          cv.notify_all();
        }
      };
      EXPECT_EQ(engine.submit(r).status, SubmitResult::Status::Accepted);
    });
  for (auto& t : clients) t.join();
  {
    std::unique_lock<std::mutex> lock(m);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return done == 4; }));
  }
  engine.shutdown(true);
  EXPECT_EQ(engine.stats().requests_finished, 4);
  EXPECT_GT(engine.stats().ttft.count(), 0u);
}

TEST_F(EngineTest, ShutdownWithoutDrainCancelsWhatRuns) {
  EngineOptions o;
  o.threads = 1;
  Engine engine(*model, o);
  std::map<RequestId, Collected> out;
  std::mutex m;
  Request r = request("Once upon a time", 400, out);
  auto inner = r.on_event;
  r.on_event = [&](const RequestEvent& e) {
    std::lock_guard<std::mutex> lock(m);
    inner(e);
  };
  engine.start();
  const RequestId id = engine.submit(r).id;
  engine.shutdown(false);
  std::lock_guard<std::mutex> lock(m);
  EXPECT_EQ(out[id].finish, FinishReason::Cancelled);
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
  EXPECT_EQ(engine.submit(r).status, SubmitResult::Status::QueueFull);
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// Requests sharing a system prompt: with prefix caching, later requests skip
// the shared blocks and still produce exactly the no-cache tokens; tenants
// never hit each other's blocks.
class EnginePrefixTest : public EngineTest {
 public:
  struct Run {
    std::map<RequestId, Collected> out;
    std::vector<RequestId> ids;
    EngineStats stats;
  };
  // The same system prompt (about 6 blocks) then a different question each;
  // requests run one after another.
  Run serve(EngineOptions o, const std::vector<std::string>& tenants) {
    Run run;
    Engine engine(*model, o);
    const std::string system = "Once upon a time, there was a little girl named Lily. She liked to play outside "
                               "in the park with her friends. One day, ";
    for (size_t i = 0; i < tenants.size(); ++i) {
      Request r = request(system + kPrompts[i % kPrompts.size()], 12, run.out);
      r.tenant = tenants[i];
      run.ids.push_back(engine.submit(r).id);
      engine.run_until_idle();
    }
    run.stats = engine.stats();
    return run;
  }
};

TEST_F(EnginePrefixTest, SharedPromptIsComputedOnceAndOutputsAreUnchanged) {
  for (const char* preset : {"fp32", "int4"}) {
    SCOPED_TRACE(preset);
    EngineOptions o;
    o.threads = 1;
    if (std::string(preset) == "int4") apply_kv_preset(o.kv, "int4");
    o.kv.num_blocks = 128;
    const std::vector<std::string> tenants(6, "");
    o.prefix_caching = false;
    const Run cold = serve(o, tenants);
    o.prefix_caching = true;
    const Run warm = serve(o, tenants);
    for (size_t i = 0; i < tenants.size(); ++i)
      EXPECT_EQ(warm.out.at(warm.ids[i]).tokens, cold.out.at(cold.ids[i]).tokens) << "request " << i;
    EXPECT_EQ(cold.stats.cached_prompt_tokens, 0);
    EXPECT_GT(warm.stats.cached_prompt_tokens, 0);
    EXPECT_LT(warm.stats.prefill_tokens_computed, cold.stats.prefill_tokens_computed);
    // The system prompt spans 32 tokens of full blocks at least (2 blocks of 16
    // for fp32, one of 32 for the int4 preset); from the third request on (the
    // int4 preset's FP16 window needs one recompute first) each hits them.
    EXPECT_GE(warm.out.at(warm.ids[5]).usage.cached_tokens, 32);
    EXPECT_EQ(warm.stats.cached_prompt_tokens, warm.stats.prefix.counters.hit_tokens);
  }
}

TEST_F(EnginePrefixTest, RequestsArrivingTogetherWaitForTheSharedPrefixInsteadOfRecomputingIt) {
  EngineOptions o;
  o.threads = 1;
  o.kv.num_blocks = 128;
  Run run;
  Engine engine(*model, o);
  const std::string system = "Once upon a time, there was a little girl named Lily. She liked to play outside "
                             "in the park with her friends. One day, ";
  for (size_t i = 0; i < 4; ++i) run.ids.push_back(engine.submit(request(system + kPrompts[i], 8, run.out)).id);
  engine.run_until_idle();
  for (size_t i = 1; i < 4; ++i) EXPECT_GE(run.out.at(run.ids[i]).usage.cached_tokens, 32) << "request " << i;
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.prefill_tokens_computed, s.prompt_tokens - s.cached_prompt_tokens);
}

TEST_F(EnginePrefixTest, PinnedPromptSurvivesABurstOfOneOffRequests) {
  for (const bool pin : {false, true}) {
    EngineOptions o;
    o.threads = 1;
    o.kv.num_blocks = 24;  // 384 tokens; pins may hold 4 blocks
    std::map<RequestId, Collected> out;
    Engine engine(*model, o);
    Request hot = request("Once upon a time, there was a little girl named Lily. She liked", 4, out);
    hot.pin_prefix = pin;
    engine.submit(hot);
    engine.run_until_idle();
    for (size_t i = 0; i < 20; ++i) {  // ~20 blocks each: far more than the cache holds
      Request one_off = request(std::string(kPrompts[i % kPrompts.size()]) + " " + std::to_string(i) + " and a "
                                "long story about many other things that happened one day in the big park",
                                60, out);
      engine.submit(one_off);
      engine.run_until_idle();
    }
    const RequestId again = engine.submit(hot).id;
    engine.run_until_idle();
    if (pin) EXPECT_GE(out[again].usage.cached_tokens, 16);
    else EXPECT_EQ(out[again].usage.cached_tokens, 0);
    EXPECT_LE(engine.stats().prefix.blocks_pinned, engine.stats().prefix.pin_cap_blocks);
  }
}

// Pins hold at most a fifth of the cache, but a request that fits only the
// whole cache must still run: with nothing running, the engine unpins
// (before, it waited forever and every request behind it with it).
TEST_F(EnginePrefixTest, PinsNeverKeepARequestThatFitsTheCacheWaiting) {
  EngineOptions o;
  o.threads = 1;
  o.kv.block_size = 4;
  o.kv.num_blocks = 40;  // 160 tokens; pins may hold 8 blocks
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  Request hot = request("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                        "sunshine with her big red ball.",
                        1, out);
  hot.pin_prefix = true;
  engine.submit(hot);
  engine.run_until_idle();
  ASSERT_GT(engine.stats().prefix.blocks_pinned, 4);
  const std::vector<int32_t> prompt = tok->encode(kPrompts[4], true);
  const int32_t max_tokens = 150 - int32_t(prompt.size());  // 150 tokens: 38 blocks, more than the unpinned 32
  Request big = request(kPrompts[4], max_tokens, out);
  big.stop_at_eos = false;
  const RequestId id = engine.submit(big).id;
  const RequestId small = engine.submit(request("A cat", 5, out)).id;  // queued behind it
  engine.run_until_idle();
  EXPECT_EQ(out[id].finish, FinishReason::Length);
  EXPECT_EQ(int32_t(out[id].tokens.size()), max_tokens);
  EXPECT_NE(out[small].finish, FinishReason::None);
  EXPECT_EQ(engine.stats().prefix.blocks_pinned, 0);
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
}

// Under a byte budget an integer cache pays for its FP16 staging out of the
// pool. Every request within the advertised limit runs, alone or after one
// that left idle cached blocks behind (a helper found prompts near the limit
// waiting forever on an idle engine: admission asked one staging block more
// than the limit allowed for; and idle blocks' staging slots, whose pool
// blocks no admission counted as reclaimable, wedged the next request).
TEST_F(EnginePrefixTest, RequestsWithinAByteBudgetsLimitAlwaysRun) {
  for (const auto& [preset, budget] : std::vector<std::pair<std::string, int64_t>>{
           {"int4", 400 << 10}, {"int4", 100 << 10}, {"int8", 100 << 10}, {"int2-small", 100 << 10},
           {"int2-small", 128 << 10}, {"int4-small", 150 << 10}}) {
    EngineOptions o;
    o.threads = 1;
    apply_kv_preset(o.kv, preset);
    o.kv.budget_bytes = budget;
    std::map<RequestId, Collected> out;
    Engine engine(*model, o);
    const int32_t most = int32_t(engine.max_sequence_tokens());
    ASSERT_GT(most, 8) << preset;
    auto run = [&](int32_t prompt_tokens) {
      Request r = request("", most - prompt_tokens, out);
      r.prompt = {1};
      for (int32_t k = 1; k < prompt_tokens; ++k) r.prompt.push_back(5 + k % 500);
      r.stop_at_eos = false;
      const SubmitResult s = engine.submit(r);
      EXPECT_EQ(s.status, SubmitResult::Status::Accepted) << preset << " " << s.error;
      engine.run_until_idle();
      EXPECT_EQ(out[s.id].finish, FinishReason::Length) << preset << " " << budget << ": prompt " << prompt_tokens
                                                        << " of " << most;
      EXPECT_EQ(int32_t(out[s.id].tokens.size()), most - prompt_tokens) << preset;
    };
    for (int32_t prompt : {most - 1, most / 2, most / 2, 3, 3}) run(prompt);
    EXPECT_EQ(engine.stats().kv.blocks_used, 0) << preset;
  }
}

// Several requests under a byte budget, preempted and recomputed: a running
// prefill whose next chunk found no staging room (the idle cached block's
// sidecar held it) got no chunk, nothing else ran, and the engine slept with
// requests queued (a helper's int4-small server at 160 KiB stopped after a
// few preemptions, every time).
TEST_F(EnginePrefixTest, ConcurrentRequestsUnderAByteBudgetAllFinish) {
  EngineOptions o;
  o.threads = 1;
  apply_kv_preset(o.kv, "int4-small");
  o.kv.budget_bytes = 160 << 10;
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) {
    Request r = request("", 40, out);
    r.prompt = {1};
    for (int32_t k = 0; k < 50; ++k) r.prompt.push_back(3 + (i * 131 + k * 37) % 509);
    r.stop_at_eos = false;
    ids.push_back(engine.submit(r).id);
  }
  engine.run_until_idle();
  for (RequestId id : ids) {
    EXPECT_EQ(out[id].finish, FinishReason::Length) << id;
    EXPECT_EQ(out[id].tokens.size(), 40u) << id;
  }
  EXPECT_GT(engine.stats().preemptions, 0);
  EXPECT_EQ(engine.stats().kv.blocks_used, 0);
}

// A request waiting for room does not look the prefix cache up at every
// step: match() runs once per admission, so its counters, recency and
// pin-after-hits see admissions only (a helper saw 43,662 query tokens
// counted for 2,120 prompt tokens).
TEST_F(EnginePrefixTest, WaitingRequestsAreNotCountedAsPrefixQueries) {
  EngineOptions o;
  o.threads = 1;
  o.kv.num_blocks = 12;  // 192 tokens: two of the requests below at a time
  std::map<RequestId, Collected> out;
  Engine engine(*model, o);
  const std::string system = "Once upon a time, there was a little girl named Lily. She loved to play outside.";
  engine.submit(request(system, 1, out));
  engine.run_until_idle();
  const int64_t queries_before = engine.stats().prefix.counters.queries;
  std::vector<RequestId> ids;
  for (const char* name : {" Tom", " Sue", " Max", " Ben", " Mia", " Sam"}) {
    Request r = request(system + name + " had a dog.", 40, out);
    r.stop_at_eos = false;
    ids.push_back(engine.submit(r).id);
  }
  engine.run_until_idle();
  for (RequestId id : ids) EXPECT_EQ(out[id].finish, FinishReason::Length);
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.prefix.counters.queries - queries_before, int64_t(ids.size()) + s.preemptions);
}

TEST_F(EnginePrefixTest, TenantsNeverShareBlocks) {
  EngineOptions o;
  o.threads = 1;
  o.kv.num_blocks = 128;
  const Run run = serve(o, {"alice", "bob", "alice", "bob", "carol"});
  auto cached = [&](size_t i) { return run.out.at(run.ids[i]).usage.cached_tokens; };
  EXPECT_EQ(cached(0), 0);
  EXPECT_EQ(cached(1), 0);  // bob's first request: alice's blocks are invisible
  EXPECT_GT(cached(2), 0);
  EXPECT_GT(cached(3), 0);
  EXPECT_EQ(cached(4), 0);
  // One global scope shares across tenants.
  o.prefix_scope = CacheScopeKind::Global;
  const Run shared = serve(o, {"alice", "bob"});
  EXPECT_GT(shared.out.at(shared.ids[1]).usage.cached_tokens, 0);
}

// A returning conversation resends its previous turn, prompt and completion.
// Resent as the same tokens, every preset hits all of the turn's full blocks
// on the next send: a finishing sequence keeps the FP16 form of the blocks
// still in its residual window (PrefixCache::release), the only ones a query
// after the boundary reads in FP16. Resent with a token changed mid-turn (a
// client re-tokenizing sampled text, a chat template re-rendering the
// answer), the blocks before the change left the window long ago and lost
// their FP16 form: a cache with a window longer than one block cannot use
// them exactly (the encoded form alone gives other logits), so it recomputes
// them once, and the send after that hits as a float cache does at once.
// Outputs equal runs without the cache throughout.
TEST_F(EnginePrefixTest, ReturningConversationHitsItsPreviousTurn) {
  for (const char* preset : {"fp16", "int8", "int4", "int2", "int4-small", "int2-small"}) {
    SCOPED_TRACE(preset);
    EngineOptions o;
    o.threads = 1;
    apply_kv_preset(o.kv, preset);
    o.kv.num_blocks = 128;
    const int32_t bs = o.kv.block_size;
    std::map<RequestId, Collected> out, cold_out;
    Engine engine(*model, o);
    o.prefix_caching = false;
    Engine cold(*model, o);
    auto send = [&](const std::vector<int32_t>& prompt, int32_t max_tokens) {
      Request r = request("", max_tokens, out);
      r.prompt = prompt;
      r.stop_at_eos = false;
      const RequestId id = engine.submit(r).id;
      engine.run_until_idle();
      r.on_event = request("", 0, cold_out).on_event;
      const RequestId cold_id = cold.submit(r).id;
      cold.run_until_idle();
      EXPECT_EQ(out[id].tokens, cold_out[cold_id].tokens);
      return out[id];
    };
    std::vector<int32_t> turn = tok->encode("Once upon a time, there was a little girl named Lily. She liked to play",
                                            true);
    const Collected first = send(turn, 140);  // 140 generated: past 2 blocks of 64
    turn.insert(turn.end(), first.tokens.begin(), first.tokens.end());
    // Its last token was sampled, never computed: the cache holds the rest.
    const int32_t whole = (int32_t(turn.size()) - 1) / bs * bs;
    std::vector<int32_t> next = turn;
    const std::vector<int32_t> user = tok->encode(" Then her mom came home.", false);
    next.insert(next.end(), user.begin(), user.end());
    EXPECT_EQ(send(next, 8).usage.cached_tokens, whole);

    std::vector<int32_t> changed = next;
    changed[100] = changed[100] == 300 ? 301 : 300;  // in the completion, past the first 64-token block
    const bool window = o.kv.residual > bs;          // read FP16 before the boundary
    EXPECT_EQ(send(changed, 8).usage.cached_tokens, window ? 0 : 100 / bs * bs);
    EXPECT_EQ(send(changed, 8).usage.cached_tokens, int32_t(changed.size() - 1) / bs * bs);
  }
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// A request's KV sparsity policy runs inside the batch: the tokens equal
// generate() with the same policy, and the sequence holds only its budget.
TEST_F(EngineTest, PerRequestPolicyMatchesGenerateAndBoundsTheKv) {
  const std::vector<int32_t> prompt = tok->encode("Once upon a time", true);
  SparsityOptions window;
  window.policy = "h2o";
  window.budget = 32;
  std::vector<int32_t> want;
  {
    ThreadPool pool(1);
    KvCacheOptions o;
    o.num_blocks = 64;
    KvCache cache(model->config(), o);
    Transformer tf(*model, pool);
    GenerateOptions g;
    g.max_tokens = int32_t(prompt.size()) + 150 - 1;
    g.sampling.temperature = 0;
    g.stop_at_eos = false;
    g.sparsity = window;
    GenerateResult r = generate(tf, cache, prompt, g, [](int32_t, int32_t) {}, tok->bos_id(), tok->eos_id());
    want.assign(r.tokens.begin() + long(prompt.size()), r.tokens.end());
  }
  EngineOptions o;
  o.threads = 1;
  o.kv.num_blocks = 64;
  Engine engine(*model, o);
  std::map<RequestId, Collected> out;
  Request r = request("Once upon a time", 150, out);
  r.stop_at_eos = false;
  r.sparsity = window;
  const RequestId id = engine.submit(r).id;
  Request plain = request("Lily had a red ball", 20, out);  // a full-attention neighbour in the same batches
  const RequestId other = engine.submit(plain).id;
  engine.run_until_idle();
  EXPECT_EQ(out[id].tokens, want);
  EXPECT_EQ(out[other].finish, FinishReason::Length);
  const EngineStats s = engine.stats();
  EXPECT_GT(s.kv.tokens_evicted, 0);
  // 32 kept tokens plus one block of slack and the neighbour's 2 blocks, never the 10 blocks of 155 tokens.
  EXPECT_LE(s.kv_bytes_peak, 6 * s.kv.bytes_per_block);
  EXPECT_EQ(s.kv.blocks_used, 0);

  // A policy the cache cannot serve is refused at submit.
  Request bad = request("Once upon a time", 10, out);
  bad.sparsity.policy = "h2o";
  bad.sparsity.budget = 0;
  EXPECT_EQ(engine.submit(bad).status, SubmitResult::Status::Invalid);
}

}  // namespace
}  // namespace kvserve
