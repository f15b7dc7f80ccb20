// kvserve bench --attention-only / --dump-qk: the long-context attention
// benchmark of read-time sparsity (Quest top-k blocks, HNSW and IVF-PQ
// retrieval) against full attention, and the capture of real Q/K/V.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "tools/cli_common.h"

namespace kvserve::cli {

struct AttentionBenchArgs {
  bool attention_only = false;
  // Capture: run --model over --file and write the queries, keys and values.
  std::string dump_qk;
  std::string text_file;
  int64_t dump_max_tokens = 0;  // 0 = the whole text
  // Benchmark.
  std::string qk_file;                         // dump for the real and fit workloads
  std::string workloads = "real,fit,synthetic";
  std::string keys = "16384,65536,131072";     // context lengths, in keys
  std::string head_dims = "64,128";
  int group = 1;                               // query heads per KV head
  int queries = 24;                            // decode steps per configuration
  int recall_k = 32;
  int sinks = 16;                              // first keys always attended (retrieval and topk)
  int window = 64;                             // last keys always attended
  int block_size = 16;                         // Quest block, in tokens
  std::string topk_budgets = "1024,2048,4096,8192"; // tokens of blocks Quest reads
  std::string hnsw_ef = "32,64,128,256";       // ef_search; the search returns ef keys
  int hnsw_m = 16;
  int hnsw_ef_construction = 100;
  std::string ivf_nprobe = "8,32";
  std::string ivf_candidates = "256,1024";     // keys IVF-PQ returns for exact rescoring
  int ivf_nlist = 256;
  int64_t ivf_train_keys = 10240;             // >= 39 per PQ centroid, as faiss asks
  // Also measure the other MIPS formulations (inner-product metric; IVF
  // clusters trained on queries) at the smallest context and head dim of
  // each workload.
  bool compare_transforms = true;
  int64_t append_keys = 1024;                  // keys appended one at a time after the bulk build
  int64_t flush_mib = 256;                     // cache flush before each step (> the L3); 0 = warm caches
};

void add_attention_bench_options(CLI::App& cmd, AttentionBenchArgs& a);
void run_attention_bench(const AttentionBenchArgs& a, const CommonOptions& common);

}  // namespace kvserve::cli
