#include "store/redis_store.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <map>

#include "util/error.h"

namespace kvserve {
namespace {

using Clock = std::chrono::steady_clock;

std::string_view reply_text(const redisReply& r) { return std::string_view(r.str, r.len); }

bool is_ok_status(const redisReply& r) { return r.type == REDIS_REPLY_STATUS && reply_text(r) == "OK"; }

}  // namespace

struct RedisStore::Node {
  Node(RedisAddress a, const BackoffOptions& backoff, uint64_t seed) : address(std::move(a)), backoff(backoff, seed) {}

  const RedisAddress address;
  std::mutex mu;  // guards every field below
  std::condition_variable idle_cv;
  std::vector<std::unique_ptr<RedisConnection>> idle;
  int open = 0;       // connections idle or lent out
  bool down = false;  // a connection failed: callers fail fast, the reconnector owns it until it is up
  Backoff backoff;
};

// One command of a batch and its fate.
struct RedisStore::Op {
  int slot = 0;         // routes the command in cluster mode
  RedisCommand command;
  RedisReplyPtr reply;  // the answer (never a redirection) once answered
  bool failed = false;  // unreachable, broken connection or too many redirections
  int node = -1;        // set by a redirection: ask this node instead of routing by slot
  bool asking = false;  // an ASK redirection: send ASKING first
  bool done() const { return reply != nullptr || failed; }
};

RedisStore::RedisStore(const RedisStoreOptions& options)
    : KvStore(options.seeds.empty() ? "redis" : "redis://" + options.seeds.front().str()), options_(options) {
  if (options.seeds.empty()) fail("the Redis tier needs at least one server address");
  if (options.pool_size < 1) fail("the Redis connection pool needs at least 1 connection, got {}", options.pool_size);
  if (options.ttl_seconds < 0) fail("the Redis TTL cannot be negative, got {}", options.ttl_seconds);
  if (options.max_redirects < 0) fail("max_redirects cannot be negative");
  connection_options_.connect_timeout = options.connect_timeout;
  connection_options_.command_timeout = options.command_timeout;
  connection_options_.credentials = options.credentials;
  slots_.fill(-1);
  {
    std::lock_guard lock(topology_mu_);
    for (const RedisAddress& seed : options.seeds) node_for(seed);
  }
  // One synchronous attempt, so a healthy Redis is usable as soon as the
  // constructor returns; otherwise the reconnector takes over.
  bool known = false;
  for (size_t i = 0; i < options.seeds.size() && !known; ++i) {
    Node& node = *nodes_[i];
    std::string error;
    auto conn = RedisConnection::open(node.address, connection_options_, error);
    if (!conn) {
      mark_down(node);
      continue;
    }
    known = discover(*conn, i);
    release(node, std::move(conn));
  }
  reconnector_ = std::thread([this] { reconnect_loop(); });
}

RedisStore::~RedisStore() {
  {
    std::lock_guard lock(wake_mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  reconnector_.join();
}

std::string RedisStore::redis_key(const BlockKey& key, const ChainTag& chain) const {
  std::string out = options_.key_prefix;
  if (chain) {
    out += '{';
    out += chain->hex().substr(0, 32);
    out += '}';
  }
  out += key.hex();
  return out;
}

RedisStore::Node& RedisStore::node_for(const RedisAddress& address) {
  for (auto& n : nodes_)
    if (n->address == address) return *n;
  nodes_.push_back(std::make_unique<Node>(address, options_.backoff, nodes_.size() + 1));
  return *nodes_.back();
}

int RedisStore::route(int slot) const {
  switch (mode_) {
    case Mode::Standalone: return int(standalone_node_);
    case Mode::Cluster: return slots_[size_t(slot)];
    case Mode::Unknown: return -1;
  }
  return -1;
}

bool RedisStore::discover(RedisConnection& conn, size_t node_index) {
  if (options_.cluster == RedisClusterMode::Standalone) {
    std::lock_guard lock(topology_mu_);
    mode_ = Mode::Standalone;
    standalone_node_ = 0;
    return true;
  }
  RedisReplyPtr reply = conn.command(RedisCommand().arg("CLUSTER").arg("SLOTS"));
  if (!reply) return false;
  if (reply->type == REDIS_REPLY_ERROR) {
    if (options_.cluster == RedisClusterMode::Auto && reply_text(*reply).find("cluster support disabled") != std::string_view::npos) {
      std::lock_guard lock(topology_mu_);
      mode_ = Mode::Standalone;
      standalone_node_ = node_index;
      return true;
    }
    counters().add(counters().errors, 1);
    return false;
  }
  std::string error;
  auto ranges = parse_cluster_slots(*reply, conn.address(), error);
  if (!ranges || ranges->empty()) {
    counters().add(counters().errors, 1);
    return false;
  }
  std::lock_guard lock(topology_mu_);
  slots_.fill(-1);
  for (const RedisSlotRange& r : *ranges) {
    Node& node = node_for(r.master);
    int index = 0;
    while (nodes_[size_t(index)].get() != &node) ++index;
    for (int s = r.first; s <= r.last; ++s) slots_[size_t(s)] = int16_t(index);
  }
  mode_ = Mode::Cluster;
  refresh_needed_ = false;
  return true;
}

bool RedisStore::available() const {
  std::lock_guard lock(topology_mu_);
  if (mode_ == Mode::Unknown) return false;
  for (const auto& n : nodes_) {
    std::lock_guard node_lock(n->mu);
    if (n->down) return false;
  }
  return true;
}

bool RedisStore::is_cluster() const {
  std::lock_guard lock(topology_mu_);
  return mode_ == Mode::Cluster;
}

std::unique_ptr<RedisConnection> RedisStore::acquire(Node& node, std::string& error) {
  std::unique_lock lock(node.mu);
  const auto deadline = Clock::now() + options_.command_timeout;
  while (!node.down && node.idle.empty() && node.open >= options_.pool_size) {
    if (node.idle_cv.wait_until(lock, deadline) == std::cv_status::timeout && node.idle.empty() &&
        node.open >= options_.pool_size) {
      error = fmt::format("no free connection to Redis at {} within {} ms", node.address.str(),
                          options_.command_timeout.count());
      return nullptr;
    }
  }
  if (node.down) {
    error = fmt::format("Redis at {} is down; reconnecting in the background", node.address.str());
    return nullptr;
  }
  if (!node.idle.empty()) {
    auto conn = std::move(node.idle.back());
    node.idle.pop_back();
    return conn;
  }
  ++node.open;
  lock.unlock();
  auto conn = RedisConnection::open(node.address, connection_options_, error);
  if (!conn) {
    {
      std::lock_guard relock(node.mu);
      --node.open;
    }
    node.idle_cv.notify_one();
    mark_down(node);
  }
  return conn;
}

void RedisStore::release(Node& node, std::unique_ptr<RedisConnection> conn) {
  const bool broken = conn->broken();
  {
    std::lock_guard lock(node.mu);
    if (broken || node.down) {
      --node.open;
    } else {
      node.idle.push_back(std::move(conn));
    }
  }
  node.idle_cv.notify_one();
  if (broken) mark_down(node);
}

void RedisStore::mark_down(Node& node) {
  std::vector<std::unique_ptr<RedisConnection>> dropped;
  {
    std::lock_guard lock(node.mu);
    if (!node.down) {
      node.down = true;
      node.backoff.failed(Clock::now());
    }
    // Idle connections to a failed server are most likely dead too.
    node.open -= int(node.idle.size());
    dropped.swap(node.idle);
  }
  node.idle_cv.notify_all();
  {
    std::lock_guard lock(topology_mu_);
    // A cluster may have failed the node's slots over to a replica.
    if (mode_ == Mode::Cluster) refresh_needed_ = true;
  }
  wake_reconnector();
}

void RedisStore::wake_reconnector() {
  {
    std::lock_guard lock(wake_mu_);
    wake_ = true;
  }
  wake_cv_.notify_one();
}

void RedisStore::reconnect_loop() {
  for (;;) {
    std::vector<std::pair<size_t, Node*>> nodes;
    {
      std::lock_guard lock(topology_mu_);
      for (size_t i = 0; i < nodes_.size(); ++i) nodes.emplace_back(i, nodes_[i].get());
    }
    auto next_wake = Clock::time_point::max();
    for (auto [index, node] : nodes) {
      {
        std::lock_guard lock(node->mu);
        if (!node->down) continue;
        if (!node->backoff.ready(Clock::now())) {
          next_wake = std::min(next_wake, node->backoff.next_attempt());
          continue;
        }
      }
      std::string error;
      auto conn = RedisConnection::open(node->address, connection_options_, error);
      RedisReplyPtr pong = conn ? conn->command(RedisCommand().arg("PING")) : nullptr;
      std::lock_guard lock(node->mu);
      if (pong && pong->type != REDIS_REPLY_ERROR) {
        node->down = false;
        node->backoff.succeeded();
        ++node->open;
        node->idle.push_back(std::move(conn));
      } else {
        node->backoff.failed(Clock::now());
        next_wake = std::min(next_wake, node->backoff.next_attempt());
      }
    }
    // Learn the topology (first contact, MOVED, a node failure) through any node that is up.
    bool refresh;
    {
      std::lock_guard lock(topology_mu_);
      refresh = mode_ == Mode::Unknown || refresh_needed_;
    }
    if (refresh) {
      bool learned = false;
      for (auto [index, node] : nodes) {
        std::string error;
        auto conn = acquire(*node, error);
        if (!conn) continue;
        learned = discover(*conn, index);
        release(*node, std::move(conn));
        if (learned) break;
      }
      // New nodes from the slot map are connected lazily, by the first call that needs them.
      if (!learned) next_wake = std::min(next_wake, Clock::now() + options_.backoff.initial);
    }
    std::unique_lock lock(wake_mu_);
    if (next_wake == Clock::time_point::max()) wake_cv_.wait(lock, [&] { return wake_ || stop_; });
    else wake_cv_.wait_until(lock, next_wake, [&] { return wake_ || stop_; });
    if (stop_) return;
    wake_ = false;
  }
}

void RedisStore::execute(std::vector<Op>& ops) {
  for (int round = 0; round <= options_.max_redirects; ++round) {
    // Group the unanswered ops by the node they go to.
    std::map<int, std::vector<Op*>> by_node;
    {
      std::lock_guard lock(topology_mu_);
      for (Op& op : ops) {
        if (op.done()) continue;
        const int node = op.node >= 0 ? op.node : route(op.slot);
        if (node < 0) {
          op.failed = true;
          if (mode_ == Mode::Cluster) refresh_needed_ = true;
          continue;
        }
        by_node[node].push_back(&op);
      }
    }
    if (by_node.empty()) return;
    struct Batch {
      Node* node;
      std::unique_ptr<RedisConnection> conn;
      std::vector<Op*> ops;
      size_t replies = 0;
    };
    std::vector<Batch> batches;
    // Send to every node before reading from any: the round trips overlap.
    for (auto& [index, node_ops] : by_node) {
      Node* node;
      {
        std::lock_guard lock(topology_mu_);
        node = nodes_[size_t(index)].get();
      }
      std::string error;
      auto conn = acquire(*node, error);
      if (!conn) {
        for (Op* op : node_ops) op->failed = true;
        continue;
      }
      std::vector<RedisCommand> commands;
      commands.reserve(node_ops.size());
      for (Op* op : node_ops) {
        if (op->asking) commands.push_back(RedisCommand().arg("ASKING"));
        commands.push_back(op->command);
      }
      if (!conn->send(commands)) {
        for (Op* op : node_ops) op->failed = true;
        release(*node, std::move(conn));
        continue;
      }
      batches.push_back(Batch{node, std::move(conn), std::move(node_ops), commands.size()});
    }
    bool moved = false;
    for (Batch& b : batches) {
      std::vector<RedisReplyPtr> replies;
      if (!b.conn->receive(b.replies, replies)) {
        for (Op* op : b.ops) op->failed = true;
        release(*b.node, std::move(b.conn));
        continue;
      }
      size_t r = 0;
      for (Op* op : b.ops) {
        if (op->asking) ++r;  // ASKING's +OK
        RedisReplyPtr& reply = replies[r++];
        op->asking = false;
        if (reply->type == REDIS_REPLY_ERROR) {
          if (auto redirect = parse_redis_redirect(reply_text(*reply), b.conn->address())) {
            std::lock_guard lock(topology_mu_);
            Node& target = node_for(redirect->to);
            int index = 0;
            while (nodes_[size_t(index)].get() != &target) ++index;
            op->node = index;
            op->asking = redirect->ask;
            if (!redirect->ask) {
              slots_[size_t(redirect->slot)] = int16_t(index);
              refresh_needed_ = true;
              moved = true;
            }
            continue;
          }
        }
        op->reply = std::move(reply);
      }
      release(*b.node, std::move(b.conn));
    }
    if (moved) wake_reconnector();
  }
  for (Op& op : ops)
    if (!op.done()) op.failed = true;  // still redirected after max_redirects hops
}

std::vector<RedisStore::Op> RedisStore::key_ops(std::span<const BlockKey> keys, const ChainTag& chain,
                                                std::string_view command, std::vector<std::string>& redis_keys) const {
  redis_keys.clear();
  redis_keys.reserve(keys.size());
  for (const BlockKey& key : keys) redis_keys.push_back(redis_key(key, chain));
  std::vector<Op> ops(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    ops[i].slot = redis_key_slot(redis_keys[i]);
    ops[i].command.arg(command).arg(redis_keys[i]);
  }
  return ops;
}

std::vector<bool> RedisStore::do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                     const ChainTag& chain) {
  std::vector<std::string> redis_keys;
  std::vector<Op> ops = key_ops(keys, chain, "SET", redis_keys);
  const std::string ttl = std::to_string(options_.ttl_seconds);
  for (size_t i = 0; i < keys.size(); ++i) {
    ops[i].command.arg(values[i]);
    if (options_.ttl_seconds > 0) ops[i].command.arg("EX").arg(ttl);
  }
  execute(ops);
  std::vector<bool> stored(keys.size(), false);
  uint64_t errors = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    stored[i] = ops[i].reply && is_ok_status(*ops[i].reply);
    if (!stored[i]) ++errors;
  }
  counters().add(counters().errors, errors);
  return stored;
}

std::vector<std::optional<Bytes>> RedisStore::do_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                                     bool) {
  std::vector<std::string> redis_keys;
  redis_keys.reserve(keys.size());
  for (const BlockKey& key : keys) redis_keys.push_back(redis_key(key, chain));
  // One MGET per slot (all of a chain's keys share one): cluster nodes refuse
  // multi-key commands across slots. A standalone server takes one MGET.
  bool cluster;
  {
    std::lock_guard lock(topology_mu_);
    cluster = mode_ != Mode::Standalone;
  }
  std::map<int, std::vector<size_t>> by_slot;
  for (size_t i = 0; i < keys.size(); ++i) by_slot[cluster ? redis_key_slot(redis_keys[i]) : 0].push_back(i);
  std::vector<Op> ops(by_slot.size());
  std::vector<const std::vector<size_t>*> members;
  size_t o = 0;
  for (const auto& [slot, indices] : by_slot) {
    ops[o].slot = slot;
    ops[o].command.arg("MGET");
    for (size_t i : indices) ops[o].command.arg(redis_keys[i]);
    members.push_back(&indices);
    ++o;
  }
  execute(ops);
  std::vector<std::optional<Bytes>> out(keys.size());
  uint64_t errors = 0;
  for (size_t g = 0; g < ops.size(); ++g) {
    const std::vector<size_t>& indices = *members[g];
    const redisReply* r = ops[g].reply.get();
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != indices.size()) {
      errors += indices.size();
      continue;
    }
    for (size_t j = 0; j < indices.size(); ++j) {
      const redisReply* e = r->element[j];
      if (e->type == REDIS_REPLY_STRING)
        out[indices[j]] = Bytes(reinterpret_cast<const uint8_t*>(e->str), reinterpret_cast<const uint8_t*>(e->str) + e->len);
      else if (e->type != REDIS_REPLY_NIL)
        ++errors;
    }
  }
  counters().add(counters().errors, errors);
  return out;
}

std::vector<bool> RedisStore::do_contains(std::span<const BlockKey> keys, const ChainTag& chain) {
  std::vector<std::string> redis_keys;
  std::vector<Op> ops = key_ops(keys, chain, "EXISTS", redis_keys);
  execute(ops);
  std::vector<bool> out(keys.size(), false);
  uint64_t errors = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const redisReply* r = ops[i].reply.get();
    if (r && r->type == REDIS_REPLY_INTEGER) out[i] = r->integer > 0;
    else ++errors;
  }
  counters().add(counters().errors, errors);
  return out;
}

void RedisStore::do_remove(std::span<const BlockKey> keys, const ChainTag& chain) {
  std::vector<std::string> redis_keys;
  std::vector<Op> ops = key_ops(keys, chain, "UNLINK", redis_keys);
  execute(ops);
  uint64_t errors = 0;
  for (const Op& op : ops)
    if (!op.reply || op.reply->type != REDIS_REPLY_INTEGER) ++errors;
  counters().add(counters().errors, errors);
}

void RedisStore::fill_resident(TierStats& out) const { out.available = available(); }

}  // namespace kvserve
