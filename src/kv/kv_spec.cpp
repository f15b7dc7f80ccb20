#include "kv/kv_spec.h"

#include <charconv>
#include <numeric>
#include <sstream>

#include "util/error.h"

namespace kvserve {
namespace {

int parse_layer(const std::string& text, const std::string& item, int n_layers) {
  int v = -1;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size())
    fail("--kv-layers: '{}' in '{}' is not a layer number", text, item);
  if (v < 0 || v >= n_layers) fail("--kv-layers: layer {} is out of range (the model has {} layers)", v, n_layers);
  return v;
}

}  // namespace

std::vector<KvLayerOverride> parse_kv_layers(const std::string& spec, int n_layers) {
  std::vector<KvLayerOverride> out;
  std::stringstream items(spec);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == std::string::npos) fail("--kv-layers: '{}' lacks ':' (expected e.g. 0:fp16 or 1-4:int4)", item);
    const std::string range = item.substr(0, colon), types = item.substr(colon + 1);
    KvLayerOverride o;
    if (range.empty() || range[0] == '-')
      fail("--kv-layers: '{}' in '{}' is not a layer or a range of layers (e.g. 3 or 1-4)", range, item);
    const size_t dash = range.find('-');
    o.first = parse_layer(range.substr(0, dash), item, n_layers);
    o.last = dash == std::string::npos ? o.first : parse_layer(range.substr(dash + 1), item, n_layers);
    if (o.last < o.first) fail("--kv-layers: range '{}' is reversed", range);
    const size_t slash = types.find('/');
    o.k = parse_kv_dtype(types.substr(0, slash));
    o.v = slash == std::string::npos ? o.k : parse_kv_dtype(types.substr(slash + 1));
    out.push_back(o);
  }
  if (out.empty()) fail("--kv-layers: '{}' names no layers", spec);
  return out;
}

void apply_kv_layers(KvCacheOptions& options, const std::vector<KvLayerOverride>& overrides, int n_layers) {
  if (options.layers.empty()) options.layers.assign(size_t(n_layers), KvLayerCodecs{options.k, options.v});
  for (const auto& o : overrides)
    for (int l = o.first; l <= o.last; ++l) {
      options.layers[size_t(l)].k.retype(o.k);
      options.layers[size_t(l)].v.retype(o.v);
    }
}

std::vector<std::string> kv_preset_names() {
  return {"fp32", "fp16", "int8", "int4", "int4-small", "int2", "int2-small"};
}

void apply_kv_preset(KvCacheOptions& options, const std::string& name, bool keep_block_size) {
  options.layers.clear();
  const bool small = name == "int4-small" || name == "int2-small";
  if (name == "fp32" || name == "fp16") {
    options.set_dtype(parse_kv_dtype(name));
    options.residual = 0;
  } else if (name == "int8" || name == "int4" || name == "int2" || small) {
    // The layout that measured best at each width (BENCHMARKS.md, "Presets"):
    // keys per channel over a block (KIVI), values per token with one group
    // per head, recent tokens in FP16. Only INT2 needs keys stored before
    // RoPE (KVQuant) to stay usable; at 8 and 4 bits it gains little and
    // slows long-context decode (a query rotation per key). The -small
    // presets store each group's scale and min in 8 bits (kv/scale8.h): the
    // smallest layouts that met the quality targets (BENCHMARKS.md, "8-bit
    // scales").
    // 32-token blocks are part of these presets (library callers too): key
    // channel groups and per-block calls then serve 32 tokens, half the
    // metadata and fixed costs per token of 16, and INT4's keys take the
    // 8-bit query kernel. Against 16-token blocks, decode at 16K: int8
    // 0.97-1.00x -> 1.09-1.14x FP16, int4 1.16-1.28x -> 1.37-1.56x, int2 0.79x
    // -> 0.95-1.06x; bytes 5-15% fewer; ΔPPL within 0.16 points of a percent
    // (BENCHMARKS.md, "Integer presets in 32-token blocks").
    // The -small presets go to 64-token blocks and key groups, with two
    // blocks (128 tokens) in FP16: int4-small decodes at 16K at 1.68-1.72x
    // FP16 against 1.52-1.60x in 32-token blocks, in 3% fewer bytes, and its
    // TinyStories KL at ctx 512 falls (0.00127 -> 0.00097) because the larger
    // window hides the coarser key groups, which at an equal window cost
    // +45% KL (BENCHMARKS.md, "The small presets in 64-token blocks").
    if (!keep_block_size) options.block_size = small ? 64 : 32;
    const int bs = options.block_size;
    const KvDType t = parse_kv_dtype(name.substr(0, 4));
    options.k = {t, KvGrouping::Channel, 0, {}, {}};
    options.k.pre_rope = t == KvDType::INT2;
    // INT2's keys are rotated within 16-token spans (KvCodecConfig::rope_span):
    // one query rotation per span and the integer channel-major kernel,
    // instead of a float kernel that rotates every key. At 16K int2-small
    // decoded at 1.29-1.30x FP16 instead of 0.84-0.96x, int2 at 1.24-1.26x
    // instead of 0.85-0.92x, for TinyStories KL 0.0191 -> 0.0226 and 0.0246
    // -> 0.0328 (BENCHMARKS.md, "Keys rotated within 16-token spans").
    if (options.k.pre_rope && bs > 0) options.k.rope_span = std::gcd(16, bs);
    options.v = {t, KvGrouping::Token, 0, {}, {}};
    options.residual = (name == "int8" ? 1 : 2) * bs;
    if (small) {
      options.k.scale_bits = options.v.scale_bits = 8;
      options.residual = 128;  // two 64-token blocks; a multiple of any smaller block size given
      if (bs > 0 && options.residual % bs != 0) options.residual = bs;  // bs <= 0: KvCache refuses it
    }
  } else {
    fail("unknown --kv-preset '{}' (expected fp32, fp16, int8, int4, int4-small, int2 or int2-small)", name);
  }
}

}  // namespace kvserve
