// `kvserve calibrate`: measures, on real text, the value range of every K and
// V channel of every layer (with percentile clipping) for static scales, and
// each layer's sensitivity to quantization to pick a mixed-precision
// assignment that meets an average bit budget with the least loss.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/transformer.h"
#include "kv/kv_calibration.h"

namespace kvserve {

struct CalibrateOptions {
  int32_t ctx = 512;             // tokens per chunk (as perplexity)
  int32_t skip_chunks = 0;       // chunks at the start of the text left out (held out for evaluation)
  int32_t range_chunks = 8;      // chunks observed for the ranges
  double percentile = 99.9;      // keep [100 - p, p] percentiles of each channel
  // Mixed precision: 0 = no assignment; else the average code bits per K/V
  // value (16, 8, 4, 2 per type; scales and zero points not counted — the
  // bytes they add are reported per configuration) the assignment must not exceed.
  double target_bits = 0;
  int32_t sensitivity_chunks = 4;  // chunks per sensitivity measurement
  std::vector<KvDType> candidates = {KvDType::F16, KvDType::INT8, KvDType::INT4, KvDType::INT2};
  // Layout of the quantized candidates (grouping, group size, residual, block
  // size); their types are replaced per candidate.
  KvCacheOptions layout;
  bool static_scales = true;     // measure sensitivity with the calibrated static ranges
};

using CalibrateProgress = std::function<void(const std::string& stage, int32_t done, int32_t total)>;

// tokens: the calibration text, BOS first. Throws kvserve::Error when the text
// is shorter than the chunks asked for.
KvCalibration calibrate_kv(Transformer& transformer, std::span<const int32_t> tokens, int32_t bos_id,
                           const CalibrateOptions& options, const CalibrateProgress& progress = nullptr);

// Chooses one option per item minimising the summed cost subject to
// mean(bits) <= target_bits. cost/bits: (items, options). Returns the chosen
// option per item; throws kvserve::Error when no choice meets the target.
std::vector<int> choose_assignment(const std::vector<std::vector<double>>& cost,
                                   const std::vector<std::vector<double>>& bits, double target_bits);

}  // namespace kvserve
