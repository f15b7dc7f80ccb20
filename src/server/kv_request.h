// What a server accepts in the kvserve extension field "kv": {...} of a
// completion request (parsed into KvRequest by openai_protocol).
//
// Today a server has one KV cache configuration, fixed at start-up: a request
// may name the storage types it expects ("k": "int4") and is refused with 400
// when they differ from the server's, so a client never silently gets a
// different quantization than it asked for. Sparsity fields ("policy",
// "budget") pick one of the engine's policies for the request (the engine
// checks the budget against its cache).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "server/openai_protocol.h"

namespace kvserve {

// What per-request KV options this server accepts.
struct KvRequestLimits {
  // The keys' and the values' storage type, each judged on its own: empty
  // when the layers store them in different types (mixed per layer).
  std::optional<KvDType> k = KvDType::F32;
  std::optional<KvDType> v = KvDType::F32;
  std::string description;         // the cache's codecs, e.g. "K int4/channel/g16 V int4/token/g64"
  std::vector<std::string> policies;  // sparsity policies offered
  // Policies this server's cache cannot serve, with why (sinks needs keys
  // stored before RoPE in every layer).
  std::vector<std::pair<std::string, std::string>> unavailable;
};

[[nodiscard]] KvRequestLimits kv_request_limits(const KvCache& cache);
// A short text naming the cache's codecs ("fp16", or K and V apart, or per layer).
[[nodiscard]] std::string kv_codec_description(const KvCache& cache);

// The 400 to send when `kv` asks for something the server does not offer.
[[nodiscard]] std::optional<ApiError> check_kv_request(const KvRequest& kv, const KvRequestLimits& limits);

}  // namespace kvserve
