// The serving engine: requests in, tokens out, many sequences batched into
// each forward pass. Owns the KV cache, the transformer and the scheduler;
// runs them on one engine thread (start()) or synchronously (step()).
//
//   submit() ──> inbox ──> Scheduler (waiting → running, preemption)
//                              │ plan: chunks of prompts + decode tokens
//                              ▼
//                  Transformer::forward(batch) ──> sample ──> RequestCallback
//
// Thread safety: submit, cancel, stats and shutdown may be called from any
// thread; step/run_until_idle only when start() was not called. Callbacks run
// on the engine thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/transformer.h"
#include "kv/eviction_policy.h"
#include "kv/kv_cache.h"
#include "kv/prefix_cache.h"
#include "model/model.h"
#include "store/tiered_kv_store.h"
#include "util/histogram.h"
#include "util/recent_median.h"
#include "util/thread_pool.h"

namespace kvserve {

struct EngineOptions {
  KvCacheOptions kv;              // the cache every sequence shares
  SchedulerOptions scheduler;
  int32_t max_waiting = 256;      // queued requests (not yet running) beyond which submit says QueueFull
  int threads = 0;                // compute threads; 0 = all hardware threads

  // Automatic prefix caching (issue 5).
  bool prefix_caching = true;
  PrefixCacheOptions prefix;      // model_id: empty = the model's fingerprint
  // global: every request shares one cache; tenant: each tenant its own,
  // salted (requests without a tenant use the global account). A request
  // with a session id uses that session's scope under its tenant.
  CacheScopeKind prefix_scope = CacheScopeKind::Tenant;
  // Tenant salts are SHA-256(secret, tenant name): replicas given the same
  // secret share a tenant's blocks (through a shared tier), nobody else can
  // derive them. Empty = a disk tier's kept secret (DIR/tenant.secret,
  // made on first use) when there is one, else a random one per process.
  std::string tenant_secret;
  int32_t tenant_quota_blocks = -1;  // cached blocks per tenant; -1 = no quota

  // The KV sparsity policy of requests that do not name one.
  SparsityOptions sparsity;

  // Tiers below memory (issue 7), e.g. "host:2GiB,disk:/var/kv:20GiB,redis://127.0.0.1:6379"
  // (store/tier_spec.h); empty = none. Needs prefix caching: blocks are found
  // by their prefix-cache keys. Every block the prefix cache publishes is
  // also written to the tiers (off the engine thread); at admission the
  // blocks after the in-memory hit are looked up tier by tier and loaded when
  // the measured load cost is below the measured recompute cost.
  std::string kv_tiers;

