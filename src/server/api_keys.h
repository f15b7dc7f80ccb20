// API keys and the tenants they stand for.
//
// File format (--api-keys FILE): one key per line, `KEY TENANT`, separated by
// whitespace; blank lines and lines starting with '#' are ignored. Keys are
// any run of non-space characters; tenant names use [A-Za-z0-9_.:-] (they
// become metric labels and prefix-cache salts). A key may appear once.
//
// Clients send `Authorization: Bearer KEY`. Without a key file every request
// is the default tenant (a key, if sent, is ignored, since OpenAI clients always
// send one). With a file, an unknown key is refused; a missing key is the
// default tenant unless keys are required.
//
// Keys are kept only as SHA-256 digests, so lookups do not compare secrets
// byte by byte and a memory dump does not reveal them.
//
// Thread safety: const methods may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace kvserve {

inline constexpr std::string_view kDefaultTenant = "default";

struct AuthResult {
  enum class Status : uint8_t { Ok, Missing, Invalid };
  Status status = Status::Ok;
  std::string tenant;   // with Ok
};

class ApiKeys {
 public:
  ApiKeys() = default;  // no keys: every request is the default tenant

  // Throws kvserve::Error naming the file and line of a malformed entry.
  static ApiKeys load(const std::string& path);
  static ApiKeys parse(std::string_view text, const std::string& source);

  // authorization: the Authorization header ("" when absent). require_key:
  // a missing key is refused (meaningful only with keys loaded).
  [[nodiscard]] AuthResult authenticate(std::string_view authorization, bool require_key) const;

  size_t size() const { return tenants_.size(); }
  // Whether some key maps to `tenant`.
  bool has_tenant(std::string_view tenant) const;

 private:
  using Digest = std::array<uint8_t, 32>;
  static Digest digest(std::string_view key);

  std::map<Digest, std::string> tenants_;  // SHA-256(key) -> tenant
};

}  // namespace kvserve
