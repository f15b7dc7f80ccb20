#include "store/tier_spec.h"

#include <cctype>
#include <charconv>
#include <fstream>

#include "util/byte_size.h"
#include "util/error.h"

namespace kvserve {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

int64_t parse_count(std::string_view value, std::string_view name, std::string_view tier, int64_t min) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size() || v < min)
    fail("--kv-tiers: {}={} in '{}' must be an integer >= {}", name, value, tier, min);
  return v;
}

int64_t parse_tier_size(std::string_view size, std::string_view tier) {
  int64_t bytes;
  try {
    bytes = parse_byte_size(size);
  } catch (const Error& e) {
    fail("--kv-tiers: bad size in '{}': {}", tier, e.what());
  }
  if (bytes <= 0) fail("--kv-tiers: the size in '{}' must be positive", tier);
  return bytes;
}

RedisAddress parse_address(std::string_view text, std::string_view tier) {
  auto a = parse_redis_address(text);
  if (!a) fail("--kv-tiers: '{}' in '{}' is not HOST:PORT", text, tier);
  return *a;
}

RedisTierSpec parse_redis(std::string_view tier) {
  RedisTierSpec spec;
  RedisStoreOptions& o = spec.options;
  std::string_view rest = tier.substr(std::string_view("redis://").size());
  std::string_view query;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  std::string user;
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view userinfo = rest.substr(0, at);
    if (userinfo.find(':') != std::string_view::npos)
      fail("--kv-tiers: '{}' has a password in the URL (visible to ps and shell history); "
           "put it in a file and pass auth_file=PATH", tier);
    if (userinfo.empty()) fail("--kv-tiers: empty user name in '{}'", tier);
    user = std::string(userinfo);
    rest = rest.substr(at + 1);
  }
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  o.seeds.push_back(parse_address(rest, tier));
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) fail("--kv-tiers: option '{}' in '{}' is not NAME=VALUE", item, tier);
    const std::string_view name = item.substr(0, eq), value = item.substr(eq + 1);
    if (name == "auth_file") {
      if (value.empty()) fail("--kv-tiers: empty auth_file in '{}'", tier);
      spec.auth_file = std::string(value);
    } else if (name == "ttl") {
      o.ttl_seconds = parse_count(value, name, tier, 0);
    } else if (name == "cluster") {
      if (value == "auto") o.cluster = RedisClusterMode::Auto;
      else if (value == "1" || value == "yes" || value == "true") o.cluster = RedisClusterMode::Cluster;
      else if (value == "0" || value == "no" || value == "false") o.cluster = RedisClusterMode::Standalone;
      else fail("--kv-tiers: cluster={} in '{}' must be auto, 0 or 1", value, tier);
    } else if (name == "seed") {
      o.seeds.push_back(parse_address(value, tier));
    } else if (name == "pool") {
      o.pool_size = int(parse_count(value, name, tier, 1));
    } else if (name == "timeout_ms") {
      o.command_timeout = std::chrono::milliseconds(parse_count(value, name, tier, 1));
    } else if (name == "connect_timeout_ms") {
      o.connect_timeout = std::chrono::milliseconds(parse_count(value, name, tier, 1));
    } else if (name == "prefix") {
      o.key_prefix = std::string(value);
    } else {
      fail("--kv-tiers: unknown Redis option '{}' in '{}' (auth_file, ttl, cluster, seed, pool, timeout_ms, "
           "connect_timeout_ms, prefix)", name, tier);
    }
  }
  if (!user.empty() && spec.auth_file.empty())
    fail("--kv-tiers: '{}' names user {} but no auth_file=PATH with the password", tier, user);
  o.credentials.user = user;
  return spec;
}

TierSpec parse_tier(std::string_view tier) {
  if (tier.starts_with("redis://")) return parse_redis(tier);
  if (tier.starts_with("host:")) {
    HostStoreOptions o;
    o.budget_bytes = parse_tier_size(tier.substr(5), tier);
    return o;
  }
  if (tier.starts_with("disk:")) {
    const std::string_view body = tier.substr(5);
    const size_t colon = body.rfind(':');
    if (colon == std::string_view::npos || colon == 0)
      fail("--kv-tiers: '{}' must be disk:PATH:SIZE, e.g. disk:/var/cache/kvserve:20GiB", tier);
    DiskStoreOptions o;
    o.dir = std::string(body.substr(0, colon));
    o.budget_bytes = parse_tier_size(body.substr(colon + 1), tier);
    return o;
  }
  fail("--kv-tiers: unknown tier '{}' (expected host:SIZE, disk:PATH:SIZE or redis://HOST:PORT)", tier);
}