  // Prefix-cache events (block stored / removed) kept for routers to poll
  // (cache_events); 0 = none kept.
  int32_t cache_event_log = 0;
};

// One prefix-cache event as the engine logs it for routers: numbered in
// order, with the tenant's name. Keys are salted per tenant, so they say
// which replica holds a block, never what the block holds.
struct CacheEventRecord {
  uint64_t seq = 0;
  CacheEvent event;
  std::string tenant;  // "" = the global account
};

// Which logged events Engine::cache_events returns. A tenant's events are
// its own business: though salted, its chains of keys say which of its
// prompts share a prefix. (The numbering stays shared: the gaps a caller
// sees show how many events others caused, and when.) A caller on
// a tenant's behalf names it and reads only that tenant's events and the
// global account's (the scope every tenant shares).
struct CacheEventQuery {
  uint64_t after = 0;                 // events numbered after this one
  size_t max = 1000;                  // at most this many returned
  std::optional<std::string> tenant;  // only this tenant's and the global account's events; nullopt = every tenant's
  size_t max_scanned = 65536;         // logged events examined at most, returned or not: bounds how long
                                      // the log's lock (taken by the engine thread for every event) is held
};

struct CacheEventPage {
  std::vector<CacheEventRecord> events;  // seq > after, oldest first
  uint64_t next = 0;                     // pass as `after` next time: the last event examined, so events
                                         // filtered out are not examined again
  uint64_t first_kept = 0;               // oldest seq still logged (of any tenant); a gap before it was dropped
};

struct SubmitResult {
  enum class Status : uint8_t { Accepted, QueueFull, Invalid };
  Status status = Status::Accepted;
  RequestId id = 0;               // with Accepted
  std::string error;              // with Invalid: what is wrong, for the client
};

// What submit_all says: every request queued (ids in order) or none.
struct SubmitBatchResult {
  SubmitResult::Status status = SubmitResult::Status::Accepted;
  std::vector<RequestId> ids;     // with Accepted
  std::string error;              // with Invalid or QueueFull
};

// A consistent snapshot of the engine's counters (totals since start).
struct EngineStats {
  // Requests are sequences here: one per prompt and choice (n = 3 is 3).
  int64_t requests_submitted = 0;
  int64_t requests_rejected = 0;        // queue full
  int64_t cancels_requested = 0;        // cancel() calls (a request may be cancelled more than once)
  int64_t requests_finished = 0;        // all reasons
  int64_t finished_stop = 0, finished_length = 0, finished_cancelled = 0, finished_error = 0;
  int64_t prompt_tokens = 0;            // prompt tokens of admitted requests (first admission)
  int64_t cached_prompt_tokens = 0;     // of those, served by the prefix cache
  int64_t prefill_tokens_computed = 0;  // tokens run through the model as prefill (recompute included)
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  int64_t steps = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int32_t max_running = 0;              // most sequences running in one step
  KvStats kv;
  int64_t kv_bytes_peak = 0;            // most KV bytes in use after a step
  std::string kv_codec;                 // the cache's codecs, e.g. "fp16" or "K int4/channel V int4/token"
  bool prefix_caching = false;
  PrefixCacheStats prefix;              // with prefix_caching
  // Tiers (with kv_tiers).
  bool tiers = false;
  TieredStats tier;
  int64_t tier_lookups = 0;             // admissions that asked the tiers
  int64_t tier_lookups_skipped = 0;     // admissions that recomputed because loading measured slower
  int64_t tier_blocks_loaded = 0;       // blocks imported from a tier instead of computed
  int64_t tier_blocks_queued = 0;       // published blocks queued for the tiers (dropped ones not counted)
  int64_t tier_blocks_written = 0;      // of them, stored in at least one tier so far (TieredStats::written)
  double tier_load_ms_per_block = 0;    // measured: lookup + import, per block loaded (median of the last 9 lookups that loaded any)
  double recompute_ms_per_block = 0;    // measured: prefill time per block of tokens (median of the last 9 prefill steps)
  Histogram ttft = Histogram::latency_seconds();   // arrival → first token
  Histogram tpot = Histogram::latency_seconds();   // between consecutive tokens of a request
  Histogram e2e = Histogram::latency_seconds();    // arrival → last event
  double busy_seconds = 0;              // time spent in steps that ran the model
};

// What one request occupies under its sparsity policy (Engine::footprint).
struct SequenceFootprint {
  int64_t held_tokens = 0;           // most tokens in the cache at once
  bool unbounded_positions = false;  // positions may run past the context (sinks)
};

class Engine {
 public:
  // The model must outlive the engine. Throws kvserve::Error on bad options.
  Engine(const Model& model, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request. Invalid: empty prompt, token ids out of
  // range, max_tokens < 1, prompt + max_tokens past the context length or the
  // whole KV cache, bad sampling options, empty stop strings.
  SubmitResult submit(Request request);
  // Several requests as one (a completion's n choices and batched prompts):
  // all are checked, then queued together, or none is. QueueFull when they
  // do not all fit the waiting queue now; Invalid when one is invalid (named
  // by index) or there are more than the queue could ever hold.
  SubmitBatchResult submit_all(std::vector<Request> requests);
  // Asks for a request to end; its final event has FinishReason::Cancelled and
  // its blocks go back to the cache. Unknown or finished ids are ignored.
  void cancel(RequestId id);

  // Runs steps on a background thread until shutdown().
  void start();
  // Stops the background thread. drain: first run every queued and running
  // request to its end; otherwise cancel them (each gets its final event).
  void shutdown(bool drain);

  // Synchronous driving (tests, benchmarks, CLI): one step; false when there
  // was nothing to do. REQUIRES: start() was not called.
  bool step();
  void run_until_idle();

  EngineStats stats() const;
  // Waits until the tiers' writer has stored or failed every block queued so
  // far, so stats() counts them (benchmarks, tests). No-op without tiers.
  void flush_tiers();
  // The logged prefix-cache events the query asks for, oldest first: up to
  // q.max of them, from at most q.max_scanned events after q.after (fewer
  // than q.max, even none, while more follow when other tenants' events
  // filled that window). Thread-safe.
  CacheEventPage cache_events(const CacheEventQuery& q) const;
  const ModelConfig& config() const { return model_.config(); }
  const Model& model() const { return model_; }
  const KvCache& cache() const { return cache_; }
  // The most tokens (prompt + completion) one request may hold with the full
  // policy, FP16 staging of the residual window and a prefill chunk included.
  int64_t max_sequence_tokens() const { return cache_.max_tokens(options_.scheduler.max_batch_prefill_tokens); }
  // A request of `prompt` tokens and `total` in all (prompt + max_tokens)
  // under `sparsity` (the engine's default policy when its policy is empty):
  // an evicting policy holds at most its budget, its prompt's first prefill
  // chunk and its compaction slack; sinks may run past the context. Throws
  // kvserve::Error for a policy this cache cannot run, or whose positions
  // within the cache would pass the context. Thread-safe.
  SequenceFootprint footprint(const SparsityOptions& sparsity, int64_t prompt, int64_t total) const;
  const EngineOptions& options() const { return options_; }
  // Null without prefix caching. Engine thread only (or before start()).
  PrefixCache* prefix_cache() { return prefix_.get(); }
  // Tests only (fault injection): called on the engine thread with each
  // step's batch just before its forward pass, and may change the entries
  // (point one at tokens out of range, or at a policy that throws) to fail
  // the step as a request that slipped validation would. Set before start().
  void set_batch_hook_for_tests(std::function<void(std::vector<BatchEntry>&)> hook) { batch_hook_ = std::move(hook); }

 private:
  struct Inbox {
    std::vector<std::unique_ptr<Sequence>> requests;
    std::vector<RequestId> cancels;
  };

  bool run_step();                        // the body of step(), on the engine thread
  // The plan's forward pass into batch and logits_. A sequence whose step
  // cannot run fails alone (its chunk leaves the plan) and the rest run
  // again, or are recomputed when the pass had begun (BatchEntryError);
  // false when no chunk is left to run.
  bool forward(SchedulePlan& plan, std::vector<BatchEntry>& batch);
  void absorb_inbox();
  void finish(Sequence* seq, FinishReason reason, int32_t token, std::string text, std::string error = {},
              std::optional<TokenLogprobs> logprobs = std::nullopt, bool request_error = false);
  void on_logits(Sequence* seq, const float* logits);
  // Why a request cannot be served, or nullopt (fills in the default sparsity).
  std::optional<std::string> check(Request& r) const;
  // Request::prompt_logprobs: the log-probabilities of the prompt tokens a
  // pass with all_logits predicted (entry e of the batch, its first slot
  // `first`), and moving them onto the request's first event.
  void record_prompt_logprobs(Sequence& seq, const BatchEntry& entry, size_t e, int32_t first);
  void take_prompt_logprobs(Sequence& seq, RequestEvent& ev);
  // Whether sampling `token` ends r's generation (an end or stop token).
  bool ends_generation(const Request& r, int32_t token) const;
  void publish_stats();
  double now() const;
  PrefixHooks prefix_hooks();
  CacheScope scope_for(const Request& r);   // registers the tenant on first sight
  void publish_prefix(Sequence& seq);       // after a forward: cache the sequence's new full blocks
  void on_cache_event(const CacheEvent& e);  // the prefix cache's listener (engine thread)
  void write_published(const Sequence& seq);  // queue blocks the prefix cache just stored for the tiers
  int32_t load_from_tiers(Sequence& seq);   // after an in-memory match: blocks imported from the tiers

  const Model& model_;
  EngineOptions options_;
  ThreadPool pool_;
  KvCache cache_;
  Transformer transformer_;
  SteadyClock clock_;
  std::unique_ptr<PrefixCache> prefix_;   // null without prefix caching
  std::unique_ptr<TieredKvStore> store_;  // null without tiers
  std::vector<CacheEvent> stored_;        // blocks the prefix cache stored since the last write_published
  std::vector<uint8_t> block_bytes_;      // export buffer, one block
  int32_t skipped_since_probe_ = 0;       // tier lookups skipped since the last one made
  RecentMedian tier_load_ms_, recompute_ms_;  // per block; the medians are published in local_
  std::map<std::string, TenantId> tenants_;  // tenant name -> prefix-cache account
  std::string tenant_secret_;
  Scheduler scheduler_;
  // Tokens that end a generation under Request::stop_at_eos: EOS, the
  // vocabulary's end-of-turn tokens and BOS (llama2.c).
  std::vector<int32_t> end_ids_{2, 1};
  const Tokenizer* tokenizer_ = nullptr;
  std::chrono::steady_clock::time_point epoch_;

  // Engine-thread state.
  std::map<RequestId, std::unique_ptr<Sequence>> sequences_;  // waiting or running
  Logits logits_;
  std::function<void(std::vector<BatchEntry>&)> batch_hook_;  // set_batch_hook_for_tests
  EngineStats local_;                     // updated during a step, copied to stats_ after it

  std::mutex inbox_mutex_;                // guards inbox_, next_id_, next_order_, stopping_, drain_
  std::condition_variable inbox_cv_;
  Inbox inbox_;
  RequestId next_id_ = 1;
  uint64_t next_order_ = 0;
  bool stopping_ = false;
  bool drain_ = false;
  std::atomic<int32_t> waiting_{0};       // the scheduler's waiting queue, published after each step

  mutable std::mutex events_mutex_;       // guards event_log_, next_event_seq_, tenant_names_
  std::deque<CacheEventRecord> event_log_;  // at most options_.cache_event_log, oldest first
  uint64_t next_event_seq_ = 1;
  std::map<TenantId, std::string> tenant_names_;

  mutable std::mutex stats_mutex_;        // guards stats_
  EngineStats stats_;

  std::thread thread_;
  std::atomic<bool> started_{false};
};

}  // namespace kvserve
