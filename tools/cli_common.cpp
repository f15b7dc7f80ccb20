#include "tools/cli_common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "kv/kv_calibration.h"
#include "kv/kv_spec.h"
#include "util/byte_size.h"
#include "server/kv_request.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

// Refuses KV flags the user gave that no layer's codec reads, instead of
// ignoring them (a preset's own settings are not flags: a preset plus a
// float type keeps working). `layers`: the final codecs, one per layer.
void refuse_unused_kv_flags(const CommonOptions& o, const std::vector<KvLayerCodecs>& layers) {
  auto any = [&](bool keys, bool values, auto&& reads) {
    return std::any_of(layers.begin(), layers.end(),
                       [&](const KvLayerCodecs& l) { return (keys && reads(l.k)) || (values && reads(l.v)); });
  };
  auto planes = [](bool keys, bool values) { return keys && values ? "keys or values" : keys ? "keys" : "values"; };
  // Groups and their scales: int8/int4/int2 with dynamic scales (q4_0 has
  // fixed 32-value groups, static scales one range per channel).
  auto dynamic_groups = [](const KvCodecConfig& c) { return kv_dtype_is_affine(c.dtype) && !c.is_static(); };
  auto check_groups = [&](const char* flag, bool given, bool keys, bool values) {
    if (given && !any(keys, values, dynamic_groups))
      fail("{} applies to int8, int4 and int2 with dynamic scales (q4_0 has fixed 32-value groups, static scales "
           "and float types none), and no layer stores its {} so: drop it",
           flag, planes(keys, values));
  };
  check_groups("--kv-grouping", !o.kv_grouping.empty(), true, true);
  check_groups("--kv-k-grouping", !o.kv_k_grouping.empty(), true, false);
  check_groups("--kv-v-grouping", !o.kv_v_grouping.empty(), false, true);
  check_groups("--kv-group", o.kv_group.has_value(), true, true);
  check_groups("--kv-k-group", o.kv_k_group.has_value(), true, false);
  check_groups("--kv-v-group", o.kv_v_group.has_value(), false, true);
  check_groups("--kv-scale-bits", o.kv_scale_bits.has_value(), true, true);
  check_groups("--kv-k-scale-bits", o.kv_k_scale_bits.has_value(), true, false);
  check_groups("--kv-v-scale-bits", o.kv_v_scale_bits.has_value(), false, true);
  auto affine = [](const KvCodecConfig& c) { return kv_dtype_is_affine(c.dtype); };
  for (const auto& [flag, n, keys] : {std::tuple{"--kv-k-outliers", o.kv_k_outliers, true},
                                      std::tuple{"--kv-v-outliers", o.kv_v_outliers, false}})
    if (n > 0 && !any(keys, !keys, affine))
      fail("{}: KV outliers apply to int8, int4 and int2, and no layer stores its {} so: drop it", flag,
           planes(keys, !keys));
  if (o.kv_residual && *o.kv_residual > 0 &&
      !any(true, true, [](const KvCodecConfig& c) { return kv_dtype_is_quantized(c.dtype); }))
    fail("--kv-residual applies to integer KV types (int8, int4, int2, q4_0), and no layer uses one: drop it");
}

}  // namespace

std::string read_text_file(const std::string& path, const char* flag) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) fail("{} '{}': no such file", flag, path);
  if (!std::filesystem::is_regular_file(status)) fail("{} '{}' is not a regular file", flag, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} '{}': cannot open it", flag, path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{} '{}': read error", flag, path);
  return text.str();
}

void check_writable_file(const std::string& path, const char* flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) fail("{} '{}' is a directory, not a file", flag, path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) fail("{} '{}': no such directory '{}'", flag, path, dir.string());
  if (::access(fs::exists(p, ec) ? path.c_str() : dir.c_str(), W_OK) != 0) fail("{} '{}' is not writable", flag, path);
}

