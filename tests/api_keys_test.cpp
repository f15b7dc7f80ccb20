// API key files map keys to tenants; unknown keys are refused, a missing key
// is the default tenant unless keys are required, and bad files say where.
#include "server/api_keys.h"

#include <gtest/gtest.h>

#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

TEST(ApiKeys, MapsKeysToTenants) {
  const ApiKeys keys = ApiKeys::parse("# team keys\n\nsk-alpha  team-a\n  sk-beta\tteam.b:2 \n", "keys.txt");
  EXPECT_EQ(keys.size(), 2u);
  AuthResult r = keys.authenticate("Bearer sk-alpha", false);
  EXPECT_EQ(r.status, AuthResult::Status::Ok);
  EXPECT_EQ(r.tenant, "team-a");
  r = keys.authenticate("Bearer sk-beta", true);
  EXPECT_EQ(r.status, AuthResult::Status::Ok);
  EXPECT_EQ(r.tenant, "team.b:2");
  EXPECT_EQ(keys.authenticate("Bearer sk-gamma", false).status, AuthResult::Status::Invalid);
  EXPECT_EQ(keys.authenticate("Bearer sk-alph", false).status, AuthResult::Status::Invalid);
  EXPECT_EQ(keys.authenticate("Basic c2stYWxwaGE=", false).status, AuthResult::Status::Invalid);
  EXPECT_EQ(keys.authenticate("Bearer ", false).status, AuthResult::Status::Invalid);
  r = keys.authenticate("", false);
  EXPECT_EQ(r.status, AuthResult::Status::Ok);
  EXPECT_EQ(r.tenant, kDefaultTenant);
  EXPECT_EQ(keys.authenticate("", true).status, AuthResult::Status::Missing);
  EXPECT_TRUE(keys.has_tenant("team.b:2"));
  EXPECT_FALSE(keys.has_tenant("team"));
  EXPECT_FALSE(keys.has_tenant(kDefaultTenant));
}

TEST(ApiKeys, WithoutKeysEveryoneIsTheDefaultTenant) {
  const ApiKeys none;
  for (const char* header : {"", "Bearer sk-anything", "Basic xyz"}) {
    const AuthResult r = none.authenticate(header, false);
    EXPECT_EQ(r.status, AuthResult::Status::Ok);
    EXPECT_EQ(r.tenant, kDefaultTenant);
  }
}

TEST(ApiKeys, BadFilesNameTheLine) {
  expect_error_containing([] { (void)ApiKeys::parse("sk-a team\nsk-b\n", "k"); }, "k:2: expected `KEY TENANT`");
  expect_error_containing([] { (void)ApiKeys::parse("sk-a team extra\n", "k"); }, "k:1: expected `KEY TENANT`, found more");
  expect_error_containing([] { (void)ApiKeys::parse("sk-a te/am\n", "k"); }, "k:1: tenant 'te/am'");
  expect_error_containing([] { (void)ApiKeys::parse("sk-a global\n", "k"); }, "reserved for the shared cache scope");
  expect_error_containing([] { (void)ApiKeys::parse("sk-a t1\nsk-a t2\n", "k"); }, "k:2: this key appears twice");
  expect_error_containing([] { (void)ApiKeys::parse("# nothing\n", "k"); }, "k holds no API keys");
  expect_error_containing([] { (void)ApiKeys::load("/nonexistent/keys"); }, "cannot open the API key file");
}

}  // namespace
}  // namespace kvserve
