#include "attention/attention_workload.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {
namespace {

void check_shape(const WorkloadShape& s) {
  if (s.n_keys < 1 || s.head_dim < 1 || s.group < 1 || s.n_queries < 1)
    fail("workload: n_keys ({}), head_dim ({}), group ({}) and n_queries ({}) must be positive", s.n_keys,
         s.head_dim, s.group, s.n_queries);
}

// The (layer, KV head) pairs whose heads are concatenated: the last ones in
// (layer, head) order, since deeper layers attend more selectively.
std::vector<std::pair<int, int>> concat_pairs(const QkDump& d, const WorkloadShape& s) {
  if (s.head_dim % d.head_dim != 0)
    fail("workload: head dim {} is not a multiple of the dump's head dim {}", s.head_dim, d.head_dim);
  const int parts = s.head_dim / d.head_dim;
  const int available = d.n_layers * d.n_kv_heads;
  if (parts > available)
    fail("workload: head dim {} needs {} heads of the dump, which has {} (layer, KV head) pairs", s.head_dim, parts,
         available);
  const int gqa = d.n_heads / d.n_kv_heads;
  if (s.group > gqa) fail("workload: group {} exceeds the dump's GQA group of {}", s.group, gqa);
  std::vector<std::pair<int, int>> pairs;
  for (int i = available - parts; i < available; ++i) pairs.emplace_back(i / d.n_kv_heads, i % d.n_kv_heads);
  return pairs;
}

// Row t of the concatenation: out (head_dim) = [part 0 | part 1 | ...] where
// part j is row t of source(pair j).
template <class Source>
void concat_row(const QkDump& d, const std::vector<std::pair<int, int>>& pairs, int64_t t, Source source, float* out) {
  for (size_t j = 0; j < pairs.size(); ++j) {
    const float* row = source(pairs[j].first, pairs[j].second) + size_t(t) * size_t(d.head_dim);
    std::copy(row, row + d.head_dim, out + j * size_t(d.head_dim));
  }
}

// A Gaussian with a given mean and covariance, sampled through the Cholesky
// factor of the covariance.
class Gaussian {
 public:
  // Fits n rows of dim values.
  Gaussian(const std::vector<float>& rows, int64_t n, int dim) : dim_(dim), mean_(size_t(dim)), chol_(size_t(dim) * dim) {
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < dim; ++c) mean_[size_t(c)] += rows[size_t(t) * dim + size_t(c)];
    for (auto& m : mean_) m /= double(n);
    std::vector<double> cov(size_t(dim) * dim, 0.0);
    std::vector<double> x(static_cast<size_t>(dim));
    for (int64_t t = 0; t < n; ++t) {
      for (int c = 0; c < dim; ++c) x[size_t(c)] = rows[size_t(t) * dim + size_t(c)] - mean_[size_t(c)];
      for (int a = 0; a < dim; ++a)
        for (int b = 0; b <= a; ++b) cov[size_t(a) * dim + size_t(b)] += x[size_t(a)] * x[size_t(b)];
    }
    double trace = 0.0;
    for (int a = 0; a < dim; ++a) trace += cov[size_t(a) * dim + size_t(a)] / double(n - 1);
    // A small ridge keeps the factorisation defined when channels are collinear.
    const double ridge = 1e-6 * trace / dim + 1e-12;
    for (int a = 0; a < dim; ++a)
      for (int b = 0; b <= a; ++b) {
        double s = cov[size_t(a) * dim + size_t(b)] / double(n - 1) + (a == b ? ridge : 0.0);
        for (int k = 0; k < b; ++k) s -= chol_[size_t(a) * dim + size_t(k)] * chol_[size_t(b) * dim + size_t(k)];
        chol_[size_t(a) * dim + size_t(b)] = a == b ? std::sqrt(std::max(s, ridge)) : s / chol_[size_t(b) * dim + size_t(b)];
      }
  }

  // out (dim) = mean + L z, z standard normal.
  void sample(std::mt19937_64& rng, float* out) const {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> z(static_cast<size_t>(dim_));
    for (auto& v : z) v = normal(rng);
    for (int a = 0; a < dim_; ++a) {
      double s = mean_[size_t(a)];
      for (int k = 0; k <= a; ++k) s += chol_[size_t(a) * dim_ + size_t(k)] * z[size_t(k)];
      out[a] = float(s);
    }
  }

