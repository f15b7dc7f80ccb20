#include "server/api_keys.h"

#include <openssl/sha.h>

#include <fstream>
#include <sstream>

#include "util/error.h"

namespace kvserve {
namespace {

bool valid_tenant(std::string_view t) {
  if (t.empty() || t.size() > 64) return false;
  for (char c : t) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

ApiKeys::Digest ApiKeys::digest(std::string_view key) {
  Digest d;
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), d.data());
  return d;
}

ApiKeys ApiKeys::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open the API key file {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

ApiKeys ApiKeys::parse(std::string_view text, const std::string& source) {
  ApiKeys keys;
  std::istringstream lines{std::string(text)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    std::istringstream words(line);
    std::string key, tenant, extra;
    if (!(words >> key) || key[0] == '#') continue;
    if (!(words >> tenant)) fail("{}:{}: expected `KEY TENANT`, found only a key", source, number);
    if (words >> extra) fail("{}:{}: expected `KEY TENANT`, found more words ('{}')", source, number, extra);
    if (!valid_tenant(tenant))
      fail("{}:{}: tenant '{}' must be 1-64 characters of [A-Za-z0-9_.:-]", source, number, tenant);
    if (tenant == "global")  // the shared scope's account in metrics and events
      fail("{}:{}: the tenant name 'global' is reserved for the shared cache scope", source, number);
    if (!keys.tenants_.emplace(digest(key), tenant).second) fail("{}:{}: this key appears twice", source, number);
  }
  if (keys.tenants_.empty()) fail("{} holds no API keys", source);
  return keys;
}

AuthResult ApiKeys::authenticate(std::string_view authorization, bool require_key) const {
  // Without keys there is nothing to check: OpenAI clients send some key anyway.
  if (tenants_.empty()) return {AuthResult::Status::Ok, std::string(kDefaultTenant)};
  if (authorization.empty()) {
    if (require_key) return {AuthResult::Status::Missing, {}};
    return {AuthResult::Status::Ok, std::string(kDefaultTenant)};
  }
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() <= kBearer.size() || authorization.substr(0, kBearer.size()) != kBearer)
    return {AuthResult::Status::Invalid, {}};
  const auto it = tenants_.find(digest(authorization.substr(kBearer.size())));
  if (it == tenants_.end()) return {AuthResult::Status::Invalid, {}};
  return {AuthResult::Status::Ok, it->second};
}

bool ApiKeys::has_tenant(std::string_view tenant) const {
  for (const auto& [digest, name] : tenants_)
    if (name == tenant) return true;
  return false;
}

}  // namespace kvserve
