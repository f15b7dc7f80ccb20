// Integer codes with channel groups: per group of tokens an fp16 (scale, min)
// pair per channel (KIVI's layout for keys), or fixed per-channel ranges from
// calibration (static scales). Built through make_int_codec.
#pragma once

#include <memory>

#include "kv/kv_codec.h"

namespace kvserve {

// REQUIRES: config validated by make_kv_codec; an integer type with channel
// grouping or static ranges.
std::unique_ptr<KvCodec> make_channel_codec(const KvCodecConfig& config, const KvBlockShape& shape);

}  // namespace kvserve
