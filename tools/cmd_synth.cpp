// kvserve synth: writes a random-weight GGUF of a realistic shape.
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
};

void run(SynthArgs a) {
  if (a.weights == "q8_0") a.model.weights = WeightType::Q8_0;
  else if (a.weights == "q4_0") a.model.weights = WeightType::Q4_0;
  else if (a.weights == "f16") a.model.weights = WeightType::F16;
  else if (a.weights == "f32") a.model.weights = WeightType::F32;
  else fail("--weights must be one of q8_0, q4_0, f16, f32 (got '{}')", a.weights);
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
  cmd->add_option("--weights", a->weights, "q8_0 | q4_0 | f16 | f32")->capture_default_str();
  cmd->add_option("--seed", a->model.seed, "random seed")->capture_default_str();
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
