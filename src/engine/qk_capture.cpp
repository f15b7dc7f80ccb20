#include "engine/qk_capture.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "util/error.h"

namespace kvserve {

QkDump capture_qk(Transformer& transformer, KvCache& cache, std::span<const int32_t> tokens, int32_t bos_id,
                  const QkCaptureOptions& options) {
  const ModelConfig& c = transformer.config();
  const int32_t chunk = options.chunk == 0 ? c.seq_len : options.chunk;
  if (chunk < 2 || chunk > c.seq_len) fail("capture chunk {} is out of range (2..{}, the model's context)", chunk, c.seq_len);
  if (options.batch < 1) fail("capture batch must be positive");
  for (int layer = 0; layer < c.n_layers; ++layer)
    if (cache.k_pre_rope(layer)) fail("capturing Q/K needs keys stored after RoPE (drop --kv-k-pre-rope)");
  int64_t chunks = int64_t(tokens.size()) / chunk;
  if (options.max_tokens > 0) chunks = std::min<int64_t>(chunks, (options.max_tokens + chunk - 1) / chunk);
  if (chunks < 1) fail("the text has {} tokens, fewer than one chunk of {}", tokens.size(), chunk);

  const int hd = c.head_dim();
  QkDump d;
  d.n_layers = c.n_layers;
  d.n_heads = c.n_heads;
  d.n_kv_heads = c.n_kv_heads;
  d.head_dim = hd;
  d.chunk = chunk;
  d.rope_theta = c.rope_theta;
  d.rope_freqs = c.rope_frequencies();  // the workloads re-place keys by the model's own angles
  d.n_tokens = chunks * chunk;
  d.allocate();

  int64_t base = 0;  // dump row of the first token of the current forward pass
  // Observers get (n, heads * head_dim) rows; the dump wants (layer, head, token, head_dim).
  auto scatter = [&](const float* rows, int64_t n, int heads, auto head_rows) {
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h)
        std::memcpy(head_rows(h) + size_t(base + t) * size_t(hd), rows + (size_t(t) * size_t(heads) + size_t(h)) * size_t(hd),
                    size_t(hd) * sizeof(float));
  };
  transformer.set_query_observer([&](int layer, const float* q, int64_t n) {
    scatter(q, n, c.n_heads, [&](int h) { return d.queries(layer, h); });
  });
  transformer.set_kv_observer([&](int layer, const float* k, const float* v, int64_t n) {
    scatter(k, n, c.n_kv_heads, [&](int h) { return d.keys(layer, h); });
    scatter(v, n, c.n_kv_heads, [&](int h) { return d.values(layer, h); });
  });

  std::vector<int32_t> seq(static_cast<size_t>(chunk));
  Logits logits;
  try {
    for (int64_t ci = 0; ci < chunks; ++ci) {
      std::copy(tokens.begin() + ci * chunk, tokens.begin() + (ci + 1) * chunk, seq.begin());
      seq[0] = bos_id;
      BlockTable table;
      std::vector<BatchEntry> batch(1);
      batch[0].table = &table;
      for (int32_t start = 0; start < chunk; start += options.batch) {
        const int32_t n = std::min(options.batch, chunk - start);
        if (!cache.reserve(table, n)) {
          cache.release(table);
          fail("out of KV blocks capturing a chunk of {} tokens", chunk);
        }
        batch[0].tokens = std::span<const int32_t>(seq.data() + start, size_t(n));
        base = ci * chunk + start;
        transformer.forward(batch, cache, logits);
      }
      cache.release(table);
    }
  } catch (...) {
    transformer.set_query_observer(nullptr);
    transformer.set_kv_observer(nullptr);
    throw;
  }
  transformer.set_query_observer(nullptr);
  transformer.set_kv_observer(nullptr);
  return d;
}

}  // namespace kvserve
