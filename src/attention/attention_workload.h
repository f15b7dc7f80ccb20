// Long-context attention problems for one (layer, KV head) — keys, values and
// decode queries that attend to all of them — at head dims and lengths the
// captured model (stories260K: head dim 8, context 512) does not have. Three
// kinds, each saying what it represents:
//   real       the dump's real heads concatenated: channel block j of a key
//              is the key of (layer, KV head) pair j for the same token, of a
//              query the matching query head's query; q·k is the sum of the
//              real heads' scores. Tokens are the text's chunks laid end to
//              end (each chunk's BOS after the first dropped: its key is the
//              same in every chunk), and every key and query is re-rotated
//              from its chunk position to its position in this long sequence
//              (RoPE rotations compose), so offsets are those of one long
//              context. Queries are the tokens right after the keys: their
//              own chunk's start is the last keys, at the offsets the model
//              computed; the older chunks are real text the model never saw
//              together, at offsets beyond its 512-token training.
//   fit        iid Gaussian samples with the real keys', values' and queries'
//              mean and full covariance (outlier channels and the query/key
//              offset kept; token-to-token and cluster structure lost).
//   synthetic  no model: keys from topic segments (runs of tokens around one
//              of many random centres) plus a shared large offset on a few
//              outlier channels, a high-norm sink key, and queries that aim
//              at the topic of a random earlier segment from a different
//              mean: sharp, retrieval-friendly attention.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/qk_dump.h"
#include "attention/sparse_attention.h"

namespace kvserve {

struct WorkloadShape {
  int64_t n_keys = 16384;  // keys every query attends to, in tokens
  int head_dim = 64;
  int group = 1;           // query heads per KV head (GQA)
  int n_queries = 32;      // decode steps to evaluate
  uint64_t seed = 1;
};

struct AttentionWorkload {
  std::string kind;            // "real" | "fit" | "synthetic"
  WorkloadShape shape;
  std::vector<float> keys;     // (n_keys, head_dim)
  std::vector<float> values;   // (n_keys, head_dim)
  std::vector<float> queries;  // (n_queries, group, head_dim)
  // Queries seen while the keys were written (the prompt's), one query head
  // each: what an index may fit itself to (KeyIndex::train_coarse).
  std::vector<float> prompt_queries;  // (min(n_keys, kPromptQueries), head_dim)
  float scale = 0.0f;          // 1 / sqrt(head_dim)

  static constexpr int64_t kPromptQueries = 8192;

  HeadKv kv() const { return {keys.data(), values.data(), shape.n_keys, shape.head_dim}; }
  // The group's queries of decode step i: (group, head_dim) floats.
  const float* query(int i) const {
    return queries.data() + size_t(i) * size_t(shape.group) * size_t(shape.head_dim);
  }
};

// "real": the last head_dim / dump.head_dim (layer, KV head) pairs of the dump,
// concatenated and re-rotated; keys and values from the first n_keys tokens
// (BOS copies dropped), queries from the n_queries tokens after them. Throws kvserve::Error when head_dim is not a
// multiple of the dump's, needs more pairs than it has, group exceeds its GQA
// group, or it holds fewer than n_keys + n_queries tokens.
[[nodiscard]] AttentionWorkload workload_from_dump(const QkDump& dump, const WorkloadShape& shape);
// "fit": Gaussian samples matching the mean and covariance of every token of
// the "real" concatenation at its chunk position (the group's queries
// jointly). Same requirements,
// except the dump needs only 2 * head_dim tokens.
[[nodiscard]] AttentionWorkload workload_gaussian_fit(const QkDump& dump, const WorkloadShape& shape);
// "synthetic".
[[nodiscard]] AttentionWorkload workload_synthetic(const WorkloadShape& shape);

}  // namespace kvserve
