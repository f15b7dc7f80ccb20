// kvserve bench --attention-only: one decode step of one (layer, KV head) at
// long context, full attention against read-time sparsity, on real,
// Gaussian-fitted and synthetic keys (attention_workload.h). Every method ends
// in the same exact attention kernel (attend_ranges) over the keys it chose,
// so time differences are the keys read plus the cost of choosing them.
// Caches are flushed before every step: in a real decode step the other
// layers' KV has evicted this head's keys, values, summaries and index.
// Single-threaded: a decode step parallelises across heads. Times are wall
// clock and the thread's CPU time (which a busy, shared machine inflates less:
// time descheduled does not count, time stalled on memory does).
#include "tools/cmd_bench_attention.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>

#include "attention/attention_workload.h"
#include "attention/block_summary.h"
#include "attention/key_index.h"
#include "attention/qk_dump.h"
#include "attention/retrieval_metrics.h"
#include "attention/sparse_attention.h"
#include "engine/qk_capture.h"
#include "engine/transformer.h"
#include "util/aligned_buffer.h"
#include "util/error.h"
#include "util/timer.h"

namespace kvserve::cli {
namespace {

std::vector<int64_t> parse_list(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 1) fail("{}: '{}' is not a positive integer (expected e.g. 64,128)", flag, item);
    out.push_back(v);
  }
  if (out.empty()) fail("{} needs at least one value", flag);
  return out;
}

std::vector<std::string> parse_names(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item != "real" && item != "fit" && item != "synthetic")
      fail("--workloads: unknown workload '{}' (expected real, fit, synthetic)", item);
    out.push_back(item);
  }
  return out;
}

// Reads a buffer larger than the last-level cache, so the next step finds
// nothing of its data cached. Reads only: dirty lines would cost the next
// step write-backs.
class CacheFlusher {
 public:
  explicit CacheFlusher(int64_t mib) : buffer_(size_t(mib) << 18) {}  // mib MiB of floats
  void flush() {
    float sum = 0.0f;
    for (size_t i = 0; i < buffer_.size(); i += 16) sum += buffer_[i];  // one load per 64-byte line
    sink_ = sum;
  }

 private:
  AlignedBuffer<float> buffer_;
  volatile float sink_ = 0.0f;
};

// What a method chose for one decode step.
struct Selection {
  std::vector<KeyRange> ranges;       // keys attended exactly
  int64_t scanned = 0;                // key-equivalents the choice itself read (summaries, index candidates)
  std::vector<int64_t> index_top;     // (group, k) the index's own top-k, when it has one
};

// Full attention's answer for every step.
struct Reference {
  std::vector<std::vector<int64_t>> top;  // (queries * group) exact top-k ids
  std::vector<float> out;                 // (queries, group, head_dim)
  double step_us = 0.0;                   // median full-attention step (the full row's own run)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

class Bench {
 public:
  Bench(const AttentionBenchArgs& a, const AttentionWorkload& w) : a_(a), w_(w) {
    if (a.flush_mib > 0) flusher_ = std::make_unique<CacheFlusher>(a.flush_mib);
  }

  // Runs full attention for every step; the rows that follow compare to it.
  nlohmann::json run_full() {
    const WorkloadShape& s = w_.shape;
    ref_.out.resize(size_t(s.n_queries) * s.group * s.head_dim);
    for (int i = 0; i < s.n_queries; ++i)
      for (int g = 0; g < s.group; ++g)
        ref_.top.push_back(exact_top_k(w_.keys.data(), s.n_keys, s.head_dim, w_.query(i) + size_t(g) * s.head_dim,
                                       a_.recall_k));
    std::vector<double> times, cpu_times;
    const std::vector<KeyRange> all{{0, s.n_keys}};
    for (int i = 0; i < s.n_queries; ++i) {
      flush();
      Timer t;
      ThreadCpuTimer cpu;
      attend_ranges(w_.kv(), w_.query(i), s.group, w_.scale, all, ref_.out.data() + size_t(i) * s.group * s.head_dim,
                    scratch_);
      times.push_back(t.seconds() * 1e6);
      cpu_times.push_back(cpu.seconds() * 1e6);
    }
    ref_.step_us = median(times);
    nlohmann::json row = base_row("full", "full");
    row["step_us"] = ref_.step_us;
    row["attend_us"] = ref_.step_us;
    row["select_us"] = 0.0;
    row["recall_at_k"] = 1.0;
    row["keys_scored_fraction"] = 1.0;
    row["full_step_us"] = ref_.step_us;
    row["speedup_vs_full"] = 1.0;
    row["step_cpu_us"] = median(cpu_times);
    row["full_step_cpu_us"] = median(cpu_times);
    row["speedup_vs_full_cpu"] = 1.0;
    row["output_rel_error_mean"] = 0.0;
    row["output_rel_error_max"] = 0.0;
    return row;
  }

