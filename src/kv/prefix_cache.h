// Prefix caching: full KV blocks, named by their content (block_hash.h), stay
// cached after their sequences finish and are shared by reference with later
// sequences whose prompts start the same way, so a shared system prompt is
// computed and stored once.
//
// One sequence, as the engine drives it (`pc` a PrefixCache on `cache`):
//   std::vector<BlockKey> keys;
//   pc.block_keys(scope, prompt, keys);                  // keys of full blocks
//   PrefixMatch m = pc.match(scope, keys, prompt.size(), table);
//   // table now holds m.cached_tokens tokens; run the rest as usual:
//   cache.reserve(table, prompt.size() - m.cached_tokens); forward(...);
//   pc.publish(scope, table, keys);                      // after every forward
//   // decode: after appending tokens, pc.block_keys(scope, tokens, keys) again
//   pc.release(scope, table, keys);                      // instead of cache.release
// When m.checkpoint_tokens > m.cached_tokens, end the first prefill chunk at
// checkpoint_tokens and publish there (see "Residual windows").
//
// Block states (BlockPool): a cached block is in use while tables or a pin
// reference it, idle when no one does. Idle blocks stay cached, ordered per
// tenant by the EvictionPolicy, and are evicted lazily when an allocation
// finds the free queue empty (this cache is the pool's BlockReclaimer), so
// KvCache::reserve needs no change: a sequence released tail first leaves its
// chain's tail to go before its head.
//
// Exactness. A hit gives the same logits as computing the prompt: matched
// blocks hold exactly the bytes the sequence would have written, because keys
// cover the model, every layer's codec, block size and residual window, and
// because only final blocks are published (full, and sealed when the cache
// has a residual window). The last prompt token is never matched, so its
// logits are always computed.
//
// Residual windows. With a residual window longer than one block
// (e.g. the int4 preset: 2 blocks), a query reads the last
// L = KvCache::staged_before(n) blocks before it from FP16 staging, not from
// their encoded form; a hit ending at block n must therefore bring those
// blocks' FP16 form too. The cache keeps it as a "sidecar" staging slot per
// block, taken (shared, not copied) from tables that still hold it:
//   - release() seals a finishing sequence's last full blocks and publishes
//     them with their staging (multi-turn: the next turn matches to there);
//   - publish() adopts the staging of a table's full blocks that duplicate
//     cached blocks lacking one (a later prompt that diverged mid-chain).
// match() shortens a hit to the longest prefix whose last L blocks have
// sidecars, and then reports checkpoint_tokens: the full match length. If
// the engine ends a prefill chunk there and publishes, the recomputed blocks
// before it give the cache their FP16 form and the next such prompt hits in
// full. Without a residual window (fp32/fp16/bf16) or with a one-block window
// (the int8 preset), L = 0 and no sidecars exist.
//
// Scopes and tenants. Keys chain from a root per scope: `global` (shared by
// all), `tenant` (the tenant's secret salt, from TenantOptions, set by the
// server from the authenticated tenant and never by a client) and `session`
// (salt and session id). A block is also tagged with its account (the tenant,
// or the global account for global scope) and only matches requests of that
// account, so a request of tenant A can never hit a block of tenant B, and a
// hit's timing says nothing about other tenants' prompts. Each account may
// have a quota of cached blocks (publishing beyond it evicts the account's
// own idle blocks, or publishes nothing); under memory pressure the account
// with the most cached blocks per unit of weight loses a block first.
//
// Thread safety: none. The engine thread calls everything; block_keys() is
// const and may run on other threads while no tenant is being added.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/block_hash.h"
#include "kv/block_pool.h"
#include "kv/eviction_policy.h"
#include "kv/kv_cache.h"

