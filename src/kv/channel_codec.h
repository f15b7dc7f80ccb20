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

// The rounding steps across the largest folded query channel (q_c scale_c)
// in the vector score kernel of dynamic channel-grouped codes: 127 where
// 4-bit codes in key groups of 32+ tokens meet 8-bit queries (vpdpbusd;
// AVX-512 VNNI and VBMI builds), else 32767 (16-bit pairs). For error bounds.
int channel_query_steps(const KvCodecConfig& config, const KvBlockShape& shape);

}  // namespace kvserve