std::vector<std::string> split_tiers(std::string_view text) {
  std::vector<std::string> out;
  if (text.starts_with('@')) {
    const std::string path(text.substr(1));
    std::ifstream in(path);
    if (!in) fail("--kv-tiers: cannot read {}", path);
    std::string line;
    while (std::getline(in, line)) {
      std::string_view l = line;
      if (const size_t hash = l.find('#'); hash != std::string_view::npos) l = l.substr(0, hash);
      l = trim(l);
      if (!l.empty()) out.emplace_back(l);
    }
    if (out.empty()) fail("--kv-tiers: {} names no tier", path);
    return out;
  }
  while (true) {
    const size_t comma = text.find(',');
    const std::string_view part = trim(text.substr(0, comma));
    if (part.empty()) fail("--kv-tiers: empty tier in '{}'", text);
    out.emplace_back(part);
    if (comma == std::string_view::npos) break;
    text = text.substr(comma + 1);
  }
  return out;
}

}  // namespace

std::vector<TierSpec> parse_kv_tiers(std::string_view text) {
  std::vector<TierSpec> out;
  int hosts = 0;
  std::vector<std::string> dirs;
  for (const std::string& tier : split_tiers(trim(text))) {
    TierSpec spec = parse_tier(tier);
    if (std::holds_alternative<HostStoreOptions>(spec) && ++hosts > 1)
      fail("--kv-tiers: more than one host tier in '{}'", text);
    if (auto* d = std::get_if<DiskStoreOptions>(&spec)) {
      for (const std::string& dir : dirs)
        if (dir == d->dir) fail("--kv-tiers: disk directory {} is given twice", dir);
      dirs.push_back(d->dir);
    }
    out.push_back(std::move(spec));
  }
  return out;
}

std::unique_ptr<KvStore> open_tier(const TierSpec& spec) {
  if (const auto* h = std::get_if<HostStoreOptions>(&spec)) return std::make_unique<HostStore>(*h);
  if (const auto* d = std::get_if<DiskStoreOptions>(&spec)) return std::make_unique<DiskStore>(*d);
  const auto& r = std::get<RedisTierSpec>(spec);
  RedisStoreOptions o = r.options;
  if (!r.auth_file.empty()) {
    const RedisCredentials file = load_redis_credentials(r.auth_file);
    if (!o.credentials.user.empty() && !file.user.empty() && file.user != o.credentials.user)
      fail("the Redis URL names user {} but {} names user {}", o.credentials.user, r.auth_file, file.user);
    if (o.credentials.user.empty()) o.credentials.user = file.user;
    o.credentials.password = file.password;
  }
  return std::make_unique<RedisStore>(o);
}

namespace {

// payload_bytes 0 = unknown: nothing to check.
void check_tier_fits_a_record(const TierSpec& spec, uint64_t payload_bytes) {
  if (payload_bytes == 0) return;
  std::string name;
  int64_t budget = 0;
  if (const auto* h = std::get_if<HostStoreOptions>(&spec)) {
    name = "host";
    budget = h->budget_bytes;
  } else if (const auto* d = std::get_if<DiskStoreOptions>(&spec)) {
    name = "disk:" + d->dir;
    budget = d->budget_bytes;
  } else {
    return;  // Redis's budget is the server's maxmemory
  }
  const uint64_t record = kRecordHeaderBytes + payload_bytes;
  if (uint64_t(budget) < record)
    fail("--kv-tiers: the {} tier's budget of {} bytes cannot hold one block record of {} bytes (it would refuse "
         "every block); give it at least {} bytes",
         name, budget, record, record);
}

}  // namespace

std::unique_ptr<TieredKvStore> open_tiered_kv_store(std::string_view text, const TieredKvStoreOptions& options) {
  const std::vector<TierSpec> specs = parse_kv_tiers(text);
  // Before any tier opens: a disk tier opened with a tiny budget would first
  // evict every block its directory holds.
  for (const TierSpec& spec : specs) check_tier_fits_a_record(spec, options.payload_bytes);
  std::vector<std::unique_ptr<KvStore>> tiers;
  for (const TierSpec& spec : specs) tiers.push_back(open_tier(spec));
  return std::make_unique<TieredKvStore>(std::move(tiers), options);
}

}  // namespace kvserve
