// kvserve synth: writes a random-weight GGUF of a realistic shape.
#include <cctype>
#include <cstdio>

#include "model/synthetic_model.h"
#include "tools/cli_common.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

struct SynthArgs {
  std::string out;
  SyntheticModelOptions model;
  std::string weights = "q8_0";
  std::string rope_scaling = "none";
  float rope_scale = 1.0f;
  int32_t rope_original_context = 0;
};

constexpr GgmlType kWritable[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16,  GgmlType::F32,
                                   GgmlType::BF16, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                   GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                                   GgmlType::Q6_K};

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

void run(SynthArgs a) {
  std::string names;
  bool found = false;
  for (GgmlType t : kWritable) {
    const std::string name = lower(ggml_type_name(uint32_t(t)));
    names += (names.empty() ? "" : ", ") + name;
    if (lower(a.weights) == name) a.model.weights = t, found = true;
  }
  if (!found) fail("--weights must be one of {} (got '{}')", names, a.weights);
  RopeScaling& rs = a.model.rope_scaling;
  rs.factor = a.rope_scale;
  rs.original_context = a.rope_original_context;
  if (a.rope_scaling == "llama3") {  // Llama 3.1's factors: low_freq_factor 1, high_freq_factor 4
    const int32_t original = a.rope_original_context > 0 ? a.rope_original_context : a.model.seq_len;
    rs.freq_factors = llama3_freq_factors(a.model.dim / a.model.n_heads, 10000.0f, a.rope_scale, 1.0f, 4.0f, original);
    rs.factor = 1.0f;
    rs.original_context = 0;
  } else {
    rs.type = parse_rope_scaling_type(a.rope_scaling).value();
  }
  write_synthetic_gguf(a.out, a.model);
  std::fprintf(stderr, "kvserve: wrote %s\n", a.out.c_str());
}

}  // namespace

void register_synth(CLI::App& app) {
  auto a = std::make_shared<SynthArgs>();
  CLI::App* cmd = app.add_subcommand("synth", "write a random-weight GGUF (speed and memory work only)");
  cmd->add_option("--out", a->out, "output path")->required();
  cmd->add_option("--dim", a->model.dim, "embedding width")->capture_default_str();
  cmd->add_option("--layers", a->model.n_layers, "layers")->capture_default_str();
  cmd->add_option("--heads", a->model.n_heads, "query heads")->capture_default_str();
  cmd->add_option("--kv-heads", a->model.n_kv_heads, "key/value heads")->capture_default_str();
  cmd->add_option("--ffn", a->model.hidden_dim, "feed-forward width")->capture_default_str();
  cmd->add_option("--vocab", a->model.vocab_size, "vocabulary size")->capture_default_str();
  cmd->add_option("--ctx", a->model.seq_len, "context length")->capture_default_str();
  cmd->add_option("--weights", a->weights,
                  "q8_0 | q4_0 | f16 | f32, or a type kvserve converts at load: bf16 | q4_1 | q5_0 | q5_1 | q2_k | "
                  "q3_k | q4_k | q5_k | q6_k")
      ->capture_default_str();
  cmd->add_flag("--dequantized", a->model.write_dequantized,
                "write F32 matrices holding the values --weights decodes to (a reference for a converted load)");
  cmd->add_option("--seed", a->model.seed, "random seed")->capture_default_str();
  cmd->add_option("--rope-scaling", a->rope_scaling,
                  "RoPE scaling to write: none | linear | yarn (GGUF keys) | llama3 (Llama 3.1's rope_freqs.weight)")
      ->check(CLI::IsMember({"none", "linear", "yarn", "llama3"}))
      ->capture_default_str();
  cmd->add_option("--rope-scale", a->rope_scale, "the scaling's context factor")
      ->check(finite_in(0, 1e6, true))
      ->capture_default_str();
  cmd->add_option("--rope-orig-ctx", a->rope_original_context,
                  "the context before scaling (yarn, llama3; default: --ctx)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
