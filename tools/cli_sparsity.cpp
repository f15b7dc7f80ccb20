// The KV sparsity flags shared by generate, perplexity and bench (issue 4).
#include <limits>

#include "tools/cli_common.h"
#include "util/error.h"

namespace kvserve::cli {

void add_sparsity_options(CLI::App& cmd, SparsityFlags& f) {
  SparsityOptions& o = f.options;
  cmd.add_option("--kv-policy", o.policy, "KV sparsity: full | window | sinks | h2o | snapkv | topk | ann")
      ->capture_default_str();
  cmd.add_option("--kv-budget", o.budget, "tokens kept (window, sinks, h2o, snapkv) or read (topk, ann) per layer and KV head");
  // Unset is -1 inside SparsityOptions: the flags take no negative value.
  cmd.add_option("--kv-sinks", o.sinks, "first tokens always kept (default: 4 for sinks, else 0)")
      ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
  cmd.add_option("--kv-window", o.window, "most recent tokens always kept (default: h2o budget/2, snapkv the observation window)")
      ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
  cmd.add_option("--kv-observe", o.observe, "snapkv: queries whose attention scores the tokens (default min(32, budget/2))")
      ->check(CLI::Range(1, std::numeric_limits<int32_t>::max()));
  cmd.add_option("--kv-pool", o.pool, "snapkv: max-pool width over neighbouring tokens (odd; 1 = none; default 7)");
  cmd.add_option("--kv-horizon", o.horizon, "h2o/snapkv: evict tokens further back than this first (0 = no horizon)");
  cmd.add_option("--kv-scope", f.scope, "h2o/snapkv: head (a keep set per layer and KV head, default) | aggregate");
  cmd.add_option("--kv-score", f.score, "h2o: sum (attention received, default) | mean (per query since arrival)");
  cmd.add_flag("--kv-value-norm", o.value_weighted, "h2o/snapkv: weight attention scores by the value's L1 norm (VATP)");
  cmd.add_option("--kv-positions", f.positions, "RoPE positions after eviction: original | cache (default: cache for sinks)");
  cmd.add_option("--kv-ann", f.ann, "ann: key index back-end, hnsw (default) | ivfpq");
  cmd.add_option("--kv-ann-transform", f.ann_transform, "ann: l2aug (MIPS as L2 over augmented keys, default) | ip");
  cmd.add_option("--kv-compact-slack", o.compact_slack,
                 "evicted slots left in place before compacting (default one block; 0 or 1: compact at every eviction)")
      ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
}

SparsityOptions sparsity_options(const SparsityFlags& f) {
  SparsityOptions o = f.options;
  // Flags the policy does not read are errors (the numeric ones are checked
  // with the policy itself, resolve_sparsity_options).
  const std::string& p = o.policy;
  if (!f.scope.empty() && p != "h2o" && p != "snapkv") fail("--kv-scope applies to --kv-policy h2o and snapkv only");
  if (!f.score.empty() && p != "h2o") fail("--kv-score applies to --kv-policy h2o only");
  if ((!f.ann.empty() || !f.ann_transform.empty()) && p != "ann")
    fail("--kv-ann and --kv-ann-transform apply to --kv-policy ann only");
  if (!f.positions.empty() && (p == "full" || p == "topk" || p == "ann"))
    fail("--kv-positions applies to evicting policies only (window, sinks, h2o, snapkv)");
  if (!f.scope.empty()) o.scope = parse_sparsity_scope(f.scope);
  if (!f.score.empty()) o.score = parse_h2o_score(f.score);
  if (!f.positions.empty()) o.positions = parse_sparsity_positions(f.positions);
  if (!f.ann.empty()) o.ann_backend = parse_key_index_backend(f.ann);
  if (!f.ann_transform.empty()) o.ann_transform = parse_mips_transform(f.ann_transform);
  return o;
}

void fit_kv_to_sparsity(const SparsityOptions& s, KvCacheOptions& kv) {
  const bool in_cache = s.positions == SparsityPositions::Cache ||
                        (s.positions == SparsityPositions::Default && s.policy == "sinks");
  if (!in_cache) return;
  kv.k.pre_rope = true;
  for (auto& layer : kv.layers) layer.k.pre_rope = true;
}

nlohmann::json sparsity_json(const SparsityOptions& resolved, const SparsityStats& stats) {
  return {
      {"kv_policy", resolved.policy},
      {"kv_policy_detail", describe(resolved)},
      {"kv_budget", resolved.budget},
      {"kv_read_fraction", stats.read_fraction()},
      {"kv_tokens_evicted", stats.tokens_evicted},
      {"kv_compactions", stats.compactions},
  };
}

}  // namespace kvserve::cli
