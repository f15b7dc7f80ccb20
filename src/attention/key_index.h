// An approximate-nearest-neighbour index over the keys of one (layer, KV
// head), searched with the current queries to find the keys with the largest
// q·k — the retrieval half of retrieval attention (the attention itself runs
// exactly over what is found: sparse_attention.h). Two back-ends from Debian,
// not hand-written: HNSW (hnswlib) and IVF-PQ (faiss).
//
// Queries are out of distribution for a key index: they live in a different
// region than the keys, and attention wants the largest inner product, not
// the nearest key. MipsTransform says how that is posed to the back-end:
// the back-end's own inner-product metric, or the MIPS-to-L2 reduction
// (keys get one more coordinate sqrt(M² − |k|²), queries a zero, so the
// nearest key in L2 is the one with the largest q·k). IVF-PQ can also fit its
// coarse clusters to a sample of queries (RetrievalAttention's idea) instead
// of the keys. docs/ARCHITECTURE.md and BENCHMARKS.md say which works.
//
// Batch-first, faiss style: every buffer is a span whose shape is stated, and
// a shape that does not fit (dim mismatch, k > size, an empty index) is a
// kvserve::Error naming it. Ids are the caller's (token positions): distinct
// and >= 0.
//
// Thread safety: search may run concurrently with other searches (the
// candidates count is then approximate: the back-ends' counters are shared);
// train_coarse, add and set_search_breadth need exclusive access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

enum class KeyIndexBackend : uint8_t { Hnsw, IvfPq };
enum class MipsTransform : uint8_t {
  InnerProduct,  // the back-end's inner-product metric, vectors as they are
  L2Augment,     // L2 over keys augmented with sqrt(M² − |k|²) and queries with 0
};

std::string_view key_index_backend_name(KeyIndexBackend b);  // "hnsw" | "ivfpq"
std::string_view mips_transform_name(MipsTransform t);       // "ip" | "l2aug"
// Parse the names above; throw kvserve::Error naming the valid ones otherwise.
KeyIndexBackend parse_key_index_backend(std::string_view name);
MipsTransform parse_mips_transform(std::string_view name);

struct HnswOptions {
  // L2Augment only: keys buffered (and scanned exactly by searches) before
  // the graph is built, so that M is fitted to a sample, not to one token.
  int64_t norm_keys = 256;
  int m = 16;                      // graph degree (hnswlib's M; the base layer keeps 2M)
  int ef_construction = 100;       // candidate list while inserting
  int ef_search = 64;              // candidate list while searching (raised to k when smaller)
  int64_t initial_capacity = 4096; // keys before the first resize; capacity doubles when full
  uint64_t seed = 100;             // level generator seed: builds are deterministic
};

struct IvfPqOptions {
  int nlist = 256;         // coarse clusters (inverted lists)
  int nprobe = 16;         // lists scanned per query
  int pq_sub_dim = 4;      // channels per product-quantizer sub-vector (the vector is zero-padded to a multiple)
  int pq_bits = 8;         // bits per sub-vector code
  int64_t train_keys = 10240;  // keys buffered before training (faiss wants >= 39 per centroid; searches scan
                               // the buffer exactly until then), then appended
  // Train the coarse clusters on the queries given to train_coarse instead
  // of the first keys (the product quantizer always trains on keys).
  bool coarse_from_queries = false;
  // OpenMP threads faiss may use inside train, add and search. 1 by default:
  // callers parallelise across heads with their own pool, and OpenMP's
  // spinning barriers collapse on oversubscribed cores (training measured
  // 25x slower with 2 threads on 2 busy cores).
  int threads = 1;
};

struct KeyIndexOptions {
  KeyIndexBackend backend = KeyIndexBackend::Hnsw;
  int dim = 64;                                   // channels per key and query (the head dim)
  MipsTransform transform = MipsTransform::L2Augment;
  // L2Augment: M = norm_margin × the largest norm among the keys the index
  // is built from (HNSW: the first norm_keys; IVF-PQ: the training keys).
  // Later keys longer than M get a zero extra coordinate, which ranks them
  // slightly too low.
  float norm_margin = 1.25f;
  HnswOptions hnsw;
  IvfPqOptions ivfpq;
};

// The answer to a batch of queries.
struct KeySearchResult {
  int64_t queries = 0;          // m
  int k = 0;
  std::vector<int64_t> ids;     // (m, k) key ids, best first
  std::vector<float> scores;    // (m, k) the back-end's estimate of q·k (approximate under PQ)
  int64_t candidates = 0;       // keys the back-end compared queries against, summed over the batch
                                // (HNSW: neighbours examined; IVF-PQ: codes scanned)
};

