#include "kv/prefix_cache.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <random>
#include <tuple>

#include "util/error.h"

namespace kvserve {

std::string_view cache_scope_name(CacheScopeKind kind) {
  switch (kind) {
    case CacheScopeKind::Global: return "global";
    case CacheScopeKind::Tenant: return "tenant";
    case CacheScopeKind::Session: return "session";
  }
  return "?";
}

CacheScopeKind parse_cache_scope(std::string_view name) {
  if (name == "global") return CacheScopeKind::Global;
  if (name == "tenant") return CacheScopeKind::Tenant;
  if (name == "session") return CacheScopeKind::Session;
  fail("unknown prefix-cache scope '{}' (expected global, tenant or session)", name);
}

std::string_view cache_event_kind_name(CacheEventKind kind) {
  return kind == CacheEventKind::Stored ? "stored" : "removed";
}

std::string_view cache_remove_reason_name(CacheRemoveReason reason) {
  switch (reason) {
    case CacheRemoveReason::None: return "";
    case CacheRemoveReason::Evicted: return "evicted";
    case CacheRemoveReason::Expired: return "expired";
    case CacheRemoveReason::Quota: return "quota";
    case CacheRemoveReason::Cleared: return "cleared";
  }
  return "?";
}

PrefixCacheCounters& PrefixCacheCounters::operator+=(const PrefixCacheCounters& o) {
  queries += o.queries;
  query_tokens += o.query_tokens;
  hit_tokens += o.hit_tokens;
  query_blocks += o.query_blocks;
  hit_blocks += o.hit_blocks;
  blocks_stored += o.blocks_stored;
  blocks_evicted += o.blocks_evicted;
  blocks_expired += o.blocks_expired;
  return *this;
}

bool PrefixCache::IdleKey::operator<(const IdleKey& o) const {
  return std::tuple(priority, -depth, seq) < std::tuple(o.priority, -o.depth, o.seq);
}

namespace {

const PrefixCacheOptions& checked(const PrefixCacheOptions& o) {
  if (o.model_id.empty()) fail("the prefix cache needs a model id (keys must name the model)");
  if (!(o.max_pinned_fraction >= 0.0 && o.max_pinned_fraction <= 1.0))
    fail("pinned fraction {} is outside [0, 1]", o.max_pinned_fraction);
  if (o.pin_after_hits < 0) fail("pin-after-hits cannot be negative (got {})", o.pin_after_hits);
  if (!(o.global.weight > 0)) fail("the global account's weight must be positive");
  return o;
}

}  // namespace

PrefixCache::PrefixCache(KvCache& cache, const PrefixCacheOptions& options, const Clock& clock)
    : cache_(cache),
      pool_(cache.shared_pool()),
      options_(checked(options)),
      clock_(clock),
      policy_(make_eviction_policy(options.eviction)),
      hasher_(options.hash, kv_cache_identity(cache, options.model_id)),
      bytes_per_block_(cache.stats().bytes_per_block),
      by_block_(size_t(cache.pool().num_blocks()), nullptr) {
  if (cache.block_size() > BlockHasher::kMaxBlockTokens)
    fail("prefix caching supports blocks of up to {} tokens", BlockHasher::kMaxBlockTokens);
  global_root_ = hasher_.digest("kvserve prefix root: global");
  Account global;
  global.options = options_.global;
  global.root = global_root_;
  accounts_.push_back(std::move(global));
  pool_.set_reclaimer(this);
}

PrefixCache::~PrefixCache() {
  clear();
  pool_.set_reclaimer(nullptr);
}

TenantId PrefixCache::add_tenant(const TenantOptions& tenant) {
  if (!(tenant.weight > 0)) fail("tenant '{}' needs a positive weight (got {})", tenant.name, tenant.weight);
  if (tenant.quota_blocks < -1) fail("tenant '{}' quota {} is invalid (-1 = none)", tenant.name, tenant.quota_blocks);
  Account a;
  a.options = tenant;
  if (a.options.salt.empty()) {
    std::random_device rd;
    for (int i = 0; i < 8; ++i) {
      const uint32_t r = rd();
      a.options.salt.append(reinterpret_cast<const char*>(&r), sizeof r);
    }
  }
  a.root = hasher_.digest("kvserve prefix root: tenant\n" + a.options.salt);
  accounts_.push_back(std::move(a));
  return TenantId(accounts_.size() - 1);
}

TenantId PrefixCache::account_of(const CacheScope& scope) const {
  if (scope.kind == CacheScopeKind::Global) return kGlobalTenant;
  if (scope.tenant <= kGlobalTenant || scope.tenant >= TenantId(accounts_.size()))
    fail("{} scope needs a registered tenant (got id {})", cache_scope_name(scope.kind), scope.tenant);
  return scope.tenant;
}

BlockKey PrefixCache::root_of(const CacheScope& scope) const {
  const TenantId id = account_of(scope);
  switch (scope.kind) {
    case CacheScopeKind::Global: return global_root_;
    case CacheScopeKind::Tenant: return accounts_[size_t(id)].root;
    case CacheScopeKind::Session:
      if (scope.session.empty()) fail("session scope needs a session id");
      return hasher_.digest("kvserve prefix root: session\n" + accounts_[size_t(id)].options.salt + '\n' +
                            scope.session);
  }
  return global_root_;
}

void PrefixCache::block_keys(const CacheScope& scope, std::span<const int32_t> tokens,
                             std::vector<BlockKey>& keys) const {
  hasher_.extend(root_of(scope), tokens, cache_.block_size(), keys);
}

int32_t PrefixCache::pin_cap() const {
  return int32_t(std::floor(options_.max_pinned_fraction * double(pool_.num_blocks())));
}

int32_t PrefixCache::cached_tokens(const CacheScope& scope, std::span<const BlockKey> keys, int32_t prompt_tokens,
                                   int32_t* idle_blocks) const {
  const TenantId id = account_of(scope);
  const double now = clock_.now();
  const int32_t bs = cache_.block_size();
  const int32_t eligible = std::min<int32_t>(int32_t(keys.size()), std::max(prompt_tokens - 1, 0) / bs);
  std::vector<const Entry*> hit;
  for (int32_t b = 0; b < eligible; ++b) {
    auto it = entries_.find(keys[size_t(b)]);
    if (it == entries_.end() || it->second.account != id) break;
    if (idle(it->second) && policy_->expired(it->second.meta, now)) break;
    hit.push_back(&it->second);
  }
  const int32_t use = usable_blocks(int32_t(hit.size()), [&](int32_t j) { return hit[size_t(j)]->sidecar; });
  if (idle_blocks)
    *idle_blocks = int32_t(std::count_if(hit.begin(), hit.begin() + use, [&](const Entry* e) { return idle(*e); }));
  return bs * use;
}

int32_t PrefixCache::usable_blocks(int32_t found, const std::function<int32_t(int32_t)>& sidecar) const {
  // Under a residual window the last blocks before the boundary are read in
  // FP16: use the longest prefix whose blocks there have a sidecar.
  for (int32_t use = found; use > 0; --use) {
    bool ok = true;
    for (int32_t j = use - cache_.staged_before(use); j < use && ok; ++j) ok = sidecar(j) >= 0;
    if (ok) return use;
  }
  return 0;
}

PrefixMatch PrefixCache::match(const CacheScope& scope, std::span<const BlockKey> keys, int32_t prompt_tokens,
                               BlockTable& table) {
  assert(table.blocks.empty() && table.num_tokens == 0);
  const TenantId id = account_of(scope);
  Account& account = accounts_[size_t(id)];
  const double now = clock_.now();
  const int32_t bs = cache_.block_size();
  // The last prompt token is always computed: its logits pick the next token.
  const int32_t eligible = std::min<int32_t>(int32_t(keys.size()), std::max(prompt_tokens - 1, 0) / bs);

  hit_.clear();
  for (int32_t b = 0; b < eligible; ++b) {
    auto it = entries_.find(keys[size_t(b)]);
    if (it == entries_.end()) break;
    Entry& e = it->second;
    if (e.account != id) break;  // salted keys already differ; never cross accounts regardless
    if (idle(e) && policy_->expired(e.meta, now)) {
      drop(e, CacheRemoveReason::Expired);
      break;
    }
    hit_.push_back(&e);
  }
  const int32_t found = int32_t(hit_.size());
  const int32_t use = usable_blocks(found, [&](int32_t j) { return hit_[size_t(j)]->sidecar; });

  std::vector<int32_t> blocks, staging;
  blocks.reserve(size_t(use));
  const int32_t staged = cache_.staged_before(use);
  for (int32_t j = 0; j < use; ++j) {
    Entry& e = *hit_[size_t(j)];
    if (idle(e)) leave_idle(e);
    blocks.push_back(e.block);
    if (staged > 0) staging.push_back(j >= use - staged ? e.sidecar : -1);
  }
  cache_.attach_prefix(table, blocks, staging);
  for (int32_t j = 0; j < use; ++j) {
    Entry& e = *hit_[size_t(j)];
    policy_->touch(e.meta, now);
    e.meta.last_access = now;
    ++e.meta.hits;
    if (options_.pin_after_hits > 0 && !e.pinned && e.meta.hits >= options_.pin_after_hits && pinned_ < pin_cap())
      pin_entry(e);
  }

  PrefixMatch m;
  m.cached_blocks = use;
  m.cached_tokens = use * bs;
  m.checkpoint_tokens = use < found ? found * bs : 0;
  PrefixCacheCounters& c = account.counters;
  ++c.queries;
  c.query_tokens += std::max(prompt_tokens, 0);
  c.hit_tokens += m.cached_tokens;
  c.query_blocks += eligible;
  c.hit_blocks += use;
  return m;
}

void PrefixCache::count_loaded_hits(const CacheScope& scope, int32_t blocks) {
  PrefixCacheCounters& c = accounts_[size_t(account_of(scope))].counters;
  c.hit_blocks += blocks;
  c.hit_tokens += int64_t(blocks) * cache_.block_size();
}

void PrefixCache::publish(const CacheScope& scope, const BlockTable& table, std::span<const BlockKey> keys) {
  const TenantId id = account_of(scope);
  Account& account = accounts_[size_t(id)];
  const int32_t n = std::min<int32_t>(table.num_tokens / cache_.block_size(), int32_t(keys.size()));
  const double now = clock_.now();
  auto staging_of = [&table](int32_t b) { return size_t(b) < table.staging.size() ? table.staging[size_t(b)] : -1; };
  auto adopt_sidecar = [&](Entry& e, int32_t b) {
    const int32_t slot = staging_of(b);
    if (e.sidecar >= 0 || slot < 0) return;
    cache_.retain_staging(slot);
    e.sidecar = slot;
    ++sidecars_;
  };
  for (int32_t b = 0; b < n; ++b) {
    const BlockKey& key = keys[size_t(b)];
    const int32_t block = table.blocks[size_t(b)];
    Entry* own = by_block_[size_t(block)];
    if (own != nullptr && own->key == key) continue;  // published before (or matched)
    assert(own == nullptr);  // a block has one content: keys must be the table's
    if (own != nullptr) break;
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      // This table computed a block the cache already holds (its hit was
      // shortened): keep the FP16 form if the cached block lacks one.
      if (it->second.account == id) adopt_sidecar(it->second, b);
      continue;
    }
    if (!cache_.block_final(table, b)) break;
    if (!make_room(account)) break;
    if (b > 0 && !entries_.contains(keys[size_t(b - 1)])) break;  // unreachable without its parent
    Entry& e = entries_[key];
    e.key = key;
    e.parent = b > 0 ? keys[size_t(b - 1)] : BlockKey{};
    e.block = block;
    e.account = id;
    e.meta.depth = b;
    e.meta.stored_at = now;
    policy_->touch(e.meta, now);
    e.meta.last_access = now;
    adopt_sidecar(e, b);
    pool_.mark_cached(block);
    by_block_[size_t(block)] = &e;
    ++account.cached;
    ++account.counters.blocks_stored;
    emit({CacheEventKind::Stored, CacheRemoveReason::None, e.key, e.parent, block, b, id, now});
  }
}

