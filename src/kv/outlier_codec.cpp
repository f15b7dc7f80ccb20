#include "kv/outlier_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/rope_table.h"
#include "util/half.h"

namespace kvserve {
namespace {

struct Entry {
  uint16_t index;
  fp16_t delta;
};
static_assert(sizeof(Entry) == 4);

class OutlierCodec final : public KvCodec {
 public:
  OutlierCodec(const KvCodecConfig& c, const KvBlockShape& s, std::unique_ptr<KvCodec> inner)
      : KvCodec(c, s), inner_(std::move(inner)), count_(c.outliers), inner_bytes_(inner_->block_bytes()) {
    if ((s.head_dim & (s.head_dim - 1)) == 0) head_shift_ = __builtin_ctz(unsigned(s.head_dim));
  }

  size_t block_bytes() const override { return inner_bytes_ + size_t(shape_.block_size) * size_t(count_) * sizeof(Entry); }
  bool encodes_tokens() const override { return inner_->encodes_tokens(); }
  ByteSpan shared_bytes() const override { return {inner_bytes_, block_bytes() - inner_bytes_}; }

  void encode_token(uint8_t* block, int slot, const float* x) const override {
    std::vector<float> row(x, x + shape_.kv_dim()), centre(row.size());
    token_centres(row.data(), centre.data());
    std::vector<uint16_t> picked = pick(row.data(), centre.data());
    for (uint16_t d : picked) row[d] = centre[d];
    inner_->encode_token(block, slot, row.data());
    store(block, slot, x, picked);
  }

  void encode_block(uint8_t* block, const float* x, int n) const override {
    const int kv_dim = shape_.kv_dim();
    std::vector<float> rows(x, x + size_t(n) * kv_dim), centre(static_cast<size_t>(kv_dim));
    std::vector<std::vector<uint16_t>> picked(static_cast<size_t>(n));
    if (config_.grouping == KvGrouping::Channel) {  // a channel's centre over the block's tokens
      std::fill(centre.begin(), centre.end(), 0.0f);
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < kv_dim; ++d) centre[size_t(d)] += rows[size_t(t) * kv_dim + d] / float(n);
    }
    for (int t = 0; t < n; ++t) {
      float* row = rows.data() + size_t(t) * kv_dim;
      if (config_.grouping != KvGrouping::Channel) token_centres(row, centre.data());
      picked[size_t(t)] = pick(row, centre.data());
      for (uint16_t d : picked[size_t(t)]) row[d] = centre[d];
    }
    inner_->encode_block(block, rows.data(), n);
    std::memset(block + inner_bytes_, 0, block_bytes() - inner_bytes_);
    for (int t = 0; t < n; ++t) store(block, t, x + size_t(t) * kv_dim, picked[size_t(t)]);
  }

  void decode_token(const uint8_t* block, int slot, float* out) const override {
    inner_->decode_token(block, slot, out);
    const Entry* e = entries(block, slot);
    for (int k = 0; k < count_; ++k) out[e[k].index] += fp16_to_fp32(e[k].delta);
  }

  void score(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
             int stride) const override {
    inner_->score(q, n_q, block, n, kv_head, scale, scores, stride);
    add_score_terms(block, n_q, n, kv_head, scale, scores, stride, [&](int, int i) { return q + size_t(i) * shape_.head_dim; });
  }
  void score_tokens(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale, float* scores,
                    int stride) const override {
    inner_->score_tokens(q, n_q, block, n, kv_head, scale, scores, stride);
    add_score_terms(block, n_q, n, kv_head, scale, scores, stride,
                    [&](int t, int i) { return q + (size_t(t) * n_q + i) * shape_.head_dim; });
  }
  // Keys in RoPE spans: the inner codec's spans, then each outlier term
  // against its own span's query set.
  void score_span(const float* q, int n_q, const uint8_t* block, int begin, int end, int kv_head, float scale,
                  float* scores, int stride) const override {
    inner_->score_span(q, n_q, block, begin, end, kv_head, scale, scores, stride);
    for_each_outlier(block, end, kv_head, [&](int t, int d, float delta) {
      if (t < begin) return;
      for (int i = 0; i < n_q; ++i) scores[size_t(i) * stride + t] += scale * q[size_t(i) * shape_.head_dim + d] * delta;
    });
  }
  void score_spans(const float* q_spans, int n_q, const uint8_t* block, int n, int span, int kv_head, float scale,
                   float* scores, int stride) const override {
    inner_->score_spans(q_spans, n_q, block, n, span, kv_head, scale, scores, stride);
    add_score_terms(block, n_q, n, kv_head, scale, scores, stride,
                    [&](int t, int i) { return q_spans + (size_t(t / span) * n_q + i) * shape_.head_dim; });
  }
  // Pre-RoPE keys against queries rotated back to the block's start: each
  // outlier term meets key t's rotation by offset t, which moves delta e_d
  // to delta (cos_d e_d - sin_(d^1) e_(d^1)) in rope's table rows.
  bool score_offsets(const float* q, int n_q, const uint8_t* block, int n, int kv_head, float scale,
                     const RopeTable& rope, float* scores, int stride) const override {
    if (!inner_->score_offsets(q, n_q, block, n, kv_head, scale, rope, scores, stride)) return false;
    const int hd = shape_.head_dim;
    for_each_outlier(block, n, kv_head, [&](int t, int d, float delta) {
      const float *cs = rope.cos_row(t), *sn = rope.sin_row(t);
      const int p = d ^ 1;
      for (int i = 0; i < n_q; ++i) {
        const float* qi = q + size_t(i) * hd;
        scores[size_t(i) * stride + t] += scale * delta * (qi[d] * cs[d] - qi[p] * sn[p]);
      }
    });
    return true;
  }