void add_common_options(CLI::App& cmd, CommonOptions& o, bool model_required) {
  auto* m = cmd.add_option("--model", o.model_path, "checkpoint: GGUF or llama2.c .bin");
  if (model_required) m->required();
  cmd.add_option("--tokenizer", o.tokenizer_path, "tokenizer: llama2.c tokenizer .bin or GGUF (default: from the model)");
  // An empty value would read as "not given" (a type as fp32, a preset or a
  // spec as none): refused instead.
  auto named_as = [](const char* what) {
    return [what](const std::string& v) { return v.empty() ? fmt::format("{} must be named", what) : std::string(); };
  };
  const auto named = named_as("a KV type");
  cmd.add_option("--kv-preset", o.kv_preset, "KV configuration preset: fp32 | fp16 | int8 | int4 | int4-small | int2 | int2-small")
      ->check(named_as("a KV preset (fp32, fp16, int8, int4, int4-small, int2 or int2-small)"));
  cmd.add_option("--kv-dtype", o.kv_dtype, "KV storage for K and V: fp32 | fp16 | bf16 | fp8 (E4M3) | fp8_e5m2 | int8 | int4 | int2 | q4_0 (default fp32)")
      ->check(named);
  cmd.add_option("--kv-k", o.kv_k, "key storage type (overrides --kv-dtype)")->check(named);
  cmd.add_option("--kv-v", o.kv_v, "value storage type (overrides --kv-dtype)")->check(named);
  const auto grouping = named_as("a grouping (token or channel)");
  cmd.add_option("--kv-grouping", o.kv_grouping, "quantization groups for K and V: token | channel")->check(grouping);
  cmd.add_option("--kv-k-grouping", o.kv_k_grouping, "key groups: token | channel")->check(grouping);
  cmd.add_option("--kv-v-grouping", o.kv_v_grouping, "value groups: token | channel")->check(grouping);
  cmd.add_option("--kv-group", o.kv_group, "group size: values (token groups) or tokens (channel groups)");
  cmd.add_option("--kv-k-group", o.kv_k_group, "key group size");
  cmd.add_option("--kv-v-group", o.kv_v_group, "value group size");
  cmd.add_option("--kv-residual", o.kv_residual, "recent tokens kept in FP16 (multiple of the block size; default one block)");
  cmd.add_option("--kv-scale-bits", o.kv_scale_bits, "bits of each dynamic integer group's scale and min: 16 | 8");
  cmd.add_option("--kv-k-scale-bits", o.kv_k_scale_bits, "key scale bits (overrides --kv-scale-bits)");
  cmd.add_option("--kv-v-scale-bits", o.kv_v_scale_bits, "value scale bits (overrides --kv-scale-bits)");
  cmd.add_flag("--kv-k-pre-rope", o.kv_k_pre_rope, "store keys before RoPE (queries are rotated instead)");
  cmd.add_option("--kv-k-rope-span", o.kv_k_rope_span,
                 "pre-RoPE keys: tokens sharing one query rotation, each key stored rotated by its offset in the "
                 "span (divides the block size; 1 = exactly before RoPE; the int2 presets use 16)");
  cmd.add_option("--kv-k-outliers", o.kv_k_outliers, "key values per token kept exactly beside the codes (default 0)");
  cmd.add_option("--kv-v-outliers", o.kv_v_outliers, "value values per token kept exactly beside the codes (default 0)");
  cmd.add_option("--kv-calibration", o.kv_calibration, "calibration JSON from `kvserve calibrate` (static scales, layer assignment)")
      ->check(named_as("a calibration file"));
  cmd.add_option("--kv-scales", o.kv_scales, "static | dynamic (default: the calibration's recorded layout, else static)")
      ->check(named_as("static or dynamic"));
  cmd.add_option("--kv-layers", o.kv_layers, "per-layer overrides, e.g. \"0:fp16,1-4:int4\" or \"2:int8/int4\"")
      ->check(named_as("per-layer types (e.g. 0:fp16,1-4:int4)"));
  cmd.add_option("--block-size", o.block_size, "KV block size in tokens (default 16; 32 with the integer presets, 64 with the -small ones)");
  cmd.add_option("--kv-blocks", o.kv_blocks, "KV cache capacity in blocks (default: one full context; see README for bench, perplexity and serve)");
  cmd.add_option("--kv-memory", o.kv_memory, "KV cache capacity in bytes, e.g. 512MiB (instead of --kv-blocks)");
  cmd.add_option("--threads", o.threads, "threads (default: all cores)");
  ModelOverrides& mo = o.model_overrides;
  cmd.add_option("--ctx-size,--max-model-len", mo.context_length,
                 "context length to run, in tokens (default: the model's; past it, set a RoPE scaling)")
      ->check(CLI::Range(1, 1 << 24));
  cmd.add_option("--rope-freq-base", mo.rope_freq_base, "RoPE base frequency (default: the model's)")
      ->check(finite_in(0, 1e12, true));
  cmd.add_option("--rope-scaling", o.rope_scaling, "RoPE scaling: none | linear | yarn (default: the model's)")
      ->check(CLI::IsMember({"none", "linear", "yarn"}));
  cmd.add_option("--rope-scale", mo.rope_scale,
                 "RoPE context scaling factor: frequencies interpolated by 1/N (linear unless --rope-scaling says yarn)")
      ->check(finite_in(0, 1e6, true));
  cmd.add_option("--yarn-orig-ctx", mo.yarn_original_context, "YaRN: the context before scaling (default: the model's)")
      ->check(CLI::Range(1, 1 << 30));
  cmd.add_option("--yarn-ext-factor", mo.yarn_ext_factor, "YaRN: extrapolation mix, 0..1 (default 1)")
      ->check(finite_in(0, 1));
  cmd.add_option("--yarn-attn-factor", mo.yarn_attn_factor,
                 "RoPE magnitude factor on q and k, any scaling; YaRN adds its log term (default: the file's, else 1)")
      ->check(finite_in(0, 1e6, true));
  cmd.add_option("--yarn-beta-fast", mo.yarn_beta_fast, "YaRN: low correction dimension (default 32)")
      ->check(finite_in(0, 1e6, true));
  cmd.add_option("--yarn-beta-slow", mo.yarn_beta_slow, "YaRN: high correction dimension (default 1)")
      ->check(finite_in(0, 1e6, true));
  cmd.add_flag("--json", o.json, "print one JSON object on stdout");
}

