// kvserve generate: prints the prompt and its continuation, like llama2.c's run.
#include <cctype>
#include <cstdio>

#include "engine/generator.h"
#include "server/utf8_stream.h"
#include "tools/cli_common.h"

namespace kvserve::cli {
namespace {

struct GenerateArgs {
  CommonOptions common;
  std::string prompt;
  int32_t max_tokens = 256;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  bool ignore_eos = false;
  SparsityFlags sparsity;
};

// Prints generated text as it arrives. A character split over byte tokens
// is held until its last byte (llama2.c's safe_printf dropped each byte, so
// such characters vanished); a lone control byte that is not whitespace is
// skipped, as safe_printf does.
class TextPrinter {
 public:
  void piece(const std::string& piece) {
    if (piece.size() == 1 && static_cast<unsigned char>(piece[0]) < 0x80 &&
        !(std::isprint(static_cast<unsigned char>(piece[0])) || std::isspace(static_cast<unsigned char>(piece[0]))))
      return;
    write(utf8_.push(piece));
  }
  void finish() { write(utf8_.finish()); }

 private:
  static void write(const std::string& text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }
  Utf8Stream utf8_;
};

void run(const GenerateArgs& a) {
  auto model = load_model(a.common);
  const Tokenizer& tok = model->require_tokenizer();
  ThreadPool pool(thread_count(a.common));
  const SparsityOptions sparsity = sparsity_options(a.sparsity);
  KvCacheOptions kv = kv_options(a.common, *model);
  fit_kv_to_sparsity(sparsity, kv);
  KvCache cache(model->config(), kv);
  Transformer transformer(*model, pool);

  GenerateOptions g;
  g.sparsity = sparsity;
  g.stop_at_eos = !a.ignore_eos;
  if (g.stop_at_eos) g.stop_token_ids = tok.end_of_generation_ids();  // EOS and the end of a chat turn
  g.max_tokens = a.max_tokens;
  g.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  g.sampling.min_p = a.min_p;
  g.sampling.repetition_penalty = a.repetition_penalty;
  g.sampling.presence_penalty = a.presence_penalty;
  g.sampling.frequency_penalty = a.frequency_penalty;
  const std::vector<int32_t> prompt = tok.encode(a.prompt, tok.add_bos_default());
  std::string text;
  TextPrinter printer;
  auto on_token = [&](int32_t prev, int32_t token) {
    std::string piece = tok.decode_piece(prev, token);
    if (a.common.json) text += piece;
    else printer.piece(piece);
  };
  GenerateResult r = generate(transformer, cache, prompt, g, on_token, tok.bos_id(), tok.eos_id());
  if (!a.common.json) printer.finish();

  const KvStats& stats = r.kv_peak;
  // The first generated token comes from the prompt's pass: decode speed
  // counts the ones after it (none when the first one ended the text).
  const double decode_tok_s =
      r.decode_seconds > 0 && r.generated_tokens > 1 ? (r.generated_tokens - 1) / r.decode_seconds : 0;
  if (a.common.json) {
    nlohmann::json j = kv_stats_json(stats);
    j.update(sparsity_json(resolve_sparsity_options(sparsity, cache), r.sparsity));
    j["kv_tokens_kept_mean"] = r.kv_tokens_kept_mean;
    j["kv_bytes_used_peak"] = r.kv_bytes_used_peak;
    j["kv_bytes_used_history"] = r.kv_bytes_used;
    j["text"] = text;
    j["prompt_tokens"] = r.prompt_tokens;
    j["generated_tokens"] = r.generated_tokens;
    j["tokens"] = r.tokens;
    j["prefill_seconds"] = r.prefill_seconds;
    j["decode_tok_s"] = decode_tok_s;
    j["kv_dtype"] = kv_description(cache);
    print_json(j);
    return;
  }
  std::printf("\n");
  std::fprintf(stderr,
               "kvserve: %d prompt + %d generated tokens, decode %.1f tok/s | KV cache (%s): %lld tokens in "
               "%d blocks of %d, %lld bytes used (%lld bytes/token), %d of %d blocks free\n",
               r.prompt_tokens, r.generated_tokens, decode_tok_s, kv_description(cache).c_str(),
               (long long)stats.tokens_stored, stats.blocks_used, stats.block_size, (long long)stats.bytes_used,
               (long long)stats.bytes_per_token, stats.blocks_free, stats.blocks_total);
  if (sparsity.policy != "full")
    std::fprintf(stderr, "kvserve: %s: %lld tokens evicted, peak %lld bytes, read fraction %.3f\n",
                 describe(resolve_sparsity_options(sparsity, cache)).c_str(), (long long)r.sparsity.tokens_evicted,
                 (long long)r.kv_bytes_used_peak, r.sparsity.read_fraction());
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt");
  add_common_options(*cmd, args->common);
  cmd->add_option("--prompt", args->prompt, "prompt text (may be empty)");
  cmd->add_option("--max-tokens", args->max_tokens,
                  "positions to run, prompt included, as llama2.c's -n (0 = context length)")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "keep the k most likely tokens (0 = all)")->capture_default_str();
  cmd->add_option("--seed", args->seed, "random seed")->capture_default_str();
  cmd->add_option("--min-p", args->min_p, "drop tokens less likely than this fraction of the most likely (0 = off)")
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", args->repetition_penalty,
                  "divide the logits of tokens already in the text by this (multiply when negative; 1 = off)")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", args->presence_penalty,
                  "subtract from the logit of every token generated so far")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", args->frequency_penalty,
                  "subtract from a token's logit per time it was generated")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", args->ignore_eos,
                "keep generating when BOS, EOS or an end-of-turn token is sampled (length runs)");
  add_sparsity_options(*cmd, args->sparsity);
  cmd->callback([args] { run(*args); });
}

}  // namespace kvserve::cli
