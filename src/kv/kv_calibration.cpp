#include "kv/kv_calibration.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "util/error.h"

namespace kvserve {
namespace {

nlohmann::json codec_layout_json(const KvCodecConfig& c) {
  return {{"grouping", std::string(kv_grouping_name(c.grouping))},
          {"group", c.group_size},
          {"pre_rope", c.pre_rope},
          {"rope_span", c.rope_span},
          {"scale_bits", c.scale_bits},
          {"outliers", c.outliers}};
}

// Reads what codec_layout_json wrote; range checks are the cache's (make_kv_codec).
KvCodecConfig codec_layout_from_json(const nlohmann::json& j) {
  KvCodecConfig c;
  c.grouping = parse_kv_grouping(j.at("grouping").get<std::string>());
  c.group_size = j.at("group").get<int>();
  c.pre_rope = j.at("pre_rope").get<bool>();
  c.rope_span = j.at("rope_span").get<int>();
  c.scale_bits = j.at("scale_bits").get<int>();
  c.outliers = j.at("outliers").get<int>();
  return c;
}

}  // namespace

void save_kv_calibration(const std::string& path, const KvCalibration& c) {
  nlohmann::json j;
  j["format"] = "kvserve-kv-calibration-1";
  j["model"] = c.model;
  if (!c.model_fingerprint.empty()) j["model_fingerprint"] = c.model_fingerprint;
  j["percentile"] = c.percentile;
  j["tokens"] = c.tokens;
  j["kv_dim"] = c.kv_dim;
  for (size_t l = 0; l < c.k.size(); ++l)
    j["layers"].push_back({{"k_min", c.k[l].min}, {"k_max", c.k[l].max}, {"v_min", c.v[l].min}, {"v_max", c.v[l].max}});
  if (!c.assignment.empty()) {
    j["target_bits"] = c.target_bits;
    for (const auto& a : c.assignment)
      j["assignment"].push_back({{"k", std::string(kv_dtype_name(a.k))}, {"v", std::string(kv_dtype_name(a.v))}});
  }
  if (c.layout)
    j["layout"] = {{"block_size", c.layout->block_size},
                   {"residual", c.layout->residual},
                   {"scales", c.layout->static_scales ? "static" : "dynamic"},
                   {"k", codec_layout_json(c.layout->k)},
                   {"v", codec_layout_json(c.layout->v)}};
  for (const auto& s : c.sensitivity)
    j["sensitivity"].push_back({{"layer", s.layer}, {"kv", s.is_key ? "k" : "v"},
                                {"dtype", std::string(kv_dtype_name(s.dtype))}, {"kl_divergence", s.kl_divergence}});
  std::ofstream out(path);
  if (!out) fail("cannot write calibration '{}'", path);
  out << j.dump(1) << "\n";
  if (!out) fail("failed writing calibration '{}'", path);
}

KvCalibration load_kv_calibration(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("calibration '{}' is a directory, not a file", path);
  std::ifstream in(path);
  if (!in) fail("cannot open calibration '{}'", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("calibration '{}' is not valid JSON: {}", path, e.what());
  }
  KvCalibration c;
  try {
    if (j.value("format", "") != "kvserve-kv-calibration-1") fail("'{}' is not a kvserve KV calibration file", path);
    c.model = j.value("model", "");
    c.model_fingerprint = j.value("model_fingerprint", "");
    c.percentile = j.value("percentile", 99.9);
    c.tokens = j.value("tokens", int64_t(0));
    const nlohmann::json& kv_dim = j.at("kv_dim");
    if (!kv_dim.is_number_integer() || kv_dim.get<int64_t>() <= 0 || kv_dim.get<int64_t>() > (int64_t(1) << 20))
      fail("calibration '{}': kv_dim must be a positive whole number of channels (got {})", path, kv_dim.dump());
    c.kv_dim = kv_dim.get<int>();
    if (j.at("layers").empty()) fail("calibration '{}' has no layers", path);
    for (const auto& l : j.at("layers")) {
      KvChannelRanges k{l.at("k_min").get<std::vector<float>>(), l.at("k_max").get<std::vector<float>>()};
      KvChannelRanges v{l.at("v_min").get<std::vector<float>>(), l.at("v_max").get<std::vector<float>>()};
      for (const auto* r : {&k, &v})
        if (r->min.size() != size_t(c.kv_dim) || r->max.size() != size_t(c.kv_dim))
          fail("calibration '{}': a layer's ranges do not have kv_dim = {} channels", path, c.kv_dim);
      c.k.push_back(std::move(k));
      c.v.push_back(std::move(v));
    }
    if (j.contains("assignment")) {
      c.target_bits = j.value("target_bits", 0.0);
      for (const auto& a : j.at("assignment"))
        c.assignment.push_back({parse_kv_dtype(a.at("k").get<std::string>()), parse_kv_dtype(a.at("v").get<std::string>())});
      if (c.assignment.size() != c.k.size()) fail("calibration '{}': assignment and ranges cover different layer counts", path);
    }
    if (j.contains("layout")) {
      const nlohmann::json& l = j.at("layout");
      KvCalibrationLayout layout;
      layout.block_size = l.at("block_size").get<int32_t>();
      layout.residual = l.at("residual").get<int32_t>();
      const std::string scales = l.at("scales").get<std::string>();
      if (scales != "static" && scales != "dynamic")
        fail("calibration '{}': layout scales must be static or dynamic (got '{}')", path, scales);
      layout.static_scales = scales == "static";
      layout.k = codec_layout_from_json(l.at("k"));
      layout.v = codec_layout_from_json(l.at("v"));
      c.layout = layout;
    }
  } catch (const nlohmann::json::exception& e) {
    fail("calibration '{}' is malformed: {}", path, e.what());
  }
  return c;
}

void check_kv_calibration_model(const KvCalibration& c, const std::string& path, const std::string& fingerprint) {
  if (!c.model_fingerprint.empty() && c.model_fingerprint != fingerprint)
    fail("calibration '{}' was measured on another model ({}, fingerprint {}; this one's is {}): run `kvserve "
         "calibrate` on this model",
         path, c.model, c.model_fingerprint, fingerprint);
}

void apply_kv_calibration_layout(KvCacheOptions& options, const KvCalibrationLayout& layout, bool keep_block_size) {
  if (!keep_block_size) options.block_size = layout.block_size;
  options.residual = layout.residual;
  auto set = [](KvCodecConfig& c, const KvCodecConfig& recorded) {
    const KvDType t = c.dtype;
    c = recorded;
    c.retype(t);
  };
  set(options.k, layout.k);
  set(options.v, layout.v);
}

void apply_kv_calibration(KvCacheOptions& options, const KvCalibration& c, int n_layers, bool use_static) {
  if (int(c.k.size()) != n_layers)
    fail("calibration covers {} layers, the model has {}", c.k.size(), n_layers);
  if (options.layers.empty()) options.layers.assign(size_t(n_layers), KvLayerCodecs{options.k, options.v});
  for (int l = 0; l < n_layers; ++l) {
    KvLayerCodecs& lc = options.layers[size_t(l)];
    if (!c.assignment.empty()) {
      lc.k.retype(c.assignment[size_t(l)].k);
      lc.v.retype(c.assignment[size_t(l)].v);
    }
    if (!use_static) {
      lc.k.static_min.clear(), lc.k.static_max.clear();
      lc.v.static_min.clear(), lc.v.static_max.clear();
    }
  }
  if (use_static) apply_kv_static_ranges(options, c, n_layers);
}

void apply_kv_static_ranges(KvCacheOptions& options, const KvCalibration& c, int n_layers) {
  auto set_static = [](KvCodecConfig& cfg, const KvChannelRanges& r) {
    if (kv_dtype_is_affine(cfg.dtype)) {
      cfg.static_min = r.min;
      cfg.static_max = r.max;
    } else {
      cfg.static_min.clear();
      cfg.static_max.clear();
    }
  };
  for (int l = 0; l < n_layers; ++l) {
    set_static(options.layers[size_t(l)].k, c.k[size_t(l)]);
    set_static(options.layers[size_t(l)].v, c.v[size_t(l)]);
  }
}

}  // namespace kvserve
