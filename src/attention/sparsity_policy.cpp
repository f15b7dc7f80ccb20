#include "attention/sparsity_policy.h"

#include <fmt/format.h>

#include <algorithm>

#include "attention/ann_policy.h"
#include "attention/h2o_policy.h"
#include "attention/snapkv_policy.h"
#include "attention/topk_policy.h"
#include "attention/window_policy.h"
#include "util/error.h"

namespace kvserve {
namespace {

// full: every token, read in full; the policy only counts passes.
class FullPolicy final : public SparsityPolicy {
 public:
  std::string_view name() const override { return "full"; }
};

}  // namespace

SparsityOptions resolve_sparsity_options(SparsityOptions o, const KvCache& cache) {
  const std::string& p = o.policy;
  const std::vector<std::string> names = sparsity_policy_names();
  if (std::find(names.begin(), names.end(), p) == names.end())
    fail("unknown --kv-policy '{}' (expected {})", p, fmt::join(names, ", "));
  // A knob the policy does not read is an error, not silently ignored.
  const bool evicting_or_ann = p != "full" && p != "topk";
  if (p == "full" && o.budget != 0) fail("--kv-budget applies to a sparsity policy (--kv-policy full keeps every token)");
  if (!evicting_or_ann && (o.sinks >= 0 || o.window >= 0))
    fail("--kv-sinks and --kv-window do not apply to --kv-policy {}", p);
  if (p != "snapkv" && (o.observe >= 0 || o.pool >= 0)) fail("--kv-observe and --kv-pool apply to --kv-policy snapkv only");
  if (p != "ann" && (o.ann_backend != KeyIndexBackend::Hnsw || o.ann_transform != MipsTransform::L2Augment))
    fail("--kv-ann and --kv-ann-transform apply to --kv-policy ann only");
  if (p == "full" && o.positions == SparsityPositions::Cache) fail("--kv-positions cache applies to evicting policies only");
  if (o.compact_slack >= 0 && (p == "full" || p == "topk" || p == "ann"))
    fail("--kv-compact-slack applies to evicting policies only (window, sinks, h2o, snapkv)");
  // The FP16 window is counted in slots: compacting more often than a block
  // at a time packs the newest tokens into blocks already encoded (a probe
  // measured window-64 q4_0 PPL 11.3 at slack 0 against 6.1 at one block).
  if (o.compact_slack >= 0 && o.compact_slack < cache.block_size() && cache.staged())
    fail("--kv-compact-slack {} is below one block ({} tokens): with an FP16 residual window, compacting that often "
         "encodes the newest tokens at once; use at least {}", o.compact_slack, cache.block_size(), cache.block_size());
  if (o.horizon > 0 && p != "h2o" && p != "snapkv") fail("--kv-horizon applies to h2o and snapkv");
  if (o.scope != SparsityScope::Head && p != "h2o" && p != "snapkv") fail("--kv-scope applies to h2o and snapkv");
  if (o.score != H2oScore::Sum && p != "h2o") fail("--kv-score applies to h2o");
  if (o.value_weighted && p != "h2o" && p != "snapkv") fail("--kv-value-norm applies to h2o and snapkv");
  if (p == "full") return o;
  if (o.budget <= 0) fail("--kv-policy {} needs --kv-budget TOKENS (got {})", p, o.budget);
  if (p == "snapkv" && o.pool < 0) o.pool = 7;
  if (p == "snapkv" && (o.pool < 1 || o.pool % 2 == 0)) fail("--kv-pool must be odd and positive (got {})", o.pool);
  if (o.compact_slack < -1) fail("--kv-compact-slack must be >= 0 (got {})", o.compact_slack);
  if (o.horizon < 0) fail("--kv-horizon must be >= 0 (got {})", o.horizon);
  if (o.sinks < -1 || o.window < -1 || o.observe < -1 || o.observe == 0)
    fail("--kv-sinks and --kv-window must be >= 0 and --kv-observe >= 1 when given");
  // Defaults are filled in only for the knobs the policy reads, so resolved
  // options resolve again unchanged.
  if (o.sinks < 0 && p != "topk") o.sinks = p == "sinks" ? 4 : 0;
  // window, sinks and snapkv keep their newest tokens in what the sinks leave.
  if ((p == "window" || p == "sinks" || p == "snapkv") && o.sinks >= o.budget)
    fail("--kv-sinks {} leaves no window in --kv-budget {}", o.sinks, o.budget);
  if ((p == "window" || p == "sinks") && o.window >= 0 && o.window != o.budget - o.sinks)
    fail("--kv-policy {} keeps the last --kv-budget {} - --kv-sinks {} = {} tokens; --kv-window {} says otherwise "
         "(leave it out)", p, o.budget, o.sinks, o.budget - o.sinks, o.window);
  if (p == "snapkv" && o.observe < 0) o.observe = std::min(32, std::max(1, o.budget / 2));
  if (o.window < 0) {
    if (p == "window" || p == "sinks") o.window = o.budget - o.sinks;
    else if (p == "h2o" || p == "ann") o.window = o.budget / 2;
    else if (p == "snapkv") o.window = std::min(o.observe, o.budget - o.sinks);
  }
  if (p != "topk" && o.sinks + o.window > o.budget)
    fail("--kv-sinks {} + --kv-window {} exceed --kv-budget {}", o.sinks, o.window, o.budget);
  if (o.positions == SparsityPositions::Default)
    o.positions = p == "sinks" ? SparsityPositions::Cache : SparsityPositions::Original;
  if (o.positions == SparsityPositions::Cache) {
    if (p == "topk" || p == "ann") fail("--kv-positions cache applies to evicting policies only");
    for (int l = 0; l < cache.n_layers(); ++l)
      if (!cache.k_pre_rope(l))
        fail("--kv-policy {} with positions within the cache needs keys stored before RoPE in every layer "
             "(--kv-k-pre-rope; layer {} stores them after)", p, l);
  }
  return o;
}

SparsityLimits sparsity_limits(const SparsityOptions& options, const KvCache& cache, int32_t chunk) {
  const SparsityOptions o = resolve_sparsity_options(options, cache);
  SparsityLimits limits;
  if (o.policy == "full" || o.policy == "topk" || o.policy == "ann") return limits;  // every token stays
  // An evicting policy holds its budget, the chunk it has just appended and
  // the dead slots it tolerates before compacting.
  limits.max_tokens_held = int64_t(o.budget) + chunk + compaction_slack(o, cache.block_size());
  limits.unbounded_positions = o.positions == SparsityPositions::Cache;
  return limits;
}

int32_t compaction_slack(const SparsityOptions& resolved, int32_t block_size) {
  return resolved.compact_slack >= 0 ? std::max(1, resolved.compact_slack) : block_size;
}

std::vector<std::string> sparsity_policy_names() { return {"full", "window", "sinks", "h2o", "snapkv", "topk", "ann"}; }

SparsityScope parse_sparsity_scope(std::string_view name) {
  if (name == "head") return SparsityScope::Head;
  if (name == "aggregate") return SparsityScope::Aggregate;
  fail("unknown --kv-scope '{}' (expected head or aggregate)", name);
}

H2oScore parse_h2o_score(std::string_view name) {
  if (name == "sum") return H2oScore::Sum;
  if (name == "mean") return H2oScore::Mean;
  fail("unknown --kv-score '{}' (expected sum or mean)", name);
}

SparsityPositions parse_sparsity_positions(std::string_view name) {
  if (name == "original") return SparsityPositions::Original;
  if (name == "cache") return SparsityPositions::Cache;
  fail("unknown --kv-positions '{}' (expected original or cache)", name);
}

std::unique_ptr<SparsityPolicy> make_sparsity_policy(const SparsityOptions& options, const KvCache& cache) {
  const SparsityOptions o = resolve_sparsity_options(options, cache);
  if (o.policy == "full") return std::make_unique<FullPolicy>();
  if (o.policy == "window" || o.policy == "sinks") return std::make_unique<WindowPolicy>(o, cache);
  if (o.policy == "h2o") return std::make_unique<H2oPolicy>(o, cache);
  if (o.policy == "snapkv") return std::make_unique<SnapKvPolicy>(o, cache);
  if (o.policy == "topk") return std::make_unique<TopKPolicy>(o, cache);
  return std::make_unique<AnnPolicy>(o, cache);
}

std::string describe(const SparsityOptions& options) {
  const SparsityOptions& o = options;
  if (o.policy == "full") return "full";
  std::string s = fmt::format("{} budget {}", o.policy, o.budget);
  if (o.policy == "topk") return s;
  if (o.policy == "ann")
    return s + fmt::format(" (sinks {}, window {}, {}/{})", o.sinks, o.window, key_index_backend_name(o.ann_backend),
                           mips_transform_name(o.ann_transform));
  s += fmt::format(" (sinks {}, window {}", o.sinks, o.window);
  if (o.policy == "h2o" || o.policy == "snapkv")
    s += o.scope == SparsityScope::Head ? ", per head" : ", aggregate";
  if (o.policy == "h2o") s += o.score == H2oScore::Sum ? ", sum" : ", mean";
  if (o.value_weighted) s += " x value norm";
  if (o.policy == "snapkv") s += fmt::format(", observe {}, pool {}", o.observe, o.pool);
  if (o.horizon > 0) s += fmt::format(", horizon {}", o.horizon);
  s += o.positions == SparsityPositions::Cache ? ", cache positions)" : ")";
  return s;
}

}  // namespace kvserve
