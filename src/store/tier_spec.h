// The --kv-tiers syntax: tiers in lookup order, separated by commas, or
// "@FILE" for a file with one tier per line ('#' starts a comment).
//
//   host:SIZE                      host memory, e.g. host:2GiB
//   disk:PATH:SIZE                 a directory, e.g. disk:/var/cache/kvserve:20GiB
//                                  (PATH may contain ':'; the last field is the size)
//   redis://[USER@]HOST:PORT[?OPTIONS]   a Redis server or cluster node ([::1]:6379 for IPv6)
//
// Redis options, '&'-separated:
//   auth_file=PATH        `user = ...` / `password = ...` file (chmod 600); a
//                         password is never accepted in the URL itself
//   ttl=SECONDS           block expiry after its last write (default 86400; 0 = never)
//   cluster=auto|0|1      auto (default) asks the server whether it is a cluster
//   seed=HOST:PORT        another cluster node to start from (repeatable)
//   pool=N                connections per node (default 4)
//   timeout_ms=N          command timeout (default 500)
//   connect_timeout_ms=N  connect timeout (default 200)
//   prefix=TEXT           key prefix in a shared Redis (default "kvs:")
//
// Sizes as parse_byte_size reads them (2GiB, 512MiB, 20GB...).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "store/disk_store.h"
#include "store/host_store.h"
#include "store/redis_store.h"
#include "store/tiered_kv_store.h"

namespace kvserve {

struct RedisTierSpec {
  RedisStoreOptions options;  // credentials empty until opened
  std::string auth_file;      // read when the tier is opened; empty = no AUTH
};

using TierSpec = std::variant<HostStoreOptions, DiskStoreOptions, RedisTierSpec>;

// Throws kvserve::Error with the offending part on a bad spec (unknown tier,
// missing size, bad URL or option, a password in the URL, a tier given twice).
std::vector<TierSpec> parse_kv_tiers(std::string_view text);

// Opens one tier (reading its auth file). Throws kvserve::Error when a local
// tier cannot be opened; an unreachable Redis is not an error (it reconnects).
std::unique_ptr<KvStore> open_tier(const TierSpec& spec);

// parse_kv_tiers + open_tier for each + TieredKvStore. Throws kvserve::Error
// naming the tier, before opening any, when a host or disk tier's budget is
// smaller than one record of options.payload_bytes: it would start and refuse
// every block.
std::unique_ptr<TieredKvStore> open_tiered_kv_store(std::string_view text, const TieredKvStoreOptions& options);

}  // namespace kvserve
