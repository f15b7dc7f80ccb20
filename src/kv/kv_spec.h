// Text forms of KV cache configurations, shared by the CLI and (later) the
// server: per-layer overrides ("0:fp16,1-4:int4", "2:int8/int4" for K/V),
// presets, and calibration files.
#pragma once

#include <string>
#include <vector>

#include "kv/kv_cache.h"

namespace kvserve {

// One parsed override: layers [first, last] get dtypes k and v.
struct KvLayerOverride {
  int first = 0;
  int last = 0;
  KvDType k = KvDType::F16;
  KvDType v = KvDType::F16;
};

// Parses "L:DTYPE" / "A-B:DTYPE" / "L:KDTYPE/VDTYPE" items separated by
// commas. Throws kvserve::Error on syntax errors or layers outside [0, n_layers).
std::vector<KvLayerOverride> parse_kv_layers(const std::string& spec, int n_layers);

// Applies overrides to options: fills options.layers from options.k/options.v
// if empty, then sets the dtype of each overridden layer, keeping its
// grouping, group size, pre-RoPE storage and (for integer types) static
// ranges. Later overrides of a layer win. Whether float keys keep pre-RoPE
// storage is the caller's choice, made once on the final types (the CLI
// stores them after RoPE unless --kv-k-pre-rope or a span was given).
void apply_kv_layers(KvCacheOptions& options, const std::vector<KvLayerOverride>& overrides, int n_layers);

// Preset names and the configuration each stands for (measured choices; see
// BENCHMARKS.md): fp32, fp16, int8, int4, int4-small, int2, int2-small, from
// the largest cache to the smallest.
std::vector<std::string> kv_preset_names();
// Sets options' K/V codecs and residual window. The integer presets also set
// their block size (32 tokens; 64 for the -small presets) unless
// keep_block_size (a block size the user chose).
// Throws kvserve::Error for an unknown name.
void apply_kv_preset(KvCacheOptions& options, const std::string& name, bool keep_block_size = false);

}  // namespace kvserve
