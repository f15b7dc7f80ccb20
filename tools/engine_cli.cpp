#include "tools/engine_cli.h"

#include <fstream>
#include <sstream>

#include "util/error.h"

namespace kvserve::cli {

void add_engine_options(CLI::App& cmd, EngineCliOptions& o) {
  cmd.add_option("--max-num-seqs", o.scheduler.max_num_seqs, "sequences running at once")->capture_default_str();
  cmd.add_option("--max-batch-prefill-tokens", o.scheduler.max_batch_prefill_tokens,
                 "prompt tokens per step, all sequences together")
      ->capture_default_str();
  cmd.add_option("--max-waiting", o.max_waiting, "queued requests beyond which new ones are refused")
      ->capture_default_str();
  cmd.add_option("--prefix-cache", o.prefix_cache, "automatic prefix caching: on | off")->capture_default_str();
  cmd.add_option("--kv-events", o.kv_events,
                 "keep the last N prefix-cache events (block stored / removed) for routers: GET /v1/kv/events "
                 "(0 = off)")
      ->capture_default_str();
  cmd.add_option("--prefix-aware", o.prefix_aware,
                 "scheduling: admit requests with a cached prefix first and hold back those whose prefix another "
                 "running request is computing (on | off)")
      ->capture_default_str();
  cmd.add_option("--prefix-scope", o.prefix_scope,
                 "global (all requests share) | tenant (each tenant its own salted cache)")
      ->capture_default_str();
  cmd.add_option("--prefix-hash", o.prefix_hash, "block keys: xxh3 (fast) | sha256 (collision-resistant)")
      ->capture_default_str();
  cmd.add_option("--prefix-eviction", o.prefix_eviction, "order idle cached blocks are evicted in: lru | lfu | ttl")
      ->capture_default_str();
  cmd.add_option("--prefix-ttl", o.prefix_ttl_seconds, "ttl: seconds an idle cached block lives")
      ->check(finite_in(0, std::numeric_limits<double>::max(), true, true))
      ->capture_default_str();
  cmd.add_option("--prefix-half-life", o.prefix_half_life_seconds, "lfu: seconds for a hit to count half (inf = no aging)")
      ->check(finite_in(0, std::numeric_limits<double>::max(), true, true))
      ->capture_default_str();
  cmd.add_option("--prefix-pin-after-hits", o.pin_after_hits,
                 "pin a cached block once it was reused this often (0 = never)")
      ->capture_default_str();
  cmd.add_option("--prefix-max-pinned", o.max_pinned_fraction, "most of the KV blocks pinned blocks may hold (0..1)")
      ->check(finite_in(0, 1))
      ->capture_default_str();
  cmd.add_option("--tenant-quota-blocks", o.tenant_quota_blocks, "cached blocks per tenant (-1 = no quota)")
      ->check(CLI::Range(-1, std::numeric_limits<int32_t>::max()))
      ->capture_default_str();
  cmd.add_option("--tenant-secret-file", o.tenant_secret_file,
                 "file whose bytes salt tenant caches (same file on every replica; default: random)");
  cmd.add_option("--kv-tiers", o.kv_tiers,
                 "KV tiers below memory, in lookup order: host:SIZE, disk:DIR:SIZE, redis://HOST:PORT[?...] "
                 "(comma-separated; README)");
}

EngineOptions engine_options(const CommonOptions& common, const EngineCliOptions& o, const Model& model,
                             const SparsityOptions& sparsity) {
  EngineOptions e;
  e.kv = kv_options(common, model);
  e.sparsity = sparsity;
  fit_kv_to_sparsity(sparsity, e.kv);
  e.threads = thread_count(common);
  e.scheduler = o.scheduler;
  e.max_waiting = o.max_waiting;
  if (o.prefix_cache != "on" && o.prefix_cache != "off")
    fail("--prefix-cache must be on or off (got '{}')", o.prefix_cache);
  e.prefix_caching = o.prefix_cache == "on";
  if (o.prefix_aware != "on" && o.prefix_aware != "off")
    fail("--prefix-aware must be on or off (got '{}')", o.prefix_aware);
  e.scheduler.prefix_aware = o.prefix_aware == "on";
  if (o.kv_events < 0) fail("--kv-events must be >= 0 (got {})", o.kv_events);
  e.cache_event_log = o.kv_events;
  e.prefix_scope = parse_cache_scope(o.prefix_scope);
  if (e.prefix_scope == CacheScopeKind::Session)
    fail("--prefix-scope session is per request (a session id); choose global or tenant");
  e.prefix.hash = parse_block_hash_algo(o.prefix_hash);
  e.prefix.eviction.kind = parse_eviction_kind(o.prefix_eviction);
  e.prefix.eviction.ttl_seconds = o.prefix_ttl_seconds;
  e.prefix.eviction.half_life_seconds = o.prefix_half_life_seconds;
  e.prefix.pin_after_hits = o.pin_after_hits;
  e.prefix.max_pinned_fraction = o.max_pinned_fraction;
  e.tenant_quota_blocks = o.tenant_quota_blocks;
  e.kv_tiers = o.kv_tiers;
  if (!o.tenant_secret_file.empty()) {
    std::ifstream in(o.tenant_secret_file, std::ios::binary);
    if (!in) fail("cannot read --tenant-secret-file '{}'", o.tenant_secret_file);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    e.tenant_secret = bytes.str();
    if (e.tenant_secret.size() < 16) fail("--tenant-secret-file holds {} bytes; use at least 16", e.tenant_secret.size());
  }
  return e;
}

}  // namespace kvserve::cli
