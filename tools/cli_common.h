// Options every kvserve subcommand shares, and the objects they build.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "attention/sparsity_policy.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "util/thread_pool.h"

namespace kvserve::cli {

struct CommonOptions {
  std::string model_path;
  std::string tokenizer_path;
  // KV configuration, applied in this order: preset, --kv-dtype, --kv-k/--kv-v,
  // grouping and group sizes, calibration, --kv-layers. Empty = not given.
  std::string kv_preset;
  std::string kv_dtype;
  std::string kv_k, kv_v;
  std::string kv_grouping, kv_k_grouping, kv_v_grouping;
  // Numbers not given stay empty: every value given is checked, none is a
  // sentinel that a typed -1 or 0 would silently match.
  std::optional<int32_t> kv_group, kv_k_group, kv_v_group;
  std::optional<int32_t> kv_residual;
  bool kv_k_pre_rope = false;
  std::optional<int> kv_k_rope_span;
  int kv_k_outliers = 0, kv_v_outliers = 0;  // values per token row kept exactly
  std::optional<int> kv_scale_bits, kv_k_scale_bits, kv_v_scale_bits;
  std::string kv_calibration;
  std::string kv_scales;        // static | dynamic (default static when calibrated)
  std::string kv_layers;
  std::optional<int32_t> block_size;  // not given: 16, or the preset's
  std::optional<int64_t> kv_blocks;     // neither given: one full context
  std::optional<std::string> kv_memory;  // e.g. "512MiB" (instead of kv_blocks)
  int threads = 0;              // 0 = all hardware threads
  bool json = false;
  // Context and RoPE over the checkpoint's (--ctx-size, --rope-*, --yarn-*);
  // --rope-scaling's name is kept apart until model_overrides() reads it.
  ModelOverrides model_overrides;
  std::string rope_scaling;
};

// The overrides to pass to Model::load.
ModelOverrides model_overrides(const CommonOptions& o);
// Model::load with the common options' tokenizer and overrides.
std::unique_ptr<Model> load_model(const CommonOptions& o);

// Adds --model (required when model_required), --tokenizer, --kv-dtype,
// --block-size, --kv-blocks, --kv-memory, --threads, --json.
void add_common_options(CLI::App& cmd, CommonOptions& o, bool model_required = true);

// The bytes of a text file (--file, --data): a clear error for a missing,
// unreadable or non-regular file (a directory read as empty text before).
std::string read_text_file(const std::string& path, const char* flag);

// Fails unless `path` (an output, e.g. --out) can be written: a directory,
// a missing parent directory or no write permission, before any work.
void check_writable_file(const std::string& path, const char* flag);

// Parses "4096", "512KiB", "64MiB", "2GiB" (also KB/MB/GB as powers of 1000).
int64_t parse_bytes(const std::string& text);

// The KV cache options the flags describe for `model` (its layer count; a
// calibration file's recorded model must be it). With refuse_unused, KV
// flags given that no layer's codec reads (a group size on fp16, a window
// without integer layers...) are an error; calibrate passes false, since
// its candidates take their types later.
KvCacheOptions kv_options(const CommonOptions& o, const Model& model, bool refuse_unused = true);
// A short text naming the cache's resolved K/V codecs, for reports.
std::string kv_description(const KvCache& cache);
int thread_count(const CommonOptions& o);

// The KV cache accounting as JSON fields (documented in the README).
nlohmann::json kv_stats_json(const KvStats& s);
// A flag's value must be a finite number in [min, max], or in (min, max]
// with above_min; +inf too with infinity_ok (CLI::Range lets NaN through:
// every comparison with it is false).
CLI::Validator finite_in(double min, double max = std::numeric_limits<double>::max(), bool above_min = false,
                         bool infinity_ok = false);
// Prints j on one line of stdout. Invalid UTF-8 in its strings (a sampled
// byte token that ends mid-character, a path) becomes U+FFFD, as the server
// writes it, instead of failing after the work is done.
void print_json(const nlohmann::json& j);
// j as compact JSON text, invalid UTF-8 replaced the same way.
std::string json_text(const nlohmann::json& j);

// KV sparsity flags (issue 4) of generate, perplexity and bench; defined in
// cli_sparsity.cpp.
struct SparsityFlags {
  SparsityOptions options;
  std::string scope, score, positions, ann, ann_transform;  // empty = not given
};
// Adds --kv-policy, --kv-budget, --kv-sinks, --kv-window, --kv-observe,
// --kv-pool, --kv-horizon, --kv-scope, --kv-score, --kv-value-norm, --kv-positions,
// --kv-ann, --kv-ann-transform, --kv-compact-slack.
void add_sparsity_options(CLI::App& cmd, SparsityFlags& flags);
// The parsed options. Throws kvserve::Error on an unknown name.
SparsityOptions sparsity_options(const SparsityFlags& flags);
// Stores keys before RoPE in every layer when the policy keeps positions
// within the cache (sinks by default), which needs them.
void fit_kv_to_sparsity(const SparsityOptions& sparsity, KvCacheOptions& kv);
// The policy's JSON fields (documented in the README).
nlohmann::json sparsity_json(const SparsityOptions& resolved, const SparsityStats& stats);

// Every subcommand registers itself here.
void register_generate(CLI::App& app);
void register_perplexity(CLI::App& app);
void register_bench(CLI::App& app);
void register_inspect(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_synth(CLI::App& app);
void register_calibrate(CLI::App& app);
void register_serve(CLI::App& app);

}  // namespace kvserve::cli
