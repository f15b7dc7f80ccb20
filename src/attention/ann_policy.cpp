#include "attention/ann_policy.h"

#include <algorithm>

namespace kvserve {

AnnPolicy::AnnPolicy(const SparsityOptions& options, const KvCache& cache)
    : options_(options),
      n_kv_heads_(cache.k_codec(0).shape().n_kv_heads),
      head_dim_(cache.k_codec(0).shape().head_dim),
      block_size_(cache.block_size()) {
  KeyIndexOptions ko;
  ko.backend = options.ann_backend;
  ko.transform = options.ann_transform;
  ko.dim = head_dim_;
  for (int i = 0; i < cache.n_layers() * n_kv_heads_; ++i) indexes_.push_back(make_key_index(ko));
}

void AnnPolicy::begin_forward(const KvCache& cache, BlockTable& table, int32_t n_new) {
  if (keys_indexed_ >= table.num_tokens) return;
  const size_t kv_dim = size_t(n_kv_heads_) * size_t(head_dim_);
  std::vector<float> keys(size_t(table.num_tokens - keys_indexed_) * kv_dim);
  const int32_t first = keys_indexed_;
  for (int l = 0; l < cache.n_layers(); ++l) {
    cache.read_keys(l, table, first, table.num_tokens, keys.data());
    for (int32_t s = first; s < table.num_tokens; ++s) on_kv(l, s, keys.data() + size_t(s - first) * kv_dim, nullptr);
  }
}

void AnnPolicy::on_kv(int layer, int32_t slot, const float* k, const float* v) {
  if (layer == 0) keys_indexed_ = std::max(keys_indexed_, slot + 1);
  const int64_t id = slot;
  for (int h = 0; h < n_kv_heads_; ++h)
    indexes_[size_t(layer) * n_kv_heads_ + h]->add(std::span<const float>(k + size_t(h) * head_dim_, size_t(head_dim_)),
                                                   std::span<const int64_t>(&id, 1));
}

void AnnPolicy::select(int layer, int kv_head, const float* q, int group, int32_t n_ctx, ReadSet& out) const {
  out.blocks.clear();
  out.keep.clear();
  if (n_ctx <= options_.budget) return;  // everything fits the budget
  const int32_t sinks = options_.sinks, window = options_.window, retrieved = options_.budget - sinks - window;
  out.keep.assign(size_t(n_ctx), 0);
  std::fill_n(out.keep.begin(), sinks, uint8_t(1));
  std::fill(out.keep.end() - window, out.keep.end(), uint8_t(1));
  if (retrieved > 0) {
    // Search past what sinks and window already hold, then keep the best
    // `retrieved` others by the best score any of the group's heads gave.
    const KeyIndex& index = *indexes_[size_t(layer) * n_kv_heads_ + kv_head];
    const int k = int(std::min<int64_t>(index.size(), int64_t(retrieved) + sinks + window));
    thread_local KeySearchResult found;
    thread_local std::vector<std::pair<float, int64_t>> ranked;  // (score, id)
    index.search(std::span<const float>(q, size_t(group) * size_t(head_dim_)), k, found);
    ranked.clear();
    for (size_t i = 0; i < found.ids.size(); ++i) {
      const int64_t id = found.ids[i];
      if (id < 0 || id >= n_ctx || out.keep[size_t(id)]) continue;
      ranked.emplace_back(found.scores[i], id);
    }
    // Best score first; an id found by several heads keeps its best entry.
    std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    int32_t taken = 0;
    for (const auto& [score, id] : ranked) {
      if (taken == retrieved) break;
      if (out.keep[size_t(id)]) continue;
      out.keep[size_t(id)] = 1;
      ++taken;
    }
  }
  for (int32_t b = 0; b * block_size_ < n_ctx; ++b)
    for (int32_t s = b * block_size_; s < std::min(n_ctx, (b + 1) * block_size_); ++s)
      if (out.keep[size_t(s)]) {
        out.blocks.push_back(b);
        break;
      }
}

double AnnPolicy::build_seconds() const {
  double s = 0;
  for (const auto& index : indexes_) s += index->build_seconds();
  return s;
}

}  // namespace kvserve