int64_t parse_bytes(const std::string& text) { return parse_byte_size(text); }

ModelOverrides model_overrides(const CommonOptions& o) {
  ModelOverrides m = o.model_overrides;
  if (!o.rope_scaling.empty()) m.rope_scaling = parse_rope_scaling_type(o.rope_scaling).value();
  return m;
}

std::unique_ptr<Model> load_model(const CommonOptions& o) {
  auto model = Model::load(o.model_path, o.tokenizer_path, model_overrides(o));
  const ModelConfig& c = model->config();
  // The file's own scaling already covers its declared context; past that,
  // only a scaling given here stretches further.
  if (c.seq_len > model->trained_context_length() && !o.model_overrides.rope_scale && o.rope_scaling.empty())
    std::fprintf(stderr,
                 "kvserve: note: --ctx-size %d is past the model's context of %d with no RoPE scaling given "
                 "(--rope-scaling, --rope-scale): positions past it were never trained\n",
                 c.seq_len, model->trained_context_length());
  return model;
}

KvCacheOptions kv_options(const CommonOptions& o, const Model& model, bool refuse_unused) {
  const int n_layers = model.config().n_layers;
  std::optional<KvCalibration> calibration;
  if (!o.kv_calibration.empty()) {
    calibration = load_kv_calibration(o.kv_calibration);
    check_kv_calibration_model(*calibration, o.kv_calibration, model.fingerprint());
  }
  KvCacheOptions k;
  k.block_size = o.block_size.value_or(16);
  // An assignment's recorded layout takes the place of a preset: the file
  // alone runs what was measured, and flags given override parts of it.
  if (!o.kv_preset.empty()) apply_kv_preset(k, o.kv_preset, o.block_size.has_value());
  else if (calibration && calibration->layout) apply_kv_calibration_layout(k, *calibration->layout, o.block_size.has_value());
  if (!o.kv_dtype.empty()) k.set_dtype(parse_kv_dtype(o.kv_dtype));
  if (!o.kv_k.empty()) k.k.dtype = parse_kv_dtype(o.kv_k);
  if (!o.kv_v.empty()) k.v.dtype = parse_kv_dtype(o.kv_v);
  if (!o.kv_grouping.empty()) k.k.grouping = k.v.grouping = parse_kv_grouping(o.kv_grouping);
  if (!o.kv_k_grouping.empty()) k.k.grouping = parse_kv_grouping(o.kv_k_grouping);
  if (!o.kv_v_grouping.empty()) k.v.grouping = parse_kv_grouping(o.kv_v_grouping);
  auto group = [](const char* flag, const std::optional<int32_t>& given, std::initializer_list<KvCodecConfig*> into) {
    if (!given) return;
    if (*given < 0) fail("{} must be >= 0 (0: the default, a head or a block; got {})", flag, *given);
    for (KvCodecConfig* c : into) c->group_size = *given;
  };
  group("--kv-group", o.kv_group, {&k.k, &k.v});
  group("--kv-k-group", o.kv_k_group, {&k.k});
  group("--kv-v-group", o.kv_v_group, {&k.v});
  if (o.kv_k_pre_rope) k.k.pre_rope = true;
  if (o.kv_k_rope_span) {
    if (*o.kv_k_rope_span < 1) fail("--kv-k-rope-span must be >= 1 (got {})", *o.kv_k_rope_span);
    k.k.rope_span = *o.kv_k_rope_span;
  }
  if (o.kv_k_outliers < 0 || o.kv_v_outliers < 0)
    fail("--kv-k-outliers and --kv-v-outliers must be >= 0 (got {}, {})", o.kv_k_outliers, o.kv_v_outliers);
  if (o.kv_k_outliers > 0) k.k.outliers = o.kv_k_outliers;
  if (o.kv_v_outliers > 0) k.v.outliers = o.kv_v_outliers;
  auto scale_bits = [](const char* flag, const std::optional<int>& bits, KvCodecConfig& c) {
    if (!bits) return;
    if (*bits != 16 && *bits != 8) fail("{} must be 16 or 8 (got {})", flag, *bits);
    c.scale_bits = *bits;
  };
  scale_bits("--kv-scale-bits", o.kv_scale_bits, k.k);
  scale_bits("--kv-scale-bits", o.kv_scale_bits, k.v);
  scale_bits("--kv-k-scale-bits", o.kv_k_scale_bits, k.k);
  scale_bits("--kv-v-scale-bits", o.kv_v_scale_bits, k.v);
  if (o.kv_residual) {
    if (*o.kv_residual < 0) fail("--kv-residual must be >= 0 (got {})", *o.kv_residual);
    k.residual = *o.kv_residual;
  }
  if (!o.kv_scales.empty() && o.kv_scales != "static" && o.kv_scales != "dynamic")
    fail("--kv-scales must be static or dynamic (got '{}')", o.kv_scales);
  const bool use_static = o.kv_scales.empty() ? !calibration || !calibration->layout || calibration->layout->static_scales
                                              : o.kv_scales == "static";
  if (calibration) {
    // The file's per-layer assignment sets every layer's types: a type given
    // as well would be overridden without a word.
    if (!calibration->assignment.empty() && (!o.kv_dtype.empty() || !o.kv_k.empty() || !o.kv_v.empty()))
      fail("calibration '{}' assigns each layer's KV types (calibrate --kv-bits): drop --kv-dtype/--kv-k/--kv-v, "
           "or override layers with --kv-layers",
           o.kv_calibration);
    apply_kv_calibration(k, *calibration, n_layers, /*use_static=*/false);  // the assignment; ranges below
  } else if (o.kv_scales == "static") {
    fail("--kv-scales static needs --kv-calibration (run `kvserve calibrate` first)");
  }
  if (!o.kv_layers.empty()) apply_kv_layers(k, parse_kv_layers(o.kv_layers, n_layers), n_layers);
  // Static ranges after the overrides, so layers they made integer take theirs too.
  if (calibration && use_static) apply_kv_static_ranges(k, *calibration, n_layers);
  // Outliers (--kv-k-outliers) apply to the integer layers of a mixed cache;
  // the float ones drop them. With no integer layer at all the codec refuses
  // them, as for a uniform float cache.
  for (KvCodecConfig KvLayerCodecs::*plane : {&KvLayerCodecs::k, &KvLayerCodecs::v}) {
    auto affine = [plane](const KvLayerCodecs& l) { return kv_dtype_is_affine((l.*plane).dtype); };
    if (std::any_of(k.layers.begin(), k.layers.end(), affine))
      for (KvLayerCodecs& l : k.layers)
        if (!affine(l)) (l.*plane).outliers = 0;
  }
  // A preset's pre-RoPE keys (int2) are a quantization trick: keys whose
  // final type is float (--kv-k fp16, a --kv-layers entry) keep RoPE
  // applied, unless the flags ask for pre-RoPE keys or a span. Layers set
  // back to a quantized type keep the preset's storage.
  if (!o.kv_k_pre_rope && !o.kv_k_rope_span) {
    auto after_rope_if_float = [](KvCodecConfig& c) {
      if (!kv_dtype_is_quantized(c.dtype)) c.pre_rope = false, c.rope_span = 1;
    };
    after_rope_if_float(k.k);
    for (KvLayerCodecs& layer : k.layers) after_rope_if_float(layer.k);
  }
  if (refuse_unused) {
    refuse_unused_kv_flags(o, k.layers.empty() ? std::vector<KvLayerCodecs>{{k.k, k.v}} : k.layers);
    // A file without an assignment only lends its ranges to integer layers with static scales.
    if (calibration && calibration->assignment.empty() &&
        std::none_of(k.layers.begin(), k.layers.end(), [](const KvLayerCodecs& l) { return l.k.is_static() || l.v.is_static(); }))
      fail("calibration '{}' has no per-layer assignment and no layer uses its ranges ({}): drop --kv-calibration, "
           "or give an integer type (e.g. --kv-dtype int8){}",
           o.kv_calibration, use_static ? "no int8, int4 or int2 layer" : "--kv-scales dynamic",
           use_static ? "" : " with static scales");
  }
  if (o.kv_blocks && o.kv_memory) fail("give --kv-blocks or --kv-memory, not both");
  if (o.kv_blocks) {
    if (*o.kv_blocks <= 0) fail("--kv-blocks must be positive (got {})", *o.kv_blocks);
    k.num_blocks = *o.kv_blocks;
  }
  if (o.kv_memory) {
    k.budget_bytes = parse_bytes(*o.kv_memory);
    if (k.budget_bytes <= 0) fail("--kv-memory must be positive (got '{}')", *o.kv_memory);
  }
  return k;
}

