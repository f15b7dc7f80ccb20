// Dense-and-sparse KV storage (KVQuant's outlier isolation): the few values
// of each token row that lie furthest from their group's centre are kept
// exactly, beside another codec that stores the rest. The outliers are
// replaced by the centre before the inner codec encodes the row, so they no
// longer stretch its ranges; each then stores its index and the difference
// between its value and what the inner codec decodes at that place (fp16).
// Attention runs the inner kernels and adds each outlier's term:
//   score += scale q_d delta,   out_d += w_t delta.
// Layout: the inner codec's block, then per token slot `outliers` entries of
// (uint16 index into the row, fp16 delta); unused entries hold delta 0.
#pragma once

#include <memory>

#include "kv/kv_codec.h"

namespace kvserve {

// Wraps inner (built from config without outliers). REQUIRES:
// 0 < config.outliers <= the row's kv_dim (make_kv_codec checks).
std::unique_ptr<KvCodec> make_outlier_codec(const KvCodecConfig& config, const KvBlockShape& shape,
                                            std::unique_ptr<KvCodec> inner);

}  // namespace kvserve