void PrefixCache::release(const CacheScope& scope, BlockTable& table, std::span<const BlockKey> keys) {
  cache_.seal_full_blocks(table);
  publish(scope, table, keys);
  cache_.release(table);
}

bool PrefixCache::make_room(Account& account) {
  const int32_t quota = account.options.quota_blocks;
  if (quota < 0 || account.cached < quota) return true;
  if (account.idle.empty()) return false;
  drop(*account.idle.begin()->second, CacheRemoveReason::Quota);
  return account.cached < quota;
}

void PrefixCache::on_idle(int32_t id) {
  Entry* e = by_block_[size_t(id)];
  assert(e != nullptr && !e->pinned);
  // The sequence that just let go was using it until now.
  e->meta.last_access = clock_.now();
  e->idle = IdleKey{policy_->priority(e->meta), e->meta.depth, idle_seq_++};
  accounts_[size_t(e->account)].idle.emplace(e->idle, e);
}

void PrefixCache::leave_idle(Entry& e) {
  const size_t erased = accounts_[size_t(e.account)].idle.erase({e.idle, &e});
  assert(erased == 1);
  (void)erased;
}

void PrefixCache::reclaim(int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    // Fairness: the account holding the most cached blocks per unit of weight
    // gives one up.
    Account* victim = nullptr;
    double worst = -1.0;
    for (Account& a : accounts_) {
      if (a.idle.empty()) continue;
      const double load = double(a.cached) / a.options.weight;
      if (load > worst) worst = load, victim = &a;
    }
    assert(victim != nullptr);
    drop(*victim->idle.begin()->second, CacheRemoveReason::Evicted);
  }
}