  // One sparse method: select(i, selection) chooses step i's keys (timed with the attention).
  template <class Select>
  nlohmann::json run(const std::string& method, const std::string& config, Select&& select) {
    const WorkloadShape& s = w_.shape;
    std::vector<double> full, step, sel, att, rec, irec, err, scored, scanned, full_cpu, step_cpu;
    std::vector<float> out(size_t(s.group) * s.head_dim);
    const std::vector<KeyRange> all{{0, s.n_keys}};
    Selection choice;
    for (int i = 0; i < s.n_queries; ++i) {
      // Full attention right before each step: on a shared machine the load
      // drifts, and paired steps keep the speedup a ratio of like with like.
      flush();
      Timer t;
      ThreadCpuTimer cpu;
      attend_ranges(w_.kv(), w_.query(i), s.group, w_.scale, all, out.data(), scratch_);
      full.push_back(t.seconds() * 1e6);
      full_cpu.push_back(cpu.seconds() * 1e6);
      choice.index_top.clear();
      flush();
      t.reset();
      cpu.reset();
      select(i, choice);
      const double t_select = t.seconds() * 1e6;
      attend_ranges(w_.kv(), w_.query(i), s.group, w_.scale, choice.ranges, out.data(), scratch_);
      const double t_step = t.seconds() * 1e6;
      step_cpu.push_back(cpu.seconds() * 1e6);
      step.push_back(t_step);
      sel.push_back(t_select);
      att.push_back(t_step - t_select);
      for (int g = 0; g < s.group; ++g) {
        const auto& exact = ref_.top[size_t(i) * s.group + size_t(g)];
        rec.push_back(recall(exact, choice.ranges));
        if (!choice.index_top.empty())
          irec.push_back(recall(exact, std::span<const int64_t>(choice.index_top.data() + size_t(g) * a_.recall_k,
                                                                 size_t(a_.recall_k))));
      }
      err.push_back(relative_error(out.data(), ref_.out.data() + size_t(i) * s.group * s.head_dim, out.size()));
      scored.push_back(double(ranges_size(choice.ranges)) / double(s.n_keys));
      scanned.push_back(double(choice.scanned) / double(s.n_keys));
    }
    nlohmann::json row = base_row(method, config);
    row["step_us"] = median(step);
    row["select_us"] = median(sel);
    row["attend_us"] = median(att);
    row["full_step_us"] = median(full);
    row["speedup_vs_full"] = median(full) / median(step);
    row["step_cpu_us"] = median(step_cpu);
    row["full_step_cpu_us"] = median(full_cpu);
    row["speedup_vs_full_cpu"] = median(full_cpu) / median(step_cpu);
    row["recall_at_k"] = mean(rec);
    if (!irec.empty()) row["index_recall_at_k"] = mean(irec);
    row["output_rel_error_mean"] = mean(err);
    row["output_rel_error_max"] = *std::max_element(err.begin(), err.end());
    row["keys_scored_fraction"] = mean(scored);
    row["index_scanned_fraction"] = mean(scanned);
    return row;
  }

 private:
  void flush() {
    if (flusher_) flusher_->flush();
  }

