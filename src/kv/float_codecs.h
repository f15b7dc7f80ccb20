// Plain floating-point KV storage: fp32, fp16, bf16, token-major.
#pragma once

#include <memory>

#include "kv/kv_codec.h"

namespace kvserve {

std::unique_ptr<KvCodec> make_float_codec(const KvCodecConfig& config, const KvBlockShape& shape);

}  // namespace kvserve
