// A forward pass that fails partway for one sequence (its sparsity policy
// throws after the pass began) fails that sequence and preempts the others
// (a failure in begin_forward, before anything is written, preempts no one),
// which are recomputed from scratch: under quantized presets (residual
// windows, FP16 staging, blocks sealed mid-pass), with prefix-cache hits
// (sidecars shared with the cache), during decode and during chunked prefill,
// the others end with exactly the tokens they produce alone, the prefix cache
// keeps only exact blocks, and no block or staging slot leaks.
#include <gtest/gtest.h>

#include <map>
#include <stdexcept>

#include "engine/engine.h"
#include "engine/generator.h"
#include "fault_injection.h"
#include "greedy_alone.h"
#include "kv/kv_spec.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::kStoriesGguf;

struct Collected {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::None;
  RequestUsage usage;
  std::string error;
};

// Throws from after_forward: every entry's KV was committed (and sealed) by then.
class AfterForwardThrowing : public SparsityPolicy {
 public:
  std::string_view name() const override { return "after-forward-throwing"; }
  void after_forward(KvCache&, BlockTable&, int32_t) override { throw std::runtime_error("the index rebuild failed"); }
};

enum class Where { OnKv, Select, AfterForward, BeginForward };
enum class When { FirstPass, LaterChunk, Decode };

class EngineMidPassFaultTest : public ::testing::Test {
 public:
  void SetUp() override {
    model = Model::load(kStoriesGguf);
    tok = &model->require_tokenizer();
  }

  std::vector<int32_t> alone(const std::vector<int32_t>& prompt, int32_t max_tokens, const KvCacheOptions& kv,
                             int32_t prefill_chunk, const SparsityOptions& sparsity = {}) {
    return testing_files::greedy_alone(*model, prompt, max_tokens, kv, sparsity, prefill_chunk);
  }

