#include "engine/kv_calibrator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>

#include "engine/perplexity.h"
#include "util/error.h"

namespace kvserve {
namespace {

// Values of one channel observed so far, per (layer, K/V, channel).
using ChannelSamples = std::vector<std::vector<float>>;  // (kv_dim, samples)

float percentile_of(std::vector<float>& v, double p) {
  if (v.empty()) return 0.0f;
  const size_t k = std::min(v.size() - 1, size_t(std::llround(p / 100.0 * double(v.size() - 1))));
  std::nth_element(v.begin(), v.begin() + long(k), v.end());
  return v[k];
}

KvChannelRanges ranges_of(ChannelSamples& samples, double percentile) {
  KvChannelRanges r;
  for (auto& ch : samples) {
    float lo = percentile_of(ch, 100.0 - percentile), hi = percentile_of(ch, percentile);
    if (hi < lo) std::swap(lo, hi);
    r.min.push_back(lo);
    r.max.push_back(hi);
  }
  return r;
}

}  // namespace

std::vector<int> choose_assignment(const std::vector<std::vector<double>>& cost,
                                   const std::vector<std::vector<double>>& bits, double target_bits) {
  // Knapsack over items with the bit budget in 1/16-bit units: exact for the
  // bit widths codecs have (metadata makes fractional bits).
  constexpr double kUnit = 16.0;
  const size_t n = cost.size();
  if (!std::isfinite(target_bits) || target_bits <= 0)
    fail("an average of {} bits per value is not a bit budget", target_bits);
  // More bits than every item's widest choice buy nothing more (and would
  // size the table by the request).
  double widest = 0;
  for (const auto& item : bits)
    for (double b : item) widest = std::max(widest, b);
  target_bits = std::min(target_bits, widest);
  const int budget = int(std::floor(target_bits * double(n) * kUnit + 1e-6));
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(n + 1, std::vector<double>(size_t(budget) + 1, inf));
  std::vector<std::vector<int>> pick(n, std::vector<int>(size_t(budget) + 1, -1));
  best[0][0] = 0;
  for (size_t i = 0; i < n; ++i)
    for (int used = 0; used <= budget; ++used) {
      if (best[i][size_t(used)] == inf) continue;
      for (size_t o = 0; o < cost[i].size(); ++o) {
        const int next = used + int(std::ceil(bits[i][o] * kUnit - 1e-6));
        if (next > budget) continue;
        const double c = best[i][size_t(used)] + cost[i][o];
        if (c < best[i + 1][size_t(next)]) best[i + 1][size_t(next)] = c, pick[i][size_t(next)] = int(o);
      }
    }
  const auto it = std::min_element(best[n].begin(), best[n].end());
  if (*it == inf) fail("no KV assignment meets an average of {} bits per value", target_bits);
  std::vector<int> choice(n);
  int used = int(it - best[n].begin());
  for (size_t i = n; i-- > 0;) {
    choice[i] = pick[i][size_t(used)];
    used -= int(std::ceil(bits[i][size_t(choice[i])] * kUnit - 1e-6));
  }
  return choice;
}

KvCalibration calibrate_kv(Transformer& transformer, std::span<const int32_t> tokens, int32_t bos_id,
                           const CalibrateOptions& options, const CalibrateProgress& progress) {
  const ModelConfig& c = transformer.config();
  const int kv_dim = c.kv_dim(), n_layers = c.n_layers;
  if (!(options.percentile > 50.0 && options.percentile <= 100.0))  // NaN too
    fail("--percentile must be in (50, 100] (got {})", options.percentile);
  if (options.range_chunks <= 0) fail("--chunks must be positive");
  if (!std::isfinite(options.target_bits) || options.target_bits < 0)
    fail("--kv-bits must be 0 (no assignment) or an average number of bits per value (got {})", options.target_bits);
  if (options.target_bits > 0 && options.sensitivity_chunks <= 0)
    fail("--sensitivity-chunks must be positive (got {})", options.sensitivity_chunks);
  if (options.target_bits > 0) {  // before the measurements, not after
    int fewest = INT_MAX;
    for (KvDType t : options.candidates) fewest = std::min(fewest, kv_dtype_bits(t));
    if (options.target_bits < fewest)
      fail("no KV assignment meets an average of {} bits per value: the narrowest candidate type has {} bits",
           options.target_bits, fewest);
  }
  if (options.skip_chunks < 0) fail("--skip-chunks must be >= 0");
  const int64_t skipped = int64_t(options.skip_chunks) * options.ctx;
  const int64_t needed = int64_t(options.range_chunks) * options.ctx;
  if (int64_t(tokens.size()) < skipped + needed)
    fail("calibration text has {} tokens; skipping {} and observing {} chunks of {} needs {}", tokens.size(),
         options.skip_chunks, options.range_chunks, options.ctx, skipped + needed);
  tokens = tokens.subspan(size_t(skipped));

  // 1. Ranges: observe K (after RoPE, as stored) and V of every layer.
  std::vector<ChannelSamples> ks(static_cast<size_t>(n_layers), ChannelSamples(static_cast<size_t>(kv_dim)));
  std::vector<ChannelSamples> vs(static_cast<size_t>(n_layers), ChannelSamples(static_cast<size_t>(kv_dim)));
  transformer.set_kv_observer([&](int layer, const float* k, const float* v, int64_t n) {
    for (int64_t t = 0; t < n; ++t)
      for (int d = 0; d < kv_dim; ++d) {
        ks[size_t(layer)][size_t(d)].push_back(k[t * kv_dim + d]);
        vs[size_t(layer)][size_t(d)].push_back(v[t * kv_dim + d]);
      }
  });
  KvCacheOptions fp32;
  fp32.block_size = options.layout.block_size;
  fp32.num_blocks = (options.ctx + fp32.block_size - 1) / fp32.block_size;
  KvCache reference(c, fp32);
  PerplexityOptions ppl;
  ppl.ctx = options.ctx;
  ppl.chunks = options.range_chunks;
  perplexity(transformer, reference, tokens, bos_id, ppl,
             [&](int32_t done, int32_t total) { if (progress) progress("ranges", done, total); });
  transformer.set_kv_observer(nullptr);

  KvCalibration cal;
  cal.model = transformer.model().path();
  cal.model_fingerprint = transformer.model().fingerprint();
  cal.percentile = options.percentile;
  cal.tokens = needed;
  cal.kv_dim = kv_dim;
  for (int l = 0; l < n_layers; ++l) {
    cal.k.push_back(ranges_of(ks[size_t(l)], options.percentile));
    cal.v.push_back(ranges_of(vs[size_t(l)], options.percentile));
    ks[size_t(l)].clear();
    vs[size_t(l)].clear();
  }
  if (options.target_bits <= 0) return cal;

  // 2. Sensitivity: quantize one (layer, K or V) at a time, everything else
  // FP32; the cost is the mean KL divergence from the FP32 model.
  const size_t n_opts = options.candidates.size();
  std::vector<std::vector<double>> cost(size_t(2 * n_layers), std::vector<double>(n_opts, 0.0));
  std::vector<std::vector<double>> bits(size_t(2 * n_layers), std::vector<double>(n_opts, 0.0));
  ppl.chunks = std::min<int32_t>(options.sensitivity_chunks, int32_t(tokens.size() / size_t(options.ctx)));
  const int32_t total = int32_t(2 * n_layers * n_opts);
  int32_t done = 0;
  for (int l = 0; l < n_layers; ++l)
    for (int is_key = 1; is_key >= 0; --is_key)
      for (size_t o = 0; o < n_opts; ++o) {
        const KvDType t = options.candidates[o];
        KvCodecConfig cand = is_key ? options.layout.k : options.layout.v;
        cand.retype(t);
        if (!kv_dtype_is_affine(t) || !options.static_scales) {
          cand.static_min.clear();
          cand.static_max.clear();
        } else {
          const KvChannelRanges& r = is_key ? cal.k[size_t(l)] : cal.v[size_t(l)];
          cand.static_min = r.min;
          cand.static_max = r.max;
        }
        const size_t item = size_t(2 * l + (is_key ? 0 : 1));
        bits[item][o] = kv_dtype_bits(t);
        KvCacheOptions trial = fp32;
        trial.residual = options.layout.residual;
        trial.layers.assign(size_t(n_layers), KvLayerCodecs{});
        (is_key ? trial.layers[size_t(l)].k : trial.layers[size_t(l)].v) = cand;
        KvCache cache(c, trial);
        const PerplexityResult r = perplexity(transformer, cache, tokens, bos_id, ppl, nullptr, &reference);
        cost[item][o] = r.kl_divergence;
        cal.sensitivity.push_back({l, bool(is_key), t, r.kl_divergence});
        if (progress) progress("sensitivity", ++done, total);
      }

  // 3. The cheapest assignment within the budget.
  const std::vector<int> choice = choose_assignment(cost, bits, options.target_bits);
  cal.target_bits = options.target_bits;
  KvCalibrationLayout& layout = cal.layout.emplace();
  layout.block_size = options.layout.block_size;
  layout.residual = options.layout.residual < 0 ? options.layout.block_size : options.layout.residual;
  layout.k = options.layout.k;
  layout.v = options.layout.v;
  layout.static_scales = options.static_scales;
  for (int l = 0; l < n_layers; ++l)
    cal.assignment.push_back({options.candidates[size_t(choice[size_t(2 * l)])],
                              options.candidates[size_t(choice[size_t(2 * l + 1)])]});
  return cal;
}

}  // namespace kvserve