 private:
  int dim_;
  std::vector<double> mean_;  // (dim)
  std::vector<double> chol_;  // (dim, dim) lower triangle
};

AttentionWorkload empty_workload(const char* kind, const WorkloadShape& s) {
  AttentionWorkload w;
  w.kind = kind;
  w.shape = s;
  w.keys.resize(size_t(s.n_keys) * size_t(s.head_dim));
  w.values.resize(w.keys.size());
  w.queries.resize(size_t(s.n_queries) * size_t(s.group) * size_t(s.head_dim));
  w.prompt_queries.resize(size_t(std::min(s.n_keys, AttentionWorkload::kPromptQueries)) * size_t(s.head_dim));
  w.scale = 1.0f / std::sqrt(float(s.head_dim));
  return w;
}

}  // namespace

AttentionWorkload workload_from_dump(const QkDump& d, const WorkloadShape& s) {
  check_shape(s);
  const auto pairs = concat_pairs(d, s);
  // Every chunk starts with BOS at position 0, whose key is the same in every
  // chunk (it sees only itself): keeping each copy would fake a sequence with
  // one attention sink per chunk. Only the first chunk's is kept.
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < d.n_tokens; ++t)
    if (t == 0 || t % d.chunk != 0) tokens.push_back(t);
  if (int64_t(tokens.size()) < s.n_keys + s.n_queries)
    fail("workload: the dump holds {} usable tokens, fewer than {} keys + {} queries", tokens.size(), s.n_keys,
         s.n_queries);
  AttentionWorkload w = empty_workload("real", s);
  const int gqa = d.n_heads / d.n_kv_heads;
  const int parts = int(pairs.size());
  // Row i of the sequence moves from its chunk position to position i:
  // rotations compose, so rotating by i − (chunk position) re-places it.
  // i >= its chunk position, since at most one token per chunk is dropped.
  // By the model's own angles (a dump built in memory may give only the base).
  const std::vector<float> freqs = d.frequencies();
  auto place = [&](float* row, int64_t i, int64_t t) {
    rope(row, parts, d.head_dim, int(i - t % d.chunk), freqs.data());
  };
  for (int64_t i = 0; i < s.n_keys; ++i) {
    const int64_t t = tokens[size_t(i)];
    float* k = w.keys.data() + size_t(i) * s.head_dim;
    concat_row(d, pairs, t, [&](int l, int h) { return d.keys(l, h); }, k);
    place(k, i, t);
    concat_row(d, pairs, t, [&](int l, int h) { return d.values(l, h); }, w.values.data() + size_t(i) * s.head_dim);
  }
  for (int64_t i = 0; i < int64_t(w.prompt_queries.size()) / s.head_dim; ++i) {
    float* q = w.prompt_queries.data() + size_t(i) * s.head_dim;
    concat_row(d, pairs, tokens[size_t(i)], [&](int l, int h) { return d.queries(l, h * gqa); }, q);
    place(q, i, tokens[size_t(i)]);
  }
  // Decode queries: the tokens right after the keys, at their positions.
  // Their own chunk's earlier tokens are the last keys, at the offsets the
  // model saw them; older chunks lie further back.
  for (int i = 0; i < s.n_queries; ++i)
    for (int g = 0; g < s.group; ++g) {
      const int64_t at = s.n_keys + i, t = tokens[size_t(at)];
      float* q = w.queries.data() + (size_t(i) * s.group + size_t(g)) * s.head_dim;
      concat_row(d, pairs, t, [&](int l, int h) { return d.queries(l, h * gqa + g); }, q);
      place(q, at, t);
    }
  return w;
}