  nlohmann::json base_row(const std::string& method, const std::string& config) const {
    const WorkloadShape& s = w_.shape;
    return {{"workload", w_.kind}, {"n_keys", s.n_keys},   {"head_dim", s.head_dim}, {"group", s.group},
            {"queries", s.n_queries}, {"k", a_.recall_k}, {"method", method},        {"config", config},
            {"kv_bytes", int64_t(2 * s.n_keys * s.head_dim * int64_t(sizeof(float)))}};
  }

  const AttentionBenchArgs& a_;
  const AttentionWorkload& w_;
  std::unique_ptr<CacheFlusher> flusher_;
  SparseAttentionScratch scratch_;
  Reference ref_;
};

// Builds the index over all keys the way a sequence grows: one bulk add (the
// prompt) and then append_keys single-key appends (decode steps), timed apart.
struct BuiltIndex {
  std::unique_ptr<KeyIndex> index;
  double bulk_s = 0.0;
  double append_us_per_key = 0.0;
};

BuiltIndex build_index(const KeyIndexOptions& o, const AttentionWorkload& w, int64_t append_keys) {
  const int64_t n = w.shape.n_keys, d = w.shape.head_dim;
  const int64_t bulk = std::max<int64_t>(1, n - std::min(append_keys, n / 2));
  BuiltIndex b;
  KeyIndexOptions options = o;
  // IVF-PQ trains on the prompt (at most train_keys of it), never mid-decode.
  options.ivfpq.train_keys = std::min(o.ivfpq.train_keys, bulk);
  b.index = make_key_index(options);
  if (o.ivfpq.coarse_from_queries && o.backend == KeyIndexBackend::IvfPq) b.index->train_coarse(w.prompt_queries);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  Timer t;
  b.index->add(std::span<const float>(w.keys.data(), size_t(bulk * d)), std::span<const int64_t>(ids.data(), size_t(bulk)));
  b.bulk_s = t.seconds();
  t.reset();
  for (int64_t i = bulk; i < n; ++i)
    b.index->add(std::span<const float>(w.keys.data() + size_t(i * d), size_t(d)), std::span<const int64_t>(&ids[size_t(i)], 1));
  b.append_us_per_key = n > bulk ? t.seconds() * 1e6 / double(n - bulk) : 0.0;
  return b;
}

// Retrieval: each query head of the group asks the index for `candidates`
// keys; their union plus sinks and window is attended exactly.
nlohmann::json run_index(Bench& bench, const AttentionBenchArgs& a, const AttentionWorkload& w, KeyIndex& index,
                         int candidates) {
  const WorkloadShape& s = w.shape;
  const int k = std::min<int64_t>(candidates, index.size());
  KeySearchResult found;
  nlohmann::json row = bench.run(std::string(key_index_backend_name(index.options().backend)), index.describe(),
                                 [&](int i, Selection& c) {
    index.search(std::span<const float>(w.query(i), size_t(s.group) * s.head_dim), k, found);
    c.ranges = retrieval_ranges(found.ids, s.n_keys, a.sinks, a.window);
    c.scanned = found.candidates / s.group;
    for (int g = 0; g < s.group; ++g)
      c.index_top.insert(c.index_top.end(), found.ids.begin() + size_t(g) * k,
                         found.ids.begin() + size_t(g) * k + std::min(k, a.recall_k));
  });
  row["candidates"] = k;
  row["transform"] = std::string(mips_transform_name(index.options().transform));
  row["index_bytes"] = index.memory_bytes();
  return row;
}

// One line per row: on stdout, or on stderr as progress when stdout is JSON.
void print_row(const nlohmann::json& r, bool json) {
  FILE* f = json ? stderr : stdout;
  std::fprintf(f, "%-9s %7lld d%-3d %-6s %-58s step %9.1f us (select %8.1f) x%6.2f (cpu x%6.2f) | recall@%d %.3f",
              r["workload"].get<std::string>().c_str(), (long long)r["n_keys"].get<int64_t>(), r["head_dim"].get<int>(),
              r["method"].get<std::string>().c_str(), r["config"].get<std::string>().c_str(), r["step_us"].get<double>(),
              r["select_us"].get<double>(), r["speedup_vs_full"].get<double>(), r["speedup_vs_full_cpu"].get<double>(),
              r["k"].get<int>(),
              r["recall_at_k"].get<double>());
  if (r.contains("index_recall_at_k")) std::fprintf(f, " (index %.3f)", r["index_recall_at_k"].get<double>());
  std::fprintf(f, " | err %.2e | scored %.4f", r["output_rel_error_mean"].get<double>(), r["keys_scored_fraction"].get<double>());
  if (r.contains("index_scanned_fraction")) std::fprintf(f, " scanned %.4f", r["index_scanned_fraction"].get<double>());
  if (r.contains("build_s")) std::fprintf(f, " | build %.2f s, append %.1f us/key", r["build_s"].get<double>(),
                                         r["append_us_per_key"].get<double>());
  std::fprintf(f, "\n");
  std::fflush(f);
}

QkDump capture(const AttentionBenchArgs& a, const CommonOptions& common) {
  if (common.model_path.empty() || a.text_file.empty()) fail("--dump-qk needs --model and --file");
  auto model = load_model(common);
  const Tokenizer& tok = model->require_tokenizer();
  const std::vector<int32_t> tokens = tok.encode(read_text_file(a.text_file, "--file"), tok.add_bos_default());
  ThreadPool pool(thread_count(common));
  KvCacheOptions kv = kv_options(common, *model);
  if (kv.num_blocks == 0 && kv.budget_bytes == 0) kv.num_blocks = (model->config().seq_len + kv.block_size - 1) / kv.block_size;
  KvCache cache(model->config(), kv);
  Transformer transformer(*model, pool);
  QkCaptureOptions o;
  o.max_tokens = a.dump_max_tokens;
  return capture_qk(transformer, cache, tokens, tok.bos_id(), o);
}

}  // namespace

