// Redis Cluster routing: the hash slot of a key (CRC16 of the key, or of its
// hash tag, modulo 16384), MOVED/ASK redirections, and the slot map read from
// CLUSTER SLOTS. Pure functions; the Redis tier keeps the state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/redis_connection.h"

namespace kvserve {

inline constexpr int kRedisSlots = 16384;

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), Redis Cluster's
// key hash. redis_crc16("123456789") == 0x31C3.
uint16_t redis_crc16(std::string_view data);

// The slot of a key. When the key holds a '{' followed later by a '}' with at
// least one byte between them, only those bytes (the first such hash tag) are
// hashed, so keys sharing a tag share a slot.
int redis_key_slot(std::string_view key);

// A "-MOVED <slot> <host>:<port>" or "-ASK <slot> <host>:<port>" error reply.
struct RedisRedirect {
  bool ask = false;  // ASK: ask that node once (slot migrating); MOVED: the slot now lives there
  int slot = 0;
  RedisAddress to;
};
std::optional<RedisRedirect> parse_redis_redirect(std::string_view error, const RedisAddress& asked);

// One line of CLUSTER SLOTS: slots [first, last] are served by `master`.
struct RedisSlotRange {
  int first = 0;
  int last = 0;
  RedisAddress master;
};

// Parses a CLUSTER SLOTS reply. A master announced without a host name ("" or
// "?", when the node does not know its address) is taken to be `asked`'s
// host. nullopt with `error` set on a malformed reply.
std::optional<std::vector<RedisSlotRange>> parse_cluster_slots(const redisReply& reply, const RedisAddress& asked,
                                                               std::string& error);

}  // namespace kvserve