AttentionWorkload workload_gaussian_fit(const QkDump& d, const WorkloadShape& s) {
  check_shape(s);
  const auto pairs = concat_pairs(d, s);
  const int dim = s.head_dim, qdim = s.group * dim;
  if (d.n_tokens < 2 * int64_t(qdim)) fail("workload: {} tokens are too few to fit a {}-dim Gaussian", d.n_tokens, qdim);
  const int gqa = d.n_heads / d.n_kv_heads;
  std::vector<float> k(size_t(d.n_tokens) * dim), v(k.size()), q(size_t(d.n_tokens) * qdim);
  for (int64_t t = 0; t < d.n_tokens; ++t) {
    concat_row(d, pairs, t, [&](int l, int h) { return d.keys(l, h); }, k.data() + size_t(t) * dim);
    concat_row(d, pairs, t, [&](int l, int h) { return d.values(l, h); }, v.data() + size_t(t) * dim);
    for (int g = 0; g < s.group; ++g)
      concat_row(d, pairs, t, [&](int l, int h) { return d.queries(l, h * gqa + g); },
                 q.data() + size_t(t) * qdim + size_t(g) * dim);
  }
  const Gaussian gk(k, d.n_tokens, dim), gv(v, d.n_tokens, dim), gq(q, d.n_tokens, qdim);
  AttentionWorkload w = empty_workload("fit", s);
  std::mt19937_64 rng(s.seed);
  for (int64_t t = 0; t < s.n_keys; ++t) {
    gk.sample(rng, w.keys.data() + size_t(t) * dim);
    gv.sample(rng, w.values.data() + size_t(t) * dim);
  }
  for (int i = 0; i < s.n_queries; ++i) gq.sample(rng, w.queries.data() + size_t(i) * qdim);
  std::vector<float> group_query(static_cast<size_t>(qdim));
  for (int64_t t = 0; t < int64_t(w.prompt_queries.size()) / dim; ++t) {
    gq.sample(rng, group_query.data());
    std::copy(group_query.begin(), group_query.begin() + dim, w.prompt_queries.begin() + t * dim);
  }
  return w;
}

AttentionWorkload workload_synthetic(const WorkloadShape& s) {
  check_shape(s);
  AttentionWorkload w = empty_workload("synthetic", s);
  const int d = s.head_dim;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Topic centres ~ N(0, I): on-topic scores are about |c|^2 = d above the
  // rest before scaling, i.e. sharp attention over a segment's tokens.
  const int topics = 512;
  std::vector<float> centres(size_t(topics) * d);
  for (auto& x : centres) x = normal(rng);
  // A shared key offset on 4 outlier channels (every key has it: it shifts
  // all scores of a query equally, so attention ignores it, but it moves the
  // keys away from the queries for an index), and a query mean elsewhere.
  std::vector<float> key_mean(size_t(d), 0.0f), query_mean(size_t(d), 0.0f);
  for (int c = 0; c < 4 && c < d; ++c) key_mean[size_t(c * d / 4)] = 8.0f;
  for (int c = 0; c < d; ++c) query_mean[size_t(c)] = 0.5f * normal(rng);
  std::geometric_distribution<int> segment_length(1.0 / 64);
  std::uniform_int_distribution<int> pick_topic(0, topics - 1);
  std::vector<int> topic_of(static_cast<size_t>(s.n_keys));
  for (int64_t t = 0; t < s.n_keys;) {
    const int topic = pick_topic(rng);
    const int64_t end = std::min<int64_t>(s.n_keys, t + 1 + segment_length(rng));
    for (; t < end; ++t) {
      topic_of[size_t(t)] = topic;
      for (int c = 0; c < d; ++c)
        w.keys[size_t(t) * d + size_t(c)] = key_mean[size_t(c)] + centres[size_t(topic) * d + size_t(c)] + 0.7f * normal(rng);
    }
  }
  // The first key is an attention sink: long and along the query mean.
  for (int c = 0; c < d; ++c) w.keys[size_t(c)] = key_mean[size_t(c)] + 6.0f * query_mean[size_t(c)];
  for (auto& x : w.values) x = normal(rng);
  std::uniform_int_distribution<int64_t> pick_token(0, s.n_keys - 1);
  auto query = [&](float* out) {
    const int topic = topic_of[size_t(pick_token(rng))];
    for (int c = 0; c < d; ++c) out[c] = query_mean[size_t(c)] + centres[size_t(topic) * d + size_t(c)] + 0.7f * normal(rng);
  };
  for (int i = 0; i < s.n_queries; ++i)
    for (int g = 0; g < s.group; ++g) query(w.queries.data() + (size_t(i) * s.group + size_t(g)) * d);
  for (size_t at = 0; at < w.prompt_queries.size(); at += size_t(d)) query(w.prompt_queries.data() + at);
  return w;
}

}  // namespace kvserve
