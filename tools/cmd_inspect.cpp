// kvserve inspect: what a checkpoint holds and what its KV cache costs.
#include <cstdio>

#include "model/ggml_dequantize.h"
#include "tools/cli_common.h"

namespace kvserve::cli {
namespace {

void run(const CommonOptions& o) {
  auto model = load_model(o);
  const ModelConfig& c = model->config();
  KvCache cache(c, kv_options(o, *model));
  const KvStats kv = cache.stats();
  const Weights& w = model->weights();
  nlohmann::json j = {
      {"format", model->format() == CheckpointFormat::Gguf ? "gguf" : "llama2c"},
      {"architecture", c.architecture},
      {"dim", c.dim},
      {"hidden_dim", c.hidden_dim},
      {"n_layers", c.n_layers},
      {"n_heads", c.n_heads},
      {"n_kv_heads", c.n_kv_heads},
      {"head_dim", c.head_dim()},
      {"vocab_size", c.vocab_size},
      {"context_length", c.seq_len},
      {"trained_context_length", model->trained_context_length()},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", c.rope_scaling.describe()},
      {"norm_eps", c.norm_eps},
      {"weight_type", std::string(weight_type_name(w.layers.at(0).wq.type))},
      {"weight_bytes", w.bytes()},
      {"shared_classifier", w.classifier.data == w.token_embedding.data},
      {"has_tokenizer", model->tokenizer() != nullptr},
      {"kv_dtype", kv_description(cache)},
      {"kv_bytes_per_token", kv.bytes_per_token},
      // Whole blocks, as allocated: bytes_per_token is rounded down (int2-small: 127.5 B).
      {"kv_bytes_full_context", int64_t(cache.blocks_for(c.seq_len)) * kv.bytes_per_block},
  };
  // Tensors the file stores in a type kvserve converts at load: how many,
  // and which file type became which ({"Q4_K": "Q8_0", "Q6_K": "Q8_0"}).
  const std::vector<TensorConversion> conversions = model->conversions();
  if (!conversions.empty()) {
    nlohmann::json types = nlohmann::json::object();
    for (const TensorConversion& c : conversions) types[ggml_type_name(c.from)] = std::string(weight_type_name(c.to));
    j["converted_tensors"] = conversions.size();
    j["converted_types"] = types;
  }
  if (const RopeScaling& r = c.rope_scaling; r.scales()) {
    j["rope_scaling_type"] = rope_scaling_name(r.type);
    j["rope_scaling_factor"] = r.factor;
    if (r.type == RopeScalingType::Yarn) j["rope_original_context"] = r.original_context > 0 ? r.original_context : c.seq_len;
    j["rope_score_scale"] = rope_score_scale(r);
    j["rope_freq_factors"] = r.freq_factors.size();
  }
  if (o.json) {
    print_json(j);
    return;
  }
  for (auto& [key, value] : j.items()) std::printf("%-22s %s\n", key.c_str(), json_text(value).c_str());
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto o = std::make_shared<CommonOptions>();
  CLI::App* cmd = app.add_subcommand("inspect", "print a checkpoint's architecture, shapes and KV cost");
  add_common_options(*cmd, *o);
  cmd->callback([o] { run(*o); });
}

}  // namespace kvserve::cli