class KeyIndex {
 public:
  virtual ~KeyIndex() = default;

  const KeyIndexOptions& options() const { return options_; }
  int dim() const { return options_.dim; }
  // Keys added so far.
  int64_t size() const { return size_; }
  // Whether the back-end holds the keys. Until warmup_keys() have arrived
  // they wait in a buffer that searches scan exactly (a short sequence needs
  // no index; the back-ends need a sample to fit M or to train).
  bool built() const { return built_; }
  // Wall time spent in train_coarse and add so far, in seconds.
  double build_seconds() const { return build_seconds_; }
  // Bytes the index holds (vectors or codes, graph links or lists,
  // centroids, tables, the warm-up buffer).
  size_t memory_bytes() const;
  // e.g. "hnsw(M=16,efC=100,ef=64)/l2aug"
  virtual std::string describe() const = 0;

  // Fits coarse structure to a sample of queries (n, dim): IVF-PQ with
  // coarse_from_queries trains its clusters on them when it trains; HNSW
  // keeps nothing. Throws when the sample is not whole rows of dim.
  void train_coarse(std::span<const float> queries);
  // Appends keys (n, dim) floats with their ids (n). Amortized: HNSW grows
  // its capacity by doubling; IVF-PQ buffers until trained, then encodes.
  void add(std::span<const float> keys, std::span<const int64_t> ids);
  // The k keys with the largest q·k for each of the m queries (m, dim).
  // REQUIRES (else kvserve::Error): 1 <= k <= size(), whole rows of dim.
  void search(std::span<const float> queries, int k, KeySearchResult& out) const;
  [[nodiscard]] KeySearchResult search(std::span<const float> queries, int k) const;
  // The search breadth: HNSW's ef_search, IVF-PQ's nprobe. >= 1.
  void set_search_breadth(int breadth);

 protected:
  explicit KeyIndex(const KeyIndexOptions& options) : options_(options) {}

  // Keys to buffer before the first do_add (1: none).
  virtual int64_t warmup_keys() const = 0;
  virtual void do_train_coarse(std::span<const float> queries, int64_t n) = 0;
  // The first call gets at least warmup_keys() keys (the whole buffer).
  virtual void do_add(const float* keys, const int64_t* ids, int64_t n) = 0;
  // Fills out.ids, out.scores ((m, k) each, already sized) and out.candidates.
  virtual void do_search(const float* queries, int64_t m, int k, KeySearchResult& out) const = 0;
  virtual void do_set_search_breadth(int breadth) = 0;
  virtual size_t do_memory_bytes() const = 0;

  KeyIndexOptions options_;

 private:
  void search_buffer(const float* queries, int64_t m, int k, KeySearchResult& out) const;

  int64_t size_ = 0;
  double build_seconds_ = 0.0;
  bool built_ = false;
  std::vector<float> pending_;        // (n, dim) keys waiting for warmup_keys()
  std::vector<int64_t> pending_ids_;  // (n)
};

// Builds an empty index; throws kvserve::Error for invalid options (a
// non-positive size, pq_bits outside [1, 16], ...).
[[nodiscard]] std::unique_ptr<KeyIndex> make_key_index(const KeyIndexOptions& options);

// The MIPS-to-L2 reduction shared by the back-ends.
class MipsAugmenter {
 public:
  // out_dim >= dim + 1: keys and queries are written zero-padded to out_dim.
  MipsAugmenter(int dim, int out_dim) : dim_(dim), out_dim_(out_dim) {}
  bool ready() const { return max_norm_ > 0.0f; }
  float max_norm() const { return max_norm_; }
  // Fixes M from the keys (n, dim): margin × their largest norm.
  void fit(const float* keys, int64_t n, float margin);
  // out (n, out_dim) = [k, sqrt(max(M² − |k|², 0)), 0...]. REQUIRES: ready().
  void keys(const float* keys, int64_t n, float* out) const;
  // out (n, out_dim) = [q, 0, 0...].
  void queries(const float* queries, int64_t n, float* out) const;
  // q·k recovered from the squared L2 distance of the augmented vectors:
  // |q' − k'|² = |q|² + M² − 2 q·k.
  float inner_product(float l2_squared, float query_norm_squared) const {
    return 0.5f * (query_norm_squared + max_norm_ * max_norm_ - l2_squared);
  }

 private:
  int dim_, out_dim_;
  float max_norm_ = 0.0f;
};

}  // namespace kvserve