std::string kv_description(const KvCache& cache) { return kv_codec_description(cache); }

int thread_count(const CommonOptions& o) {
  // Thousands of threads on a few cores only wait on each other (10000 took
  // 51 s for 10 tokens) or run the host out of memory.
  constexpr int kMaxThreads = 1024;
  if (o.threads < 0 || o.threads > kMaxThreads)
    fail("--threads must be in 0..{} (0: every core; got {})", kMaxThreads, o.threads);
  return o.threads == 0 ? default_thread_count() : o.threads;
}

CLI::Validator finite_in(double min, double max, bool above_min, bool infinity_ok) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        const bool parsed = CLI::detail::lexical_cast(text, v);
        if (parsed && infinity_ok && v == std::numeric_limits<double>::infinity()) return {};
        if (parsed && std::isfinite(v) && (above_min ? v > min : v >= min) && v <= max) return {};
        const char* kind = infinity_ok ? "a number (or inf)" : "a finite number";
        if (max == std::numeric_limits<double>::max())
          return fmt::format("must be {} {} {} (got '{}')", kind, above_min ? ">" : ">=", min, text);
        return fmt::format("must be {} in {}{}, {}] (got '{}')", kind, above_min ? "(" : "[", min, max, text);
      },
      "NUMBER");
}

std::string json_text(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void print_json(const nlohmann::json& j) { std::printf("%s\n", json_text(j).c_str()); }

nlohmann::json kv_stats_json(const KvStats& s) {
  return {
      {"kv_bytes_per_token", s.bytes_per_token},
      {"kv_block_size", s.block_size},
      {"kv_blocks_total", s.blocks_total},
      {"kv_blocks_used", s.blocks_used},
      {"kv_blocks_free", s.blocks_free},
      {"kv_tokens_stored", s.tokens_stored},
      {"kv_bytes_used", s.bytes_used},
      {"kv_bytes_capacity", s.bytes_capacity},
      {"kv_fragmentation", s.fragmentation},
      {"kv_residual", s.residual},
      {"kv_staging_used", s.staging_used},
      {"kv_blocks_for_staging", s.blocks_for_staging},
  };
}

}  // namespace kvserve::cli