namespace kvserve {

using TenantId = int32_t;
// The account of global-scope blocks (and of requests without a tenant).
inline constexpr TenantId kGlobalTenant = 0;

enum class CacheScopeKind : uint8_t { Global, Tenant, Session };

std::string_view cache_scope_name(CacheScopeKind kind);  // "global", "tenant", "session"
// Parses the names above; throws kvserve::Error otherwise.
CacheScopeKind parse_cache_scope(std::string_view name);

// Where a request's blocks are looked up and published. Set by the server
// from the authenticated caller, never from request fields a client controls.
struct CacheScope {
  CacheScopeKind kind = CacheScopeKind::Global;
  TenantId tenant = kGlobalTenant;  // tenant and session scopes: a registered tenant
  std::string session;              // session scope: the session id (non-empty)
};

struct TenantOptions {
  std::string name;          // for stats and logs
  std::string salt;          // secret bytes mixed into the first block's key;
                             // empty = 32 random bytes drawn at registration
  int32_t quota_blocks = -1; // most blocks the tenant may have cached; -1 = no quota
  double weight = 1.0;       // share of the cache under memory pressure (> 0)
};

struct PrefixCacheOptions {
  std::string model_id;             // required: identity of the model (config and weights);
                                    // part of every key
  BlockHashAlgo hash = BlockHashAlgo::Xxh3_128;  // sha256: collision-resistant keys
  EvictionOptions eviction;         // order of idle blocks (default LRU)
  double max_pinned_fraction = 0.2; // pinned blocks never exceed this share of the pool
  int32_t pin_after_hits = 0;       // pin a block once matched this often (0 = only pin())
  size_t max_events = 4096;         // event queue bound; the oldest are dropped beyond it
  TenantOptions global{"global", "", -1, 1.0};  // the global account (salt unused)
};

// What match() did for one request.
struct PrefixMatch {
  int32_t cached_blocks = 0;      // shared blocks now at the start of the table
  int32_t cached_tokens = 0;      // their tokens (= table.num_tokens): prefill skips them
  int32_t checkpoint_tokens = 0;  // > cached_tokens when the hit was shortened for want of
                                  // FP16 sidecars: end a prefill chunk here and publish
};

// Monotonic counters.
struct PrefixCacheCounters {
  int64_t queries = 0;         // match() calls
  int64_t query_tokens = 0;    // prompt tokens looked up
  int64_t hit_tokens = 0;      // of them served from the cache (or loaded into it, count_loaded_hits)
  int64_t query_blocks = 0;    // full prompt blocks that could have matched (the last token excluded)
  int64_t hit_blocks = 0;      // of them served from the cache (or loaded into it, count_loaded_hits)
  int64_t blocks_stored = 0;   // blocks published
  int64_t blocks_evicted = 0;  // dropped for memory or quota
  int64_t blocks_expired = 0;  // dropped by the TTL policy

  double token_hit_rate() const { return query_tokens ? double(hit_tokens) / double(query_tokens) : 0.0; }
  double block_hit_rate() const { return query_blocks ? double(hit_blocks) / double(query_blocks) : 0.0; }
  PrefixCacheCounters& operator+=(const PrefixCacheCounters& o);
};

struct PrefixCacheTenantStats {
  TenantId tenant = kGlobalTenant;
  std::string name;
  PrefixCacheCounters counters;
  int32_t blocks_cached = 0;        // in use or idle
  int32_t blocks_idle = 0;          // evictable
  int32_t blocks_pinned = 0;
  int32_t quota_blocks = -1;
  int64_t memory_saved_bytes = 0;   // see PrefixCacheStats
};

struct PrefixCacheStats {
  PrefixCacheCounters counters;     // all accounts
  int32_t blocks_cached = 0;
  int32_t blocks_idle = 0;
  int32_t blocks_pinned = 0;
  int32_t pin_cap_blocks = 0;       // most blocks pin() may hold
  int32_t sidecars = 0;             // FP16 staging slots kept for residual windows
  int64_t bytes_per_block = 0;      // one block, all layers, in bytes
  // KV bytes that sharing saves right now: for every cached block, the tables
  // beyond the first that reference it, times bytes_per_block.
  int64_t memory_saved_bytes = 0;
  int64_t events_dropped = 0;       // events lost to the queue bound
  std::string hash;                 // "xxh3" or "sha256"
  std::string policy;               // "lru", "lfu" or "ttl"
  std::vector<PrefixCacheTenantStats> tenants;  // indexed by TenantId
};

enum class CacheEventKind : uint8_t { Stored, Removed };
enum class CacheRemoveReason : uint8_t { None, Evicted, Expired, Quota, Cleared };

std::string_view cache_event_kind_name(CacheEventKind kind);        // "stored", "removed"
std::string_view cache_remove_reason_name(CacheRemoveReason reason); // "", "evicted", ...

// One change of the cache's contents, for a router tracking which replica
// holds which prefix (keys are internal: never send them to clients).
struct CacheEvent {
  CacheEventKind kind = CacheEventKind::Stored;
  CacheRemoveReason reason = CacheRemoveReason::None;
  BlockKey key;
  BlockKey parent;                  // the previous block's key; all zero for a first block
  int32_t block = -1;               // physical block id
  int32_t depth = 0;                // block index in its chain
  TenantId tenant = kGlobalTenant;  // the account
  double time = 0.0;                // clock seconds
};

class PrefixCache final : private BlockReclaimer {
 public:
  // The KV cache and the clock must outlive the prefix cache, and no other
  // prefix cache may be attached to the same KV cache. Throws kvserve::Error
  // on invalid options (empty model_id, pin fraction outside [0, 1], ...).
  PrefixCache(KvCache& cache, const PrefixCacheOptions& options, const Clock& clock);
  // Drops every cached block (idle ones return to the free queue; blocks in
  // use are freed when their tables release them).
  ~PrefixCache() override;
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Registers a tenant; ids count up from 1. Throws on a non-positive weight.
  TenantId add_tenant(const TenantOptions& tenant);
  int32_t num_tenants() const { return int32_t(accounts_.size()) - 1; }