  void accumulate(const float* weights, int n_q, int stride, const uint8_t* block, int n, int kv_head,
                  float* out) const override {
    inner_->accumulate(weights, n_q, stride, block, n, kv_head, out);
    const int hd = shape_.head_dim;
    for_each_outlier(block, n, kv_head, [&](int t, int d, float delta) {
      for (int i = 0; i < n_q; ++i) out[size_t(i) * hd + d] += weights[size_t(i) * stride + t] * delta;
    });
  }

 private:
  const Entry* entries(const uint8_t* block, int slot) const {
    return reinterpret_cast<const Entry*>(block + inner_bytes_) + size_t(slot) * count_;
  }
  // Token groups: each head's mean is the centre of its values.
  void token_centres(const float* row, float* centre) const {
    const int hd = shape_.head_dim;
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      const float mean = std::accumulate(row + h * hd, row + (h + 1) * hd, 0.0f) / float(hd);
      std::fill(centre + h * hd, centre + (h + 1) * hd, mean);
    }
  }
  // The count_ places of the row furthest from their centres.
  std::vector<uint16_t> pick(const float* row, const float* centre) const {
    std::vector<uint16_t> idx(static_cast<size_t>(shape_.kv_dim()));
    std::iota(idx.begin(), idx.end(), uint16_t(0));
    std::partial_sort(idx.begin(), idx.begin() + count_, idx.end(), [&](uint16_t a, uint16_t b) {
      return std::fabs(row[a] - centre[a]) > std::fabs(row[b] - centre[b]);
    });
    idx.resize(size_t(count_));
    return idx;
  }
  // Each picked place's exact value minus what the inner codec decodes there.
  void store(uint8_t* block, int slot, const float* x, const std::vector<uint16_t>& picked) const {
    std::vector<float> decoded(static_cast<size_t>(shape_.kv_dim()));
    inner_->decode_token(block, slot, decoded.data());
    Entry* e = reinterpret_cast<Entry*>(block + inner_bytes_) + size_t(slot) * count_;
    for (int k = 0; k < count_; ++k) {
      const uint16_t d = picked[size_t(k)];
      e[k] = {d, fp32_to_fp16(std::clamp(x[d] - decoded[d], -65504.0f, 65504.0f))};  // fp16's range, never inf
    }
  }
  // query(t, i): query i's head_dim floats as token t meets them.
  template <class Query>
  void add_score_terms(const uint8_t* block, int n_q, int n, int kv_head, float scale, float* scores, int stride,
                       const Query& query) const {
    for_each_outlier(block, n, kv_head, [&](int t, int d, float delta) {
      for (int i = 0; i < n_q; ++i) scores[size_t(i) * stride + t] += scale * query(t, i)[d] * delta;
    });
  }
  // f(t, d, delta) for each outlier of head kv_head among the first n
  // tokens: d its channel in the head. Most tokens' outliers sit in other
  // heads, so the entries are scanned 16 at a time and only hits visited.
  template <class F>
  void for_each_outlier(const uint8_t* block, int n, int kv_head, const F& f) const {
    const int hd = shape_.head_dim;
    const Entry* e = entries(block, 0);
    const int total = n * count_;
    int k = 0;
#if defined(__AVX512F__)
    if (head_shift_ >= 0) {
      const __m512i head = _mm512_set1_epi32(kv_head);
      for (; k < total; k += 16) {
        const __mmask16 m = total - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (total - k)) - 1);
        // Whole vectors load unmasked: a masked load across two cache lines (the
        // entries start wherever the inner block ends) cost ~2 ms of a 16K step.
        const __m512i v = m == 0xFFFF ? _mm512_loadu_si512(e + k) : _mm512_maskz_loadu_epi32(m, e + k);
        const __m512i idx = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
        __mmask16 hit = _mm512_mask_cmpeq_epi32_mask(m, _mm512_srli_epi32(idx, unsigned(head_shift_)), head);
        hit = _mm512_mask_test_epi32_mask(hit, v, _mm512_set1_epi32(int32_t(0xFFFF0000u)));  // delta != 0
        for (; hit != 0; hit &= __mmask16(hit - 1)) {
          const int j = k + __builtin_ctz(hit);
          f(count_ == 1 ? j : j / count_, e[j].index & (hd - 1), fp16_to_fp32(e[j].delta));
        }
      }
      return;
    }
#endif
    for (; k < total; ++k)
      if (e[k].index / hd == kv_head && e[k].delta != 0) f(k / count_, e[k].index % hd, fp16_to_fp32(e[k].delta));
  }

  std::unique_ptr<KvCodec> inner_;
  int count_;           // outliers per token row
  size_t inner_bytes_;  // the inner codec's block
  int head_shift_ = -1; // log2(head_dim) when a power of two: the vector scan
};

}  // namespace

std::unique_ptr<KvCodec> make_outlier_codec(const KvCodecConfig& config, const KvBlockShape& shape,
                                            std::unique_ptr<KvCodec> inner) {
  return std::make_unique<OutlierCodec>(config, shape, std::move(inner));
}

}  // namespace kvserve
