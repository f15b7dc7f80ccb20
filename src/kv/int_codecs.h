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

// The rounding steps across the largest folded value weight (w_t scale_t)
// in the accumulate of 4-bit values with one group per head: 127 where they
// meet 8-bit weights (vpdpbusd; AVX-512 VNNI and VBMI builds, blocks of 32+
// tokens, a multiple of 4; vpmaddubsw on AVX2 builds, blocks of 16+), else 0
// (16-bit or float weights). For error bounds.
// config as the codec holds it (group size resolved); the answer is what a
// codec created now would do (see set_byte_value_weights).
int token_weight_steps(const KvCodecConfig& config, const KvBlockShape& shape);

// The rounding steps across max |q| of the query that token-grouped and
// q4_0 keys are scored against as integers (AVX2 builds,
// token_key_scores8.h): 127 for 4- and 2-bit codes and q4_0, up to 32767 for
// 8-bit ones; 0 where keys are scored in floats. For error bounds, as
// token_weight_steps.
int token_query_steps(const KvCodecConfig& config, const KvBlockShape& shape);

// Process-wide, for benchmarks and tests: false makes codecs created from
// then on keep 16-bit weights where they would take 8-bit ones.
void set_byte_value_weights(bool enabled);

}  // namespace kvserve
