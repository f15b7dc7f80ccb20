#include "store/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <array>
#include <charconv>

#include "util/error.h"

namespace kvserve {
namespace {

constexpr std::array<uint16_t, 256> make_crc16_table() {
  std::array<uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    uint16_t crc = uint16_t(i << 8);
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? uint16_t((crc << 1) ^ 0x1021) : uint16_t(crc << 1);
    t[size_t(i)] = crc;
  }
  return t;
}

constexpr std::array<uint16_t, 256> kCrc16Table = make_crc16_table();

std::optional<int> parse_int(std::string_view s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace

uint16_t redis_crc16(std::string_view data) {
  uint16_t crc = 0;
  for (const char c : data) crc = uint16_t((crc << 8) ^ kCrc16Table[((crc >> 8) ^ uint8_t(c)) & 0xFF]);
  return crc;
}

int redis_key_slot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return redis_crc16(key) & (kRedisSlots - 1);
}

std::optional<RedisRedirect> parse_redis_redirect(std::string_view error, const RedisAddress& asked) {
  RedisRedirect r;
  if (error.starts_with("MOVED ")) error.remove_prefix(6);
  else if (error.starts_with("ASK ")) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const size_t space = error.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  const auto slot = parse_int(error.substr(0, space));
  if (!slot || *slot < 0 || *slot >= kRedisSlots) return std::nullopt;
  r.slot = *slot;
  std::string_view target = error.substr(space + 1);
  // Redis 7 may announce ":port" when the node does not know its own address.
  if (target.starts_with(':')) {
    const auto port = parse_int(target.substr(1));
    if (!port) return std::nullopt;
    r.to = RedisAddress{asked.host, *port};
    return r;
  }
  auto to = parse_redis_address(target);
  if (!to) return std::nullopt;
  r.to = *to;
  return r;
}

std::optional<std::vector<RedisSlotRange>> parse_cluster_slots(const redisReply& reply, const RedisAddress& asked,
                                                               std::string& error) {
  if (reply.type != REDIS_REPLY_ARRAY) {
    error = "CLUSTER SLOTS did not answer an array";
    return std::nullopt;
  }
  std::vector<RedisSlotRange> out;
  for (size_t i = 0; i < reply.elements; ++i) {
    const redisReply* r = reply.element[i];
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 3 || r->element[0]->type != REDIS_REPLY_INTEGER ||
        r->element[1]->type != REDIS_REPLY_INTEGER || r->element[2]->type != REDIS_REPLY_ARRAY) {
      error = fmt::format("CLUSTER SLOTS entry {} is malformed", i);
      return std::nullopt;
    }
    const redisReply* node = r->element[2];
    if (node->elements < 2 || node->element[0]->type != REDIS_REPLY_STRING ||
        node->element[1]->type != REDIS_REPLY_INTEGER) {
      error = fmt::format("CLUSTER SLOTS entry {} has a malformed master", i);
      return std::nullopt;
    }
    RedisSlotRange range;
    range.first = int(r->element[0]->integer);
    range.last = int(r->element[1]->integer);
    if (range.first < 0 || range.last >= kRedisSlots || range.first > range.last) {
      error = fmt::format("CLUSTER SLOTS entry {} has slots {}-{} out of range", i, range.first, range.last);
      return std::nullopt;
    }
    std::string host(node->element[0]->str, node->element[0]->len);
    if (host.empty() || host == "?") host = asked.host;
    const long long port = node->element[1]->integer;
    if (port <= 0 || port > 65535) {
      error = fmt::format("CLUSTER SLOTS entry {} has port {}", i, port);
      return std::nullopt;
    }
    range.master = RedisAddress{host, int(port)};
    out.push_back(std::move(range));
  }
  return out;
}

}  // namespace kvserve
