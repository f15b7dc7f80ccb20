// Integer KV codecs: asymmetric INT8/INT4/INT2 with an fp16 (scale, min) pair
// per group — token groups along the row, or channel groups across the tokens
// of a block — or fixed per-channel ranges from calibration (static scales);
// and llama.cpp's symmetric q4_0 scheme as a baseline.
#pragma once

#include <memory>

#include "kv/kv_codec.h"

namespace kvserve {

// REQUIRES: config validated by make_kv_codec.
std::unique_ptr<KvCodec> make_int_codec(const KvCodecConfig& config, const KvBlockShape& shape);
std::unique_ptr<KvCodec> make_q4_0_codec(const KvCodecConfig& config, const KvBlockShape& shape);

}  // namespace kvserve
