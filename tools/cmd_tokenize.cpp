// kvserve tokenize: token ids of a file's text.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "model/gguf_reader.h"
#include "tools/cli_common.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

struct TokenizeArgs {
  CommonOptions common;
  std::string file;
  bool no_bos = false;
};

void run(const TokenizeArgs& a) {
  // A GGUF holding only a vocabulary is a valid --model here, so without
  // --tokenizer the vocabulary is read from the GGUF metadata alone.
  std::optional<Tokenizer> tok;
  if (a.common.tokenizer_path.empty()) {
    // A llama2.c checkpoint holds no vocabulary: say what to pass, not "bad magic".
    if (!has_gguf_magic(a.common.model_path))
      fail("{}: not a GGUF file, so no vocabulary inside (a llama2.c checkpoint's is a separate file); pass "
           "--tokenizer PATH",
           a.common.model_path);
    GgufFile file(a.common.model_path);
    if (!file.has("tokenizer.ggml.model")) fail("{}: no vocabulary inside; pass --tokenizer PATH", file.path());
    tok.emplace(load_gguf_vocab(file));
  } else {
    tok.emplace(load_model(a.common)->require_tokenizer().vocab());
  }
  const std::vector<int32_t> ids = tok->encode(read_text_file(a.file, "--file"), !a.no_bos && tok->add_bos_default());
  if (a.common.json) {
    print_json(nlohmann::json{{"tokens", ids}, {"count", ids.size()}});
    return;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %d" : "%d", ids[i]);
  std::printf("\n");
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "print the token ids of a file's text");
  add_common_options(*cmd, a->common);
  cmd->add_option("--file", a->file, "text file")->required();
  cmd->add_flag("--no-bos", a->no_bos, "do not prepend BOS (vocabularies with add_bos_token false never get one)");
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
