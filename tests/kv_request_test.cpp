// Per-request KV options are checked against the server's one cache: its own
// types pass, other types and unknown names get a 400 naming the server's
// configuration, and sparsity fields name one of the policies offered.
#include "server/kv_request.h"

#include <gtest/gtest.h>

#include "attention/sparsity_policy.h"
#include "kv/kv_spec.h"
#include "model/model.h"
#include "test_support.h"

namespace kvserve {
namespace {

class KvRequestTest : public ::testing::Test {
 protected:
  void SetUp() override { model = Model::load(testing_files::kStoriesGguf); }
  std::unique_ptr<Model> model;
};

TEST_F(KvRequestTest, TheServersOwnTypesPassOthersAreRefused) {
  KvCacheOptions o;
  apply_kv_preset(o, "int4");
  o.num_blocks = 8;
  const KvCache cache(model->config(), o);
  const KvRequestLimits limits = kv_request_limits(cache);
  EXPECT_EQ(limits.k, KvDType::INT4);
  EXPECT_EQ(limits.v, KvDType::INT4);
  EXPECT_EQ(limits.description, kv_codec_description(cache));
  // Keys stored after RoPE: every policy but sinks, which says what it needs.
  std::vector<std::string> offered = sparsity_policy_names();
  std::erase(offered, "sinks");
  EXPECT_EQ(limits.policies, offered);
  auto sinks = check_kv_request({"", "", "sinks", 64}, limits);
  ASSERT_TRUE(sinks);
  EXPECT_EQ(sinks->param, "kv.policy");
  EXPECT_EQ(sinks->code, "unsupported_kv_config");
  EXPECT_NE(sinks->message.find("start it with --kv-k-pre-rope"), std::string::npos) << sinks->message;
  o.k.pre_rope = true;
  EXPECT_EQ(kv_request_limits(KvCache(model->config(), o)).policies, sparsity_policy_names());

  EXPECT_FALSE(check_kv_request({}, limits));
  EXPECT_FALSE(check_kv_request({"int4", "int4", "", 0}, limits));
  auto e = check_kv_request({"fp16", "", "", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 400);
  EXPECT_EQ(e->param, "kv.k");
  EXPECT_EQ(e->code, "unsupported_kv_config");
  EXPECT_NE(e->message.find("this server's KV cache is " + limits.description), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("send 'int4'"), std::string::npos) << e->message;
  e = check_kv_request({"", "int7", "", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "kv.v");
  EXPECT_EQ(e->code, "invalid_value");
}

TEST_F(KvRequestTest, MixedPrecisionServersAcceptNoType) {
  KvCacheOptions o;
  o.num_blocks = 8;
  apply_kv_layers(o, parse_kv_layers("0:fp16", model->config().n_layers), model->config().n_layers);
  const KvRequestLimits limits = kv_request_limits(KvCache(model->config(), o));
  EXPECT_FALSE(limits.k);
  EXPECT_FALSE(limits.v);
  const auto e = check_kv_request({"fp32", "", "", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("(keys: mixed per layer)"), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("omit 'kv.k'"), std::string::npos) << e->message;
  EXPECT_EQ(e->message.find("send '"), std::string::npos) << e->message;
}

// Keys and values are judged apart: int4 keys in every layer accept kv.k
// "int4" although the values are mixed, and only kv.v is refused.
TEST_F(KvRequestTest, KeysAndValuesAreJudgedApart) {
  KvCacheOptions o;
  o.num_blocks = 8;
  o.set_dtype(KvDType::INT4);
  apply_kv_layers(o, parse_kv_layers("0:int4/fp16", model->config().n_layers), model->config().n_layers);
  const KvRequestLimits limits = kv_request_limits(KvCache(model->config(), o));
  EXPECT_EQ(limits.k, KvDType::INT4);
  EXPECT_FALSE(limits.v);
  EXPECT_FALSE(check_kv_request({"int4", "", "", 0}, limits));
  auto e = check_kv_request({"fp16", "", "", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("(keys: int4)"), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("send 'int4'"), std::string::npos) << e->message;
  e = check_kv_request({"int4", "fp16", "", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "kv.v");
  EXPECT_NE(e->message.find("(values: mixed per layer)"), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("omit 'kv.v'"), std::string::npos) << e->message;
}

TEST_F(KvRequestTest, SparsityNeedsAPolicyTheServerOffers) {
  KvRequestLimits limits;
  auto e = check_kv_request({"", "", "sinks", 256}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "kv.policy");
  EXPECT_EQ(e->code, "unsupported_kv_config");
  e = check_kv_request({"", "", "", 64}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "kv.budget");
  // Once the engine lists policies, known names pass and unknown ones are named.
  limits.policies = {"window", "sinks"};
  EXPECT_FALSE(check_kv_request({"", "", "sinks", 256}, limits));
  e = check_kv_request({"", "", "h2o", 0}, limits);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("this server offers: window, sinks"), std::string::npos);
  e = check_kv_request({"", "", "", 64}, limits);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'kv.budget' needs a 'kv.policy'");
  EXPECT_EQ(e->param, "kv.budget");
  EXPECT_EQ(e->code, "invalid_value");
}

}  // namespace
}  // namespace kvserve