void add_attention_bench_options(CLI::App& cmd, AttentionBenchArgs& a) {
  cmd.add_flag("--attention-only", a.attention_only,
               "long-context attention benchmark of topk and ann against full attention (no model needed)");
  cmd.add_option("--dump-qk", a.dump_qk, "capture the model's post-RoPE Q, K, V over --file into this file");
  cmd.add_option("--file", a.text_file, "--dump-qk: text to run");
  cmd.add_option("--dump-max-tokens", a.dump_max_tokens, "--dump-qk: stop after this many tokens (0 = all)");
  cmd.add_option("--qk-file", a.qk_file, "dump read for the real and fit workloads (default: --dump-qk's)");
  cmd.add_option("--workloads", a.workloads, "comma list of real, fit, synthetic")->capture_default_str();
  cmd.add_option("--keys", a.keys, "context lengths in keys, comma list")->capture_default_str();
  cmd.add_option("--head-dims", a.head_dims, "head dims, comma list")->capture_default_str();
  cmd.add_option("--group", a.group, "query heads per KV head")->capture_default_str();
  cmd.add_option("--queries", a.queries, "decode steps per configuration")->capture_default_str();
  cmd.add_option("--recall-k", a.recall_k, "k of recall@k")->capture_default_str();
  cmd.add_option("--sinks", a.sinks, "first keys always attended")->capture_default_str();
  cmd.add_option("--window", a.window, "last keys always attended")->capture_default_str();
  cmd.add_option("--topk-block", a.block_size, "Quest block size in tokens")->capture_default_str();
  cmd.add_option("--topk-budgets", a.topk_budgets, "tokens of blocks Quest reads, comma list")->capture_default_str();
  cmd.add_option("--hnsw-ef", a.hnsw_ef, "HNSW ef_search values (keys returned), comma list")->capture_default_str();
  cmd.add_option("--hnsw-m", a.hnsw_m, "HNSW graph degree M")->capture_default_str();
  cmd.add_option("--hnsw-ef-construction", a.hnsw_ef_construction, "HNSW build breadth")->capture_default_str();
  cmd.add_option("--ivf-nprobe", a.ivf_nprobe, "IVF-PQ lists probed, comma list")->capture_default_str();
  cmd.add_option("--ivf-candidates", a.ivf_candidates, "keys IVF-PQ returns for exact rescoring, comma list")
      ->capture_default_str();
  cmd.add_option("--ivf-nlist", a.ivf_nlist, "IVF-PQ lists")->capture_default_str();
  cmd.add_option("--ivf-train-keys", a.ivf_train_keys, "IVF-PQ trains on the first this many keys")->capture_default_str();
  cmd.add_option("--compare-transforms", a.compare_transforms,
                 "also measure inner-product search and query-trained IVF clusters at the smallest context and head dim")
      ->capture_default_str();
  cmd.add_option("--append-keys", a.append_keys, "keys appended one at a time after the bulk build")->capture_default_str();
  cmd.add_option("--flush-mib", a.flush_mib, "cache flush before each step, in MiB (0 = warm caches)")->capture_default_str();
}