void PrefixCache::pin_entry(Entry& e) {
  if (idle(e)) leave_idle(e);
  pool_.retain(e.block);
  e.pinned = true;
  ++pinned_;
  ++accounts_[size_t(e.account)].pinned;
}

int32_t PrefixCache::pin(const CacheScope& scope, std::span<const BlockKey> keys) {
  const TenantId id = account_of(scope);
  int32_t n = 0;
  for (const BlockKey& key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.account != id) break;
    Entry& e = it->second;
    if (!e.pinned) {
      if (pinned_ >= pin_cap()) break;
      pin_entry(e);
    }
    ++n;
  }
  return n;
}

void PrefixCache::unpin(const CacheScope& scope, std::span<const BlockKey> keys) {
  const TenantId id = account_of(scope);
  for (const BlockKey& key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.account != id || !it->second.pinned) continue;
    Entry& e = it->second;
    e.pinned = false;
    --pinned_;
    --accounts_[size_t(e.account)].pinned;
    pool_.release(e.block);  // may make it idle (on_idle)
  }
}

int32_t PrefixCache::unpin_all() {
  int32_t n = 0;
  for (auto& [key, e] : entries_) {
    if (!e.pinned) continue;
    e.pinned = false;
    --pinned_;
    --accounts_[size_t(e.account)].pinned;
    pool_.release(e.block);  // may make it idle (on_idle)
    ++n;
  }
  return n;
}

