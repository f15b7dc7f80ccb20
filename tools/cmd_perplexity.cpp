// kvserve perplexity: llama.cpp's perplexity protocol over a text file.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "engine/perplexity.h"
#include "tools/cli_common.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

struct PerplexityArgs {
  CommonOptions common;
  std::string file;
  PerplexityOptions ppl;
  bool kl_divergence = false;
  SparsityFlags sparsity;
};

void run(const PerplexityArgs& a) {
  auto model = load_model(a.common);
  const Tokenizer& tok = model->require_tokenizer();
  const std::vector<int32_t> tokens = tok.encode(read_text_file(a.file, "--file"), tok.add_bos_default());

  ThreadPool pool(thread_count(a.common));
  PerplexityOptions options = a.ppl;
  options.sparsity = sparsity_options(a.sparsity);
  if (a.ppl.ctx < 4 || a.ppl.ctx > model->config().seq_len)  // before it sizes the caches below
    fail("--ctx {} is out of range (4..{}, the model's context length)", a.ppl.ctx, model->config().seq_len);
  KvCacheOptions kv = kv_options(a.common, *model);
  fit_kv_to_sparsity(options.sparsity, kv);
  if (kv.num_blocks == 0 && kv.budget_bytes == 0) kv.num_blocks = (a.ppl.ctx + kv.block_size - 1) / kv.block_size;
  KvCache cache(model->config(), kv);
  Transformer transformer(*model, pool);
  const bool tty = isatty(fileno(stderr));
  auto progress = [&](int32_t done, int32_t total) {
    // A progress bar on stderr; one line per chunk when stderr is not a terminal would be noise.
    if (!tty && done != total) return;
    const int width = 40, filled = int(double(done) / total * width);
    std::fprintf(stderr, "\rperplexity [%s%s] %d/%d chunks", std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), done, total);
    if (done == total) std::fprintf(stderr, "\n");
  };
  std::unique_ptr<KvCache> reference;
  if (a.kl_divergence) {
    KvCacheOptions ref;
    ref.block_size = kv.block_size;
    ref.num_blocks = (a.ppl.ctx + kv.block_size - 1) / kv.block_size;
    reference = std::make_unique<KvCache>(model->config(), ref);  // FP32 K and V
  }
  PerplexityResult r = perplexity(transformer, cache, tokens, tok.add_bos_default() ? tok.bos_id() : -1, options, progress, reference.get());
  const SparsityOptions resolved = resolve_sparsity_options(options.sparsity, cache);

  nlohmann::json j = kv_stats_json(r.kv);
  j["ppl"] = r.ppl;
  j["nll_mean"] = r.nll_mean;
  j["tokens"] = r.tokens_scored;
  j["chunks"] = r.chunks;
  j["ctx"] = a.ppl.ctx;
  j["text_tokens"] = tokens.size();
  j["seconds"] = r.seconds;
  j["kv_dtype"] = kv_description(cache);
  j["streaming"] = options.streaming;
  j.update(sparsity_json(resolved, r.sparsity));
  j["kv_tokens_kept_mean"] = r.kv_tokens_kept_mean;
  j["kv_read_fraction"] = r.kv_read_fraction;
  if (r.has_reference) {
    j["kl_divergence"] = r.kl_divergence;
    j["top1_agreement"] = r.top1_agreement;
    j["reference_ppl"] = r.reference_ppl;
    j["delta_ppl_pct"] = (r.ppl / r.reference_ppl - 1.0) * 100.0;
  }
  if (a.common.json) {
    print_json(j);
    return;
  }
  std::printf("perplexity: %.4f over %lld tokens in %d chunks of %d (KV %s, %lld bytes/token), %.1f s\n", r.ppl,
              (long long)r.tokens_scored, r.chunks, a.ppl.ctx, kv_description(cache).c_str(),
              (long long)r.kv.bytes_per_token, r.seconds);
  if (options.streaming)
    std::printf("streaming, KV %s: %.1f tokens kept on average, %.3f of them read\n", describe(resolved).c_str(),
                r.kv_tokens_kept_mean, r.kv_read_fraction);
  if (r.has_reference)
    std::printf("against FP32 KV: ppl %.4f (%+.3f%%), KL %.6f, top-1 agreement %.4f\n", r.reference_ppl,
                (r.ppl / r.reference_ppl - 1.0) * 100.0, r.kl_divergence, r.top1_agreement);
}

}  // namespace

void register_perplexity(CLI::App& app) {
  auto a = std::make_shared<PerplexityArgs>();
  CLI::App* cmd = app.add_subcommand("perplexity", "perplexity of a text file (llama.cpp's protocol)");
  add_common_options(*cmd, a->common);
  cmd->add_option("--file", a->file, "text file")->required();
  cmd->add_option("--ctx", a->ppl.ctx, "tokens per chunk")->capture_default_str();
  cmd->add_option("--chunks", a->ppl.chunks, "chunks to score (-1 = all)")->capture_default_str();
  cmd->add_option("--batch", a->ppl.batch, "tokens per forward pass")->capture_default_str();
  cmd->add_flag("--kl-divergence", a->kl_divergence, "also run an FP32-KV pass; report KL divergence and top-1 agreement");
  cmd->add_flag("--streaming", a->ppl.streaming,
                "score token by token as generation runs (needed by every --kv-policy but full)");
  add_sparsity_options(*cmd, a->sparsity);
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