  Request request(const std::vector<int32_t>& prompt, int32_t max_tokens, std::map<RequestId, Collected>& out) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.stop_at_eos = false;
    r.on_event = [&out](const RequestEvent& e) {
      Collected& c = out[e.id];
      if (e.token >= 0) c.tokens.push_back(e.token);
      c.finish = e.finish;
      c.usage = e.usage;
      c.error = e.error;
    };
    return r;
  }

  // Submits `good` and `bad` (inserted at `bad_at`) together, faulting `bad`
  // as `where`/`when` says, and checks the outcome. Returns the stats.
  EngineStats run_with_fault(Engine& engine, const EngineOptions& o, const std::vector<std::vector<int32_t>>& good,
                             const std::vector<int32_t>& bad, size_t bad_at, Where where, When when,
                             int32_t max_tokens) {
    testing_faults::ThrowingPolicy on_kv(1, "the key index failed");
    testing_faults::ThrowingPolicy in_select(2, "the key index failed", /*library=*/true, /*in_select=*/true);
    AfterForwardThrowing after;
    testing_faults::BeginForwardThrowing at_begin("the index could not start");
    SparsityPolicy* policy = where == Where::OnKv     ? static_cast<SparsityPolicy*>(&on_kv)
                             : where == Where::Select ? static_cast<SparsityPolicy*>(&in_select)
                             : where == Where::BeginForward ? static_cast<SparsityPolicy*>(&at_begin)
                                                            : static_cast<SparsityPolicy*>(&after);
    const std::string message = where == Where::AfterForward   ? "the index rebuild failed"
                                : where == Where::BeginForward ? "the index could not start"
                                                               : "the key index failed";

    std::map<RequestId, Collected> out;
    const BlockTable* bad_table = nullptr;
    int32_t first_start = -1;
    bool bad_done = false;
    int fired = 0, others_at_fault = -1, step_at_fault = 0, steps = 0;
    engine.set_batch_hook_for_tests([&](std::vector<BatchEntry>& batch) {
      ++steps;
      if (bad_done) return;
      for (BatchEntry& e : batch) {
        // The text position of the entry's first token (under an evicting
        // policy the table's slots are fewer).
        const int32_t start = e.table->position_of_new(e.table->num_tokens);
        const size_t len = e.tokens.size();
        // Locked on a prefill chunk of 2 tokens or more that no good prompt
        // has at the same place.
        if (bad_table == nullptr && !e.decode && len >= 2 && size_t(start) + len <= bad.size() &&
            std::equal(e.tokens.begin(), e.tokens.end(), bad.begin() + start)) {
          bool unique = true;
          for (const auto& g : good)
            if (size_t(start) + len <= g.size() && std::equal(e.tokens.begin(), e.tokens.end(), g.begin() + start))
              unique = false;
          if (unique) bad_table = e.table, first_start = start;
        }
        if (e.table != bad_table) continue;
        bool fire = false;
        switch (when) {
          case When::FirstPass: fire = true; break;
          case When::LaterChunk: fire = !e.decode && start > first_start; break;
          case When::Decode: fire = e.decode && start >= int32_t(bad.size()) + 2; break;
        }
        if (!fire) continue;
        e.policy = policy;
        if (fired++ == 0) others_at_fault = int(batch.size()) - 1, step_at_fault = steps;
      }
    });
    const int64_t preemptions_before = engine.stats().preemptions;
    std::map<RequestId, size_t> which;
    RequestId bad_id = 0;
    for (size_t i = 0; i <= good.size(); ++i) {
      if (i == bad_at) {
        Request r = request(bad, max_tokens, out);
        auto inner = r.on_event;
        r.on_event = [inner, &bad_done](const RequestEvent& e) {
          inner(e);
          if (e.finish != FinishReason::None) bad_done = true;
        };
        bad_id = engine.submit(r).id;
      }
      if (i < good.size()) which[engine.submit(request(good[i], max_tokens, out)).id] = i;
    }
    engine.run_until_idle();
    engine.set_batch_hook_for_tests({});

    EXPECT_EQ(fired, 1) << "the fault fired at step " << step_at_fault;
    EXPECT_GT(others_at_fault, 0) << "no other sequence shared the faulty pass";
    if (when == When::Decode) {
      EXPECT_EQ(int32_t(out[bad_id].tokens.size()), 3);
    }
    EXPECT_EQ(out[bad_id].finish, FinishReason::Error);
    EXPECT_EQ(out[bad_id].error, message);
    for (const auto& [id, i] : which) {
      EXPECT_EQ(out[id].finish, FinishReason::Length) << "prompt " << i << ": " << out[id].error;
      EXPECT_EQ(out[id].tokens, alone(good[i], max_tokens, o.kv, o.scheduler.max_batch_prefill_tokens, o.sparsity))
          << "prompt " << i;
    }
    last_others_at_fault = others_at_fault;
    const EngineStats s = engine.stats();
    if (where == Where::BeginForward) {
      EXPECT_EQ(s.preemptions, preemptions_before) << "nothing of the others was touched: they run on";
    } else {
      EXPECT_GE(s.preemptions - preemptions_before, others_at_fault);
    }
    expect_clean(s);
    return s;
  }

  static void expect_clean(const EngineStats& s) {
    EXPECT_EQ(s.running + s.waiting, 0);
    EXPECT_EQ(s.kv.blocks_used, 0);
    // Staging slots left are the prefix cache's sidecars only.
    EXPECT_EQ(s.kv.staging_used, s.prefix_caching ? s.prefix.sidecars : 0);
  }

  std::vector<int32_t> encode(const std::string& text) { return tok->encode(text, true); }
  // kPrompts encoded: the sequences that share the faulting one's batch.
  std::vector<std::vector<int32_t>> encoded_prompts();

  // What every case starts from: two threads, `preset` in blocks of
  // block_size tokens (0: the preset's own), num_blocks blocks, no prefix cache.
  static EngineOptions fault_options(const char* preset, int32_t block_size, int32_t num_blocks) {
    EngineOptions o;
    o.threads = 2;
    if (block_size > 0) o.kv.block_size = block_size;
    apply_kv_preset(o.kv, preset, /*keep_block_size=*/block_size > 0);
    o.kv.num_blocks = num_blocks;
    o.prefix_caching = false;
    return o;
  }

  std::unique_ptr<Model> model;
  const Tokenizer* tok = nullptr;
  int last_others_at_fault = -1;  // sequences preempted by the last run_with_fault's fault
};