  // Appends to `keys` the keys of the full blocks of `tokens` it lacks (keys
  // holds those of a prefix of the same tokens under the same scope).
  // Throws kvserve::Error for an unknown tenant or an empty session id.
  void block_keys(const CacheScope& scope, std::span<const int32_t> tokens, std::vector<BlockKey>& keys) const;

  // Shares the longest usable cached prefix of a prompt of prompt_tokens
  // tokens (keys: its block keys) into the empty table: table.blocks starts
  // with the cached blocks, table.num_tokens = cached_tokens. At most
  // (prompt_tokens - 1) / block_size blocks match.  REQUIRES: table is empty.
  [[nodiscard]] PrefixMatch match(const CacheScope& scope, std::span<const BlockKey> keys, int32_t prompt_tokens,
                                  BlockTable& table);

  // Counts `blocks` more blocks (and their tokens) as hits of the account of
  // the match() just made in `scope`: blocks the caller loaded from elsewhere
  // (the engine's KV tiers) to extend that hit, so a tenant's hits count
  // every cached token its requests were served, not only those found here.
  void count_loaded_hits(const CacheScope& scope, int32_t blocks);

  // Tokens match() would share now for this prompt, without taking them or
  // counting a query (the scheduler's prefix-aware ordering asks this of
  // waiting requests). Expired blocks count as missing. idle_blocks (when
  // given): how many of those blocks are idle, i.e. counted as available
  // in the pool until match() takes them.
  int32_t cached_tokens(const CacheScope& scope, std::span<const BlockKey> keys, int32_t prompt_tokens,
                        int32_t* idle_blocks = nullptr) const;

  // Publishes the table's final blocks (full, and sealed under a residual
  // window) that are not cached yet, in chain order, stopping at the first
  // that is not final, whose parent is not cached, or that the account's
  // quota refuses. Call after every forward (cheap when nothing is new).
  // keys: the table's block keys (may be fewer than its full blocks).
  void publish(const CacheScope& scope, const BlockTable& table, std::span<const BlockKey> keys);

  // Ends a sequence: seals its full blocks still in FP16 staging, publishes
  // them (keeping their staging as sidecars), then releases the table tail
  // first (KvCache::release).
  void release(const CacheScope& scope, BlockTable& table, std::span<const BlockKey> keys);