void run_attention_bench(const AttentionBenchArgs& a, const CommonOptions& common) {
  QkDump dump;
  bool have_dump = false;
  if (!a.dump_qk.empty()) {
    dump = capture(a, common);
    write_qk_dump(a.dump_qk, dump);
    have_dump = true;
    nlohmann::json j = {{"dump_qk", a.dump_qk},     {"tokens", dump.n_tokens},     {"chunk", dump.chunk},
                        {"n_layers", dump.n_layers}, {"n_heads", dump.n_heads},     {"n_kv_heads", dump.n_kv_heads},
                        {"head_dim", dump.head_dim}};
    if (common.json && !a.attention_only) print_json(j);
    else std::fprintf(stderr, "wrote %s: %lld tokens of %d layers x %d/%d heads x %d dims\n", a.dump_qk.c_str(),
                      (long long)dump.n_tokens, dump.n_layers, dump.n_heads, dump.n_kv_heads, dump.head_dim);
    if (!a.attention_only) return;
  }
  const std::vector<std::string> kinds = parse_names(a.workloads);
  const std::vector<int64_t> sizes = parse_list(a.keys, "--keys"), dims = parse_list(a.head_dims, "--head-dims");
  const std::vector<int64_t> budgets = parse_list(a.topk_budgets, "--topk-budgets");
  const std::vector<int64_t> efs = parse_list(a.hnsw_ef, "--hnsw-ef"), nprobes = parse_list(a.ivf_nprobe, "--ivf-nprobe");
  const std::vector<int64_t> candidates = parse_list(a.ivf_candidates, "--ivf-candidates");
  if (a.group < 1 || a.queries < 1 || a.recall_k < 1 || a.sinks < 0 || a.window < 0 || a.block_size < 1)
    fail("--group, --queries, --recall-k, --topk-block must be positive and --sinks, --window >= 0");
  const bool needs_dump = std::any_of(kinds.begin(), kinds.end(), [](const std::string& k) { return k != "synthetic"; });
  if (needs_dump && !have_dump) {
    if (a.qk_file.empty()) fail("the real and fit workloads need --qk-file (or --dump-qk); use --workloads synthetic without one");
    dump = read_qk_dump(a.qk_file);
  }

  nlohmann::json rows = nlohmann::json::array();
  auto emit = [&](nlohmann::json row) {
    print_row(row, common.json);
    rows.push_back(std::move(row));
  };
  const int64_t smallest = *std::min_element(sizes.begin(), sizes.end());
  const int64_t smallest_dim = *std::min_element(dims.begin(), dims.end());
  for (const std::string& kind : kinds)
    for (int64_t d : dims)
      for (int64_t n : sizes) {
        WorkloadShape shape{n, int(d), a.group, a.queries, 1};
        AttentionWorkload w;
        try {
          w = kind == "real" ? workload_from_dump(dump, shape)
              : kind == "fit" ? workload_gaussian_fit(dump, shape)
                              : workload_synthetic(shape);
        } catch (const Error& e) {
          // A dump too short for this context: say so and go on with the rest.
          rows.push_back({{"workload", kind}, {"n_keys", n}, {"head_dim", d}, {"skipped", e.what()}});
          std::fprintf(common.json ? stderr : stdout, "%-9s %7lld d%-3lld skipped: %s\n", kind.c_str(), (long long)n,
                       (long long)d, e.what());
          continue;
        }
        Bench bench(a, w);
        emit(bench.run_full());

        // topk (Quest): summaries of every block, then the best blocks per step.
        BlockSummary summary({a.block_size, 1, int(d)});
        Timer t;
        const int64_t bulk = std::max<int64_t>(1, n - std::min(a.append_keys, n / 2));
        summary.append(std::span<const float>(w.keys.data(), size_t(bulk * d)));
        const double summary_s = t.seconds();
        t.reset();
        for (int64_t i = bulk; i < n; ++i) summary.append(std::span<const float>(w.keys.data() + size_t(i * d), size_t(d)));
        const double summary_append_us = n > bulk ? t.seconds() * 1e6 / double(n - bulk) : 0.0;
        std::vector<int32_t> blocks;
        std::vector<float> bounds;
        for (GroupCombine combine : {GroupCombine::Max, GroupCombine::Sum}) {
          if (combine == GroupCombine::Sum && a.group == 1) continue;  // the same choice with one query head
          for (int64_t budget : budgets) {
            const int k_blocks = int(std::max<int64_t>(1, budget / a.block_size));
            const std::string config = fmt::format("quest(block={},blocks={},{})", a.block_size, k_blocks,
                                                   combine == GroupCombine::Max ? "max" : "sum");
            nlohmann::json row = bench.run("topk", config, [&](int i, Selection& c) {
              summary.select(0, w.query(i), a.group, k_blocks, combine, blocks, bounds);
              c.ranges = block_ranges(blocks, a.block_size, n, a.sinks, a.window);
              c.scanned = 2 * summary.num_blocks();  // a min and a max row per block
            });
            row["budget_tokens"] = budget;
            row["build_s"] = summary_s;
            row["append_us_per_key"] = summary_append_us;
            row["index_bytes"] = summary.memory_bytes();
            emit(std::move(row));
          }
        }

        // ann: HNSW and IVF-PQ over the keys.
        std::vector<std::pair<MipsTransform, bool>> variants{{MipsTransform::L2Augment, false}};
        if (a.compare_transforms && n == smallest && d == smallest_dim) {
          variants.push_back({MipsTransform::InnerProduct, false});
          variants.push_back({MipsTransform::L2Augment, true});  // IVF clusters from queries
        }
        for (const auto& [transform, from_queries] : variants) {
          if (!from_queries) {
            KeyIndexOptions o;
            o.backend = KeyIndexBackend::Hnsw;
            o.dim = int(d);
            o.transform = transform;
            o.hnsw.m = a.hnsw_m;
            o.hnsw.ef_construction = a.hnsw_ef_construction;
            BuiltIndex b = build_index(o, w, a.append_keys);
            for (int64_t ef : efs) {
              b.index->set_search_breadth(int(ef));
              nlohmann::json row = run_index(bench, a, w, *b.index, int(ef));
              row["build_s"] = b.bulk_s;
              row["append_us_per_key"] = b.append_us_per_key;
              emit(std::move(row));
            }
          }
          KeyIndexOptions o;
          o.backend = KeyIndexBackend::IvfPq;
          o.dim = int(d);
          o.transform = transform;
          o.ivfpq.nlist = a.ivf_nlist;
          o.ivfpq.train_keys = a.ivf_train_keys;
          o.ivfpq.coarse_from_queries = from_queries;
          BuiltIndex b = build_index(o, w, a.append_keys);
          for (int64_t nprobe : nprobes)
            for (int64_t c : candidates) {
              b.index->set_search_breadth(int(nprobe));
              nlohmann::json row = run_index(bench, a, w, *b.index, int(c));
              row["build_s"] = b.bulk_s;
              row["append_us_per_key"] = b.append_us_per_key;
              emit(std::move(row));
            }
        }
      }
  if (common.json) {
    nlohmann::json j = {{"attention_bench", {{"flush_mib", a.flush_mib}, {"sinks", a.sinks}, {"window", a.window},
                                             {"threads", 1}, {"qk_file", have_dump ? a.dump_qk : a.qk_file}}},
                        {"rows", rows}};
    print_json(j);
  }
}

}  // namespace kvserve::cli