const std::vector<std::string> kPrompts = {
    "Once upon a time", "Lily had a red ball", "The sun was hot and the sky was blue. Tom",
    "One day, a little bird", "Sam and his mom went to the park to play on the swings. They",
    "There was a big tree", "A cat", "Ben liked to build towers with his blocks. One day"};

const std::string kSystem =
    "Once upon a time, there was a little girl named Lily. She liked to play outside in the park with her friends. "
    "One day, Lily saw a big red ball under a tree. She ran to get it, but a dog came and took it. Lily was sad. "
    "Her mom said: \"Do not be sad, we can find the dog.\" They walked and walked until they saw the dog. ";

std::vector<std::vector<int32_t>> EngineMidPassFaultTest::encoded_prompts() {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& p : kPrompts) out.push_back(encode(p));
  return out;
}

std::string where_name(Where w) {
  return w == Where::OnKv ? "on_kv" : w == Where::Select ? "select" : w == Where::BeginForward ? "begin_forward" : "after_forward";
}
std::string when_name(When w) {
  return w == When::FirstPass ? "first pass" : w == When::LaterChunk ? "later chunk" : "decode";
}

// 1. Quantized presets: blocks sealed mid-pass (for the layers before the
// fault), FP16 staging written past the committed tokens.
TEST_F(EngineMidPassFaultTest, QuantizedPresetsRecoverExactly) {
  for (const char* preset : {"int8", "int4", "int4-small", "int2"}) {
    for (Where where : {Where::OnKv, Where::Select, Where::AfterForward}) {
      for (When when : {When::FirstPass, When::Decode}) {
        if (where == Where::Select && when != When::Decode) continue;  // select runs for decode queries only
        SCOPED_TRACE(testing::Message() << preset << ", " << where_name(where) << ", " << when_name(when));
        // Short blocks: a sequence's prompt and tokens cross several, so
        // blocks fill and seal in the faulty pass.
        const EngineOptions o = fault_options(preset, 8, 200);
        Engine engine(*model, o);
        run_with_fault(engine, o, encoded_prompts(), encode("Zebras do not like the rain. They"), 5, where, when, 30);
      }
    }
  }
}

// A policy that fails in begin_forward, before the pass writes anything:
// only its sequence fails; the others are not preempted and end as alone.
TEST_F(EngineMidPassFaultTest, BeginForwardFaultPreemptsNoOne) {
  for (const char* preset : {"fp32", "int4-small"}) {
    for (When when : {When::FirstPass, When::Decode}) {
      SCOPED_TRACE(testing::Message() << preset << ", " << when_name(when));
      const EngineOptions o = fault_options(preset, 8, 200);
      Engine engine(*model, o);
      run_with_fault(engine, o, encoded_prompts(), encode("Zebras do not like the rain. They"), 5,
                     Where::BeginForward, when, 30);
    }
  }
}

// The presets' own block sizes and windows (32/64-token blocks, 2 blocks of
// FP16), prompts long enough to seal blocks in the faulty pass.
TEST_F(EngineMidPassFaultTest, QuantizedPresetsWithTheirOwnBlocksRecoverExactly) {
  for (const char* preset : {"int4", "int4-small"}) {
    for (When when : {When::FirstPass, When::Decode}) {
      SCOPED_TRACE(testing::Message() << preset << ", " << when_name(when));
      const EngineOptions o = fault_options(preset, 0, 64);
      Engine engine(*model, o);
      std::vector<std::vector<int32_t>> good;
      for (size_t i = 0; i < 4; ++i) good.push_back(encode(kSystem + kPrompts[i]));
      run_with_fault(engine, o, good, encode("Zebras do not like the rain. " + kSystem), 2, Where::OnKv, when, 40);
    }
  }
}

