// The Redis tier: blocks in a Redis server or a Redis Cluster that many
// kvserve replicas share, so a prefix one replica computed is reused by all.
//
// Keys: `<prefix>{<chain tag>}<key hex>`, where the tag is the first 16 bytes
// (32 hex digits) of the chain's first block key (see ChainTag), or
// `<prefix><key hex>` when a call names no chain. All blocks of a chain thus
// hash to one cluster slot and a lookup of the next N blocks is one MGET to
// one node: one round trip. The trade-off: a chain never spreads over nodes,
// so one very long or very popular prefix (a fleet-wide system prompt and all
// conversations that start with it) loads one node; without a tag, blocks
// spread evenly but a lookup becomes one command per slot, still pipelined
// to all nodes at once (about one round trip, more work per block).
//
// Values are written with SET ... EX ttl (pipelined, one round trip per
// batch): a block expires ttl seconds after its last write. Reads are MGET.
// Eviction under memory pressure is Redis's (maxmemory-policy allkeys-lru
// recommended).
//
// Modes: standalone, or cluster (the slot map from CLUSTER SLOTS; MOVED
// updates it and triggers a refresh, ASK is followed once with ASKING). In
// Auto mode the first reachable seed is asked CLUSTER SLOTS and the answer
// decides.
//
// Faults never reach the caller as exceptions or long waits: each node has a
// pool of connections with connect and command timeouts. A node whose
// connection fails is marked down; from then on calls that need it fail at
// once (misses, puts not stored; counted in stats().errors) while a background
// thread reconnects with exponential backoff, re-reads the slot map, and
// marks it up again. A flushed or restarted Redis just yields misses.
//
// Thread safety: all methods. topology_mu_ guards the node list and slot map;
// each node's mu guards its pool and state; the order is topology_mu_ before a
// node's mu; wake_mu_ guards the reconnector's wake flag.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/backoff.h"
#include "store/kv_store.h"
#include "store/redis_cluster.h"
#include "store/redis_connection.h"

namespace kvserve {

enum class RedisClusterMode : uint8_t {
  Auto,        // ask the first reachable seed
  Standalone,  // one server: seeds[0]
  Cluster,     // a Redis Cluster reachable through any seed
};

struct RedisStoreOptions {
  std::vector<RedisAddress> seeds;                    // at least one: the server, or cluster nodes to start from
  RedisClusterMode cluster = RedisClusterMode::Auto;
  RedisCredentials credentials;                       // AUTH; see load_redis_credentials
  std::string key_prefix = "kvs:";                    // namespaces kvserve's keys in a shared Redis
  int64_t ttl_seconds = 86400;                        // per block, from its last write; 0 = never expires
  int pool_size = 4;                                  // connections per node, at least 1
  std::chrono::milliseconds connect_timeout{200};     // per connection attempt
  std::chrono::milliseconds command_timeout{500};     // per socket read/write, and the longest wait for a pooled connection
  BackoffOptions backoff;                             // between reconnect attempts to a failed node
  int max_redirects = 3;                              // MOVED/ASK hops followed per command
};

class RedisStore final : public KvStore {
 public:
  // Tries the seeds once (each bounded by connect_timeout); if none answers the
  // store starts down and keeps reconnecting in the background. Throws
  // kvserve::Error only on invalid options.
  explicit RedisStore(const RedisStoreOptions& options);
  ~RedisStore() override;

  // The Redis key a block is stored under.
  std::string redis_key(const BlockKey& key, const ChainTag& chain) const;
  // Whether the topology is known (a seed answered) and every node is up.
  bool available() const;
  // Whether the store talks to a cluster (false while unknown).
  bool is_cluster() const;

 private:
  struct Node;
  struct Op;
  enum class Mode : uint8_t { Unknown, Standalone, Cluster };

  std::vector<bool> do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                           const ChainTag& chain) override;
  std::vector<std::optional<Bytes>> do_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                           bool leading_only) override;
  std::vector<bool> do_contains(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void do_remove(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void fill_resident(TierStats& out) const override;

  // Runs the commands, following redirections; each op ends answered or failed.
  void execute(std::vector<Op>& ops);
  // One op per key with `command name, key` (EXISTS, UNLINK...).
  std::vector<Op> key_ops(std::span<const BlockKey> keys, const ChainTag& chain, std::string_view command,
                          std::vector<std::string>& redis_keys) const;

  std::unique_ptr<RedisConnection> acquire(Node& node, std::string& error);
  void release(Node& node, std::unique_ptr<RedisConnection> conn);
  void mark_down(Node& node);
  Node& node_for(const RedisAddress& address);  // REQUIRES: topology_mu_ held
  int route(int slot) const;                    // REQUIRES: topology_mu_ held; -1 = unknown
  // Reads the topology through `conn`; false when the answer is unusable.
  bool discover(RedisConnection& conn, size_t node_index);
  void reconnect_loop();
  void wake_reconnector();

  const RedisStoreOptions options_;
  RedisConnectionOptions connection_options_;

  mutable std::mutex topology_mu_;
  std::vector<std::unique_ptr<Node>> nodes_;      // guarded by topology_mu_; never shrinks, so Node& stay valid
  std::array<int16_t, kRedisSlots> slots_{};      // guarded by topology_mu_: node index per slot, -1 unknown
  Mode mode_ = Mode::Unknown;                     // guarded by topology_mu_
  size_t standalone_node_ = 0;                    // guarded by topology_mu_
  bool refresh_needed_ = false;                   // guarded by topology_mu_: re-read CLUSTER SLOTS

  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool wake_ = false;  // guarded by wake_mu_
  bool stop_ = false;  // guarded by wake_mu_
  std::thread reconnector_;
};

}  // namespace kvserve
