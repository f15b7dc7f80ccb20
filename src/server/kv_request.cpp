#include "server/kv_request.h"

#include <fmt/format.h>

#include "attention/sparsity_policy.h"
#include "kv/kv_codec.h"
#include "util/error.h"

namespace kvserve {
namespace {

// The 400 for one of "k"/"v"; nullopt when `asked` is empty or the server's type.
std::optional<ApiError> check_type(const std::string& asked, const char* which, std::optional<KvDType> server,
                                   const KvRequestLimits& limits) {
  if (asked.empty()) return std::nullopt;
  const std::string param = fmt::format("kv.{}", which);
  KvDType t;
  try {
    t = parse_kv_dtype(asked);
  } catch (const Error& e) {
    return invalid_request(e.what(), param, "invalid_value");
  }
  if (server == t) return std::nullopt;
  const char* plane = which == std::string("k") ? "keys" : "values";
  if (!server)
    return invalid_request(fmt::format("this server's KV cache is {} ({}: mixed per layer); requests cannot choose "
                                       "a KV type: omit '{}'",
                                       limits.description, plane, param),
                           param, "unsupported_kv_config");
  return invalid_request(
      fmt::format("this server's KV cache is {} ({}: {}); requests cannot choose another KV type: send '{}' or "
                  "omit '{}'",
                  limits.description, plane, kv_dtype_name(*server), kv_dtype_name(*server), param),
      param, "unsupported_kv_config");
}

}  // namespace

std::string kv_codec_description(const KvCache& cache) {
  auto layer = [&](int l) {
    const std::string k = cache.k_codec(l).config().describe(), v = cache.v_codec(l).config().describe();
    return k == v ? k : "K " + k + " V " + v;
  };
  std::string out = layer(0);
  bool uniform = true;
  for (int l = 1; l < cache.n_layers(); ++l) uniform = uniform && layer(l) == out;
  if (uniform) return out;
  out.clear();
  for (int l = 0; l < cache.n_layers(); ++l) out += (l ? ", " : "") + std::to_string(l) + ":" + layer(l);
  return out;
}

KvRequestLimits kv_request_limits(const KvCache& cache) {
  KvRequestLimits l;
  l.k = cache.k_codec(0).config().dtype;
  l.v = cache.v_codec(0).config().dtype;
  for (int i = 1; i < cache.n_layers(); ++i) {
    if (cache.k_codec(i).config().dtype != l.k) l.k.reset();
    if (cache.v_codec(i).config().dtype != l.v) l.v.reset();
  }
  l.description = kv_codec_description(cache);
  bool pre_rope = true;
  for (int i = 0; i < cache.n_layers(); ++i) pre_rope = pre_rope && cache.k_pre_rope(i);
  for (const std::string& p : sparsity_policy_names()) {
    if (p == "sinks" && !pre_rope) {
      l.unavailable.emplace_back(p, "positions within the cache, which need keys stored before RoPE; this server "
                                    "stores them after (start it with --kv-k-pre-rope to offer sinks)");
      continue;
    }
    l.policies.push_back(p);
  }
  return l;
}

std::optional<ApiError> check_kv_request(const KvRequest& kv, const KvRequestLimits& limits) {
  if (auto e = check_type(kv.k, "k", limits.k, limits)) return e;
  if (auto e = check_type(kv.v, "v", limits.v, limits)) return e;
  if (kv.sparsity_requested()) {
    const std::string param = kv.policy.empty() ? "kv.budget" : "kv.policy";
    if (limits.policies.empty())
      return invalid_request("this server offers no KV sparsity policies yet ('kv.policy', 'kv.budget'); omit them",
                             param, "unsupported_kv_config");
    if (kv.policy.empty()) return invalid_request("'kv.budget' needs a 'kv.policy'", "kv.budget", "invalid_value");
    bool known = false;
    std::string names;
    for (const std::string& p : limits.policies) {
      known = known || p == kv.policy;
      names += (names.empty() ? "" : ", ") + p;
    }
    for (const auto& [name, why] : limits.unavailable)
      if (!known && name == kv.policy)
        return invalid_request(fmt::format("KV policy '{}' needs {} (this server offers: {})", name, why, names),
                               "kv.policy", "unsupported_kv_config");
    if (!known)
      return invalid_request(fmt::format("unknown KV policy '{}' (this server offers: {})", kv.policy, names),
                             "kv.policy", "unsupported_kv_config");
  }
  return std::nullopt;
}

}  // namespace kvserve