// 2. Prefix cache: the batch hits a prefix a finished request published
// (with sidecars under a residual window); one of the hitting sequences
// faults. After recovery the same prompts hit the cache and still give the
// tokens they give alone, in this engine and batched again.
class EngineMidPassPrefixTest : public EngineMidPassFaultTest {
 public:
  void run_preset(const char* preset);
};

void EngineMidPassPrefixTest::run_preset(const char* preset) {
  for (Where where : {Where::OnKv, Where::Select, Where::AfterForward}) {
    for (When when : {When::FirstPass, When::Decode}) {
      if (where == Where::Select && when != When::Decode) continue;
      SCOPED_TRACE(testing::Message() << preset << ", " << where_name(where) << ", " << when_name(when));
      EngineOptions o = fault_options(preset, 0, 96);
      if (std::string(preset) == "fp32") o.kv.block_size = 16;
      o.prefix_caching = true;
      Engine engine(*model, o);
      const int32_t max_tokens = 24;
      std::map<RequestId, Collected> warm_out;
      const RequestId warm = engine.submit(request(encode(kSystem + "The end."), max_tokens, warm_out)).id;
      engine.run_until_idle();
      ASSERT_EQ(warm_out[warm].finish, FinishReason::Length);
      const int64_t cached_before = engine.stats().cached_prompt_tokens;
      // Under a window of more than one block the hits share FP16 sidecars.
      if (o.kv.residual > o.kv.block_size) {
        EXPECT_GT(engine.stats().prefix.sidecars, 0);
      }

      std::vector<std::vector<int32_t>> good;
      for (size_t i = 0; i < 5; ++i) good.push_back(encode(kSystem + kPrompts[i]));
      const std::vector<int32_t> bad = encode(kSystem + "Zebras do not like the rain. They");
      run_with_fault(engine, o, good, bad, 2, where, when, max_tokens);
      EXPECT_GT(engine.stats().cached_prompt_tokens, cached_before) << "nothing hit the cache";

      // The cache afterwards: every prompt again (the bad one too, now
      // without a fault), one at a time, then batched.
      std::vector<std::vector<int32_t>> all = good;
      all.push_back(bad);
      std::map<RequestId, Collected> out;
      for (const auto& p : all) {
        const RequestId id = engine.submit(request(p, max_tokens, out)).id;
        engine.run_until_idle();
        EXPECT_GT(out[id].usage.cached_tokens, 0);
        EXPECT_EQ(out[id].tokens, alone(p, max_tokens, o.kv, o.scheduler.max_batch_prefill_tokens));
      }
      std::map<RequestId, size_t> which;
      for (size_t i = 0; i < all.size(); ++i) which[engine.submit(request(all[i], max_tokens, out)).id] = i;
      engine.run_until_idle();
      for (const auto& [id, i] : which)
        EXPECT_EQ(out[id].tokens, alone(all[i], max_tokens, o.kv, o.scheduler.max_batch_prefill_tokens))
            << "prompt " << i;
      expect_clean(engine.stats());
    }
  }
}

TEST_F(EngineMidPassPrefixTest, Fp32HitsRecoverAndTheCacheStaysExact) { run_preset("fp32"); }
TEST_F(EngineMidPassPrefixTest, Int4HitsWithSidecarsRecoverAndTheCacheStaysExact) { run_preset("int4"); }
TEST_F(EngineMidPassPrefixTest, Int4SmallHitsWithSidecarsRecoverAndTheCacheStaysExact) { run_preset("int4-small"); }