int32_t PrefixCache::release_idle_sidecars() {
  int32_t n = 0;
  for (auto& [key, e] : entries_) {
    if (e.sidecar < 0 || !idle(e)) continue;
    cache_.release_staging(e.sidecar);
    e.sidecar = -1;
    --sidecars_;
    ++n;
  }
  return n;
}

void PrefixCache::drop(Entry& e, CacheRemoveReason reason) {
  const int32_t block = e.block;
  Account& account = accounts_[size_t(e.account)];
  const bool was_idle = idle(e);
  if (was_idle) leave_idle(e);
  if (e.sidecar >= 0) {
    cache_.release_staging(e.sidecar);
    --sidecars_;
  }
  if (was_idle) {
    pool_.evict(block);
  } else {
    pool_.unmark_cached(block);
    if (e.pinned) {
      --pinned_;
      --account.pinned;
      pool_.release(block);  // not cached any more: frees it when this was the last reference
    }
  }
  by_block_[size_t(block)] = nullptr;
  --account.cached;
  if (reason == CacheRemoveReason::Expired) ++account.counters.blocks_expired;
  else if (reason != CacheRemoveReason::Cleared) ++account.counters.blocks_evicted;
  const CacheEvent event{CacheEventKind::Removed, reason, e.key, e.parent, block, e.meta.depth, e.account,
                         clock_.now()};
  entries_.erase(event.key);  // not e.key: e dies in the erase
  emit(event);
}