  // Pins the cached prefix named by keys, from its first block, until a
  // block is missing or the pin cap is reached; pinned blocks are never
  // evicted. Returns how many leading blocks are pinned now.
  [[nodiscard]] int32_t pin(const CacheScope& scope, std::span<const BlockKey> keys);
  // Unpins the cached blocks named by keys (they may become idle).
  void unpin(const CacheScope& scope, std::span<const BlockKey> keys);
  // Unpins every pinned block of every account (they stay cached, idle, until
  // evicted); returns how many. The scheduler's way out when pins alone keep
  // a waiting request from fitting.
  int32_t unpin_all();
  // Gives back the FP16 staging slots (sidecars) idle blocks keep for later
  // hits, with the pool blocks a byte budget paid for them; returns how many.
  // Hits on those blocks then stop before the residual window. The other
  // way out when nothing runs: a finished request's idle block kept a slot
  // whose cost in blocks no admission counted as reclaimable.
  int32_t release_idle_sidecars();
  // Drops idle blocks the policy says have expired (TTL); returns how many.
  int32_t expire();
  // Drops every cached block, pinned ones included.
  void clear();

  PrefixCacheStats stats() const;
  // Moves the queued events (oldest first) out of the queue.
  std::vector<CacheEvent> drain_events();
  // Also calls `listener` synchronously for every event (nullptr: none); it
  // must stay callable until it is replaced or the cache is destroyed (the
  // destructor reports every block removed).
  void set_event_listener(std::function<void(const CacheEvent&)> listener) { listener_ = std::move(listener); }

  const KvCache& kv_cache() const { return cache_; }
  const PrefixCacheOptions& options() const { return options_; }

 private:
  // Position of an idle block in its account's eviction order: priority
  // ascending, then deeper blocks first, then the longest idle.
  struct IdleKey {
    double priority = 0.0;
    int32_t depth = 0;
    uint64_t seq = 0;
    bool operator<(const IdleKey& o) const;
  };
  struct Entry {
    BlockKey key;
    BlockKey parent;        // zero for a first block
    int32_t block = -1;
    TenantId account = kGlobalTenant;
    int32_t sidecar = -1;   // staging slot holding the block's FP16 form, or -1
    bool pinned = false;
    BlockMeta meta;
    IdleKey idle;           // valid while the block is idle
  };
  struct Account {
    TenantOptions options;
    BlockKey root;          // the first block's parent under tenant scope
    PrefixCacheCounters counters;
    int32_t cached = 0;     // entries of the account
    int32_t pinned = 0;
    std::set<std::pair<IdleKey, Entry*>> idle;  // eviction order
  };

  // BlockReclaimer
  void on_idle(int32_t id) override;
  void reclaim(int32_t n) override;

  TenantId account_of(const CacheScope& scope) const;
  // Of `found` matching leading blocks, how many a hit may use: the sidecar
  // rule of match(); sidecar(j) is block j's FP16 slot or -1.
  int32_t usable_blocks(int32_t found, const std::function<int32_t(int32_t)>& sidecar) const;
  BlockKey root_of(const CacheScope& scope) const;
  bool idle(const Entry& e) const { return cache_.pool().ref_count(e.block) == 0; }
  // Takes e out of its account's idle order (it is about to be referenced).
  void leave_idle(Entry& e);
  void pin_entry(Entry& e);
  // Removes e from the cache; its block goes to the free queue if idle.
  void drop(Entry& e, CacheRemoveReason reason);
  // Makes room under the account's quota for one more block.
  bool make_room(Account& account);
  void emit(const CacheEvent& event);
  int32_t pin_cap() const;

  KvCache& cache_;
  BlockPool& pool_;
  PrefixCacheOptions options_;
  const Clock& clock_;
  std::unique_ptr<EvictionPolicy> policy_;
  BlockHasher hasher_;
  int64_t bytes_per_block_ = 0;
  std::unordered_map<BlockKey, Entry, BlockKeyHash> entries_;  // every cached block by key
  std::vector<Entry*> by_block_;   // (num_blocks) the entry caching each block, or nullptr
  std::vector<Account> accounts_;  // (tenants + 1) indexed by TenantId
  BlockKey global_root_;
  int32_t pinned_ = 0;             // pinned entries, all accounts
  int32_t sidecars_ = 0;
  uint64_t idle_seq_ = 0;          // orders blocks that went idle at equal priority
  std::deque<CacheEvent> events_;  // (<= max_events) oldest first
  int64_t events_dropped_ = 0;
  std::function<void(const CacheEvent&)> listener_;
  std::vector<Entry*> hit_;        // scratch of match(): (matched blocks)
};

}  // namespace kvserve