// 3. Chunked prefill: the bad prompt spans several steps and faults in a
// later chunk, while the others are mid-prefill or decoding; with and
// without the prefix cache, fp32 and int4 (short blocks so chunks seal).
TEST_F(EngineMidPassFaultTest, ChunkedPrefillFaultRecoversExactly) {
  for (const char* preset : {"fp32", "int4", "int4-small"}) {
    for (bool prefix : {false, true}) {
      for (Where where : {Where::OnKv, Where::AfterForward}) {
        SCOPED_TRACE(testing::Message() << preset << ", prefix " << prefix << ", " << where_name(where));
        EngineOptions o = fault_options(preset, 8, 200);
        if (o.kv.residual > 16) o.kv.residual = 16;
        o.scheduler.max_batch_prefill_tokens = 7;
        o.prefix_caching = prefix;
        Engine engine(*model, o);
        std::vector<std::vector<int32_t>> good = encoded_prompts();
        if (prefix) {  // a shared prefix some of the batch hits
          std::map<RequestId, Collected> warm_out;
          engine.submit(request(encode(kPrompts[4] + " went home."), 10, warm_out));
          engine.run_until_idle();
          good.push_back(encode(kPrompts[4] + " saw a dog."));
        }
        run_with_fault(engine, o, good, encode("Zebras do not like the rain. They hid under a big tree."), 3, where,
                       When::LaterChunk, 20);
        if (prefix) {
          std::map<RequestId, Collected> out;
          for (const auto& p : good) {
            const RequestId id = engine.submit(request(p, 20, out)).id;
            engine.run_until_idle();
            EXPECT_EQ(out[id].tokens, alone(p, 20, o.kv, o.scheduler.max_batch_prefill_tokens));
          }
          expect_clean(engine.stats());
        }
      }
    }
  }
}

// 4. The others run under an evicting policy of their own (h2o, window):
// the failed pass fed their policies (scores, evictions, compactions) and
// could not be rolled back; readmitted, each policy starts afresh and the
// others end with exactly the tokens they give alone under that policy.
TEST_F(EngineMidPassFaultTest, OthersUnderAnEvictingPolicyRecoverExactly) {
  for (const char* policy : {"h2o", "window"}) {
    for (const char* preset : {"fp32", "int4"}) {
      for (Where where : {Where::OnKv, Where::Select, Where::AfterForward}) {
        for (When when : {When::FirstPass, When::Decode}) {
          if (where == Where::Select && when != When::Decode) continue;
          SCOPED_TRACE(testing::Message() << policy << ", " << preset << ", " << where_name(where) << ", "
                                          << when_name(when));
          EngineOptions o = fault_options(preset, 4, 200);
          if (o.kv.residual > 8) o.kv.residual = 8;
          o.sparsity.policy = policy;
          o.sparsity.budget = 12;  // the prompts and 30 tokens evict (and compact) before and after the fault
          Engine engine(*model, o);
          run_with_fault(engine, o, encoded_prompts(), encode("Zebras do not like the rain. They"), 5, where, when, 30);
        }
      }
    }
  }
}

// 5. The same under memory pressure: a block budget too small for the batch,
// so the scheduler preempts for memory too, before and after the fault, with
// chunked prefill (the fault in a later chunk or a decode step).
TEST_F(EngineMidPassFaultTest, EvictingPolicyFaultUnderMemoryPressureRecoversExactly) {
  for (const char* policy : {"h2o", "window"}) {
    for (const char* preset : {"fp32", "int4"}) {
      for (When when : {When::LaterChunk, When::Decode}) {
        SCOPED_TRACE(testing::Message() << policy << ", " << preset << ", " << when_name(when));
        EngineOptions o = fault_options(preset, 4, 28);
        if (o.kv.residual > 8) o.kv.residual = 8;
        o.scheduler.max_batch_prefill_tokens = 7;
        o.scheduler.max_num_seqs = 6;
        o.sparsity.policy = policy;
        o.sparsity.budget = 16;
        Engine engine(*model, o);
        const std::vector<int32_t> bad = encode("Zebras do not like the rain. They hid.");
        const EngineStats s = run_with_fault(engine, o, encoded_prompts(), bad, 3, Where::OnKv, when, 40);
        EXPECT_GT(s.preemptions, last_others_at_fault) << "no preemption for memory";
      }
    }
  }
}

}  // namespace
}  // namespace kvserve