int32_t PrefixCache::expire() {
  const double now = clock_.now();
  int32_t n = 0;
  for (Account& a : accounts_) {
    while (!a.idle.empty() && policy_->expired(a.idle.begin()->second->meta, now)) {
      drop(*a.idle.begin()->second, CacheRemoveReason::Expired);
      ++n;
    }
  }
  return n;
}

void PrefixCache::clear() {
  // Children first, so no event names a parent that is already gone.
  std::vector<Entry*> all;
  all.reserve(entries_.size());
  for (auto& [key, e] : entries_) all.push_back(&e);
  std::sort(all.begin(), all.end(), [](const Entry* a, const Entry* b) {
    return std::pair(a->meta.depth, a->block) > std::pair(b->meta.depth, b->block);
  });
  for (Entry* e : all) drop(*e, CacheRemoveReason::Cleared);
}

void PrefixCache::emit(const CacheEvent& event) {
  if (listener_) listener_(event);
  if (options_.max_events == 0) {
    ++events_dropped_;
    return;
  }
  if (events_.size() == options_.max_events) {
    events_.pop_front();
    ++events_dropped_;
  }
  events_.push_back(event);
}

std::vector<CacheEvent> PrefixCache::drain_events() {
  std::vector<CacheEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s;
  s.hash = std::string(block_hash_algo_name(options_.hash));
  s.policy = std::string(policy_->name());
  s.bytes_per_block = bytes_per_block_;
  s.pin_cap_blocks = pin_cap();
  s.sidecars = sidecars_;
  s.events_dropped = events_dropped_;
  s.tenants.resize(accounts_.size());
  for (size_t i = 0; i < accounts_.size(); ++i) {
    const Account& a = accounts_[i];
    PrefixCacheTenantStats& t = s.tenants[i];
    t.tenant = TenantId(i);
    t.name = a.options.name;
    t.counters = a.counters;
    t.blocks_cached = a.cached;
    t.blocks_idle = int32_t(a.idle.size());
    t.blocks_pinned = a.pinned;
    t.quota_blocks = a.options.quota_blocks;
  }
  for (const auto& [key, e] : entries_) {
    const int32_t tables = pool_.ref_count(e.block) - (e.pinned ? 1 : 0);
    s.tenants[size_t(e.account)].memory_saved_bytes += int64_t(std::max(tables - 1, 0)) * bytes_per_block_;
  }
  for (const PrefixCacheTenantStats& t : s.tenants) {
    s.counters += t.counters;
    s.blocks_cached += t.blocks_cached;
    s.blocks_idle += t.blocks_idle;
    s.blocks_pinned += t.blocks_pinned;
    s.memory_saved_bytes += t.memory_saved_bytes;
  }
  return s;
}

}  // namespace kvserve
