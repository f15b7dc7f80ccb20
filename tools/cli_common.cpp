#include "tools/cli_common.h"

#include <cctype>

#include "util/error.h"

namespace kvserve::cli {

void add_common_options(CLI::App& cmd, CommonOptions& o, bool model_required) {
  auto* m = cmd.add_option("--model", o.model_path, "checkpoint: GGUF or llama2.c .bin");
  if (model_required) m->required();
  cmd.add_option("--tokenizer", o.tokenizer_path, "tokenizer: llama2.c tokenizer .bin or GGUF (default: from the model)");
  cmd.add_option("--kv-dtype", o.kv_dtype, "KV cache storage: fp32 | fp16")->capture_default_str();
  cmd.add_option("--block-size", o.block_size, "KV block size in tokens")->capture_default_str();
  cmd.add_option("--kv-blocks", o.kv_blocks, "KV cache capacity in blocks (default: one full context)");
  cmd.add_option("--kv-memory", o.kv_memory, "KV cache capacity in bytes, e.g. 512MiB (instead of --kv-blocks)");
  cmd.add_option("--threads", o.threads, "threads (default: all cores)");
  cmd.add_flag("--json", o.json, "print one JSON object on stdout");
}

int64_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) fail("'{}' is not a size (expected e.g. 4096, 512MiB, 2GiB)", text);
  double value = std::stod(text.substr(0, i));
  std::string unit = text.substr(i);
  double mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KiB" || unit == "K") mult = 1024.0;
  else if (unit == "MiB" || unit == "M") mult = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G") mult = 1024.0 * 1024 * 1024;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else fail("unknown size unit '{}' in '{}' (use B, KiB, MiB, GiB, KB, MB, GB)", unit, text);
  return int64_t(value * mult);
}

KvCacheOptions kv_options(const CommonOptions& o) {
  KvCacheOptions k;
  k.block_size = o.block_size;
  k.dtype = parse_kv_dtype(o.kv_dtype);
  if (o.kv_blocks < 0) fail("--kv-blocks must be positive (got {})", o.kv_blocks);
  k.num_blocks = o.kv_blocks;
  if (!o.kv_memory.empty()) k.budget_bytes = parse_bytes(o.kv_memory);
  return k;
}

int thread_count(const CommonOptions& o) {
  if (o.threads < 0) fail("--threads must be >= 0 (got {})", o.threads);
  return o.threads == 0 ? default_thread_count() : o.threads;
}

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
  };
}

}  // namespace kvserve::cli
